"""``text``: any Hugging Face sequence-classification model from a local directory.

``AutoModelForSequenceClassification.from_pretrained(<local dir>, num_labels=K)`` - BERT,
DistilBERT, MiniLM (the real all-MiniLM-L6-v2 ships offline as ``model_path:
all-MiniLM-L6-v2``), RoBERTa, ... A hub name is accepted only when it is in the local cache
(``pipeline.hf_local.resolve_model_path``); a missing path is a ``ModelPathError``.

Losses (``pipeline.tasks``):
  single-label  cross-entropy  -log softmax(z)_y  (optional label smoothing)
  multi-label   BCE            (1/K) sum_k -[y_k log s(z_k) + (1 - y_k) log(1 - s(z_k))]
                (LEDGAR-style multi-label provisions; ``multi_label: true``)
The task is a ``TokenTask`` whose vocabulary size and special ids come from the model's own
tokenizer (same directory, or ``tokenizer``), so token perturbations never draw ids outside the
vocabulary and never overwrite [CLS]/[SEP]/[PAD].

Attention is the eager implementation by default and the padding mask is handed over as a
ready 4-D additive mask (``HFTextTask``), so per-sample gradients (vmap) and exact
Hessian-vector products (forward-over-reverse AD) run through the model.

CPU budget option ``train_last_layers: k`` freezes the embeddings and all but the last k
transformer layers (k = 0: only the head and pooler train). Frozen parameters are excluded from
the objective's weight decay and from every removal method (they only see requires_grad
parameters), so the convex-objective bookkeeping is unchanged.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from pipeline.hf_local import quiet_transformers, resolve_model_path, tokenizer_facts
from pipeline.models.loading import Layout, StateDict, add_prefix, register_head, register_layout
from pipeline.models.registry import Preset, register_preset
from pipeline.tasks import Batch, TokenTask

DEFAULT_MODEL = "all-MiniLM-L6-v2"
# Where architectures keep their stack of transformer layers (relative to the base model).
LAYER_STACKS: tuple[str, ...] = ("encoder.layer", "transformer.layer", "encoder.layers", "layers", "h")
# Modules inside the base model that belong to the classification head.
HEAD_INSIDE_BASE: tuple[str, ...] = ("pooler",)


ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = ("eager", "sdpa")


def build_text(
    *, model_path: str = DEFAULT_MODEL, num_labels: int = 2, multi_label: bool = False,
    train_last_layers: int | None = None, dropout: float | None = None, attention: str = "eager", **_: Any,
) -> nn.Module:
    """Load the local HF directory with a fresh K-way head; optionally freeze the encoder.

    ``attention: eager`` (default) is the plain softmax(QK^T/sqrt(d) + mask) V: it supports
    forward-mode AD and vmap, which the exact Hessian-vector products (forward-over-reverse) and
    per-sample gradients of the removal methods need; PyTorch's CPU flash-attention kernel
    (``sdpa``) has no forward-mode derivative."""
    quiet_transformers()
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"model.options.attention must be one of {ATTENTION_IMPLEMENTATIONS}, got '{attention}'")
    path = resolve_model_path(model_path)
    config = AutoConfig.from_pretrained(str(path), num_labels=int(num_labels))
    config.problem_type = "multi_label_classification" if multi_label else "single_label_classification"
    if dropout is not None:
        for attr in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout", "seq_classif_dropout"):
            if hasattr(config, attr):
                setattr(config, attr, float(dropout))
    model = AutoModelForSequenceClassification.from_pretrained(str(path), config=config, attn_implementation=attention)
    if train_last_layers is not None:
        freeze_all_but_last(model, int(train_last_layers))
    return model


def layer_stack(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The qualified name and ModuleList of the model's transformer layers."""
    base = getattr(model, "base_model", model)
    prefix = getattr(model, "base_model_prefix", "")
    for rel in LAYER_STACKS:
        module: Any = base
        for part in rel.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, nn.ModuleList):
            return (f"{prefix}.{rel}" if prefix and base is not model else rel), module
    raise ValueError(
        f"cannot find the transformer layer stack of {type(model).__name__} (looked for {LAYER_STACKS}); "
        "set model.options.train_last_layers to null to train every parameter"
    )


def freeze_all_but_last(model: nn.Module, k: int) -> list[str]:
    """requires_grad=False for the base model except its last ``k`` layers and its pooler.

    Returns the names of the parameters left trainable."""
    if k < 0:
        raise ValueError(f"model.options.train_last_layers must be >= 0 (or null for all), got {k}")
    stack_name, stack = layer_stack(model)
    if k > len(stack):
        raise ValueError(f"model.options.train_last_layers={k} but the model has {len(stack)} layers")
    prefix = getattr(model, "base_model_prefix", "")
    trainable_prefixes = [f"{stack_name}.{i}." for i in range(len(stack) - k, len(stack))]
    trainable_prefixes += [f"{prefix}.{name}." for name in HEAD_INSIDE_BASE]
    kept: list[str] = []
    for name, param in model.named_parameters():
        in_base = bool(prefix) and name.startswith(prefix + ".")
        train = (not in_base) or name.startswith(tuple(trainable_prefixes))
        param.requires_grad_(train)
        if train:
            kept.append(name)
    return kept


def _facts_from_config(path: Path) -> dict[str, Any]:
    cfg = json.loads((path / "config.json").read_text())
    special = {int(cfg[k]) for k in ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")
               if isinstance(cfg.get(k), int)}
    return {"vocab_size": int(cfg["vocab_size"]), "special_ids": tuple(sorted(special)) or (0,)}


@dataclass
class HFTextTask(TokenTask):
    """TokenTask whose padding mask reaches the model as an additive 4-D float mask
    m[b, 0, 0, j] = 0 for real tokens and the dtype's most negative number for padding.

    Hugging Face turns a 2-D 0/1 mask into this itself, but first inspects its values
    (``mask.all()``, to skip masking when nothing is padded): data-dependent control flow that
    ``torch.func.vmap`` (per-sample gradients, batched Hessian-vector products) cannot trace.
    A ready 4-D mask is used as given, and the attention scores are the same."""

    def model_args(self, batch: Batch) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
        args, kwargs = super().model_args(batch)
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            keep = mask[:, None, None, :].to(torch.float32)
            kwargs["attention_mask"] = (1.0 - keep) * torch.finfo(torch.float32).min
        return args, kwargs


def text_task(
    *, model_path: str = DEFAULT_MODEL, tokenizer: str | None = None, multi_label: bool = False,
    label_smoothing: float = 0.0, **_: Any,
) -> TokenTask:
    """TokenTask with the tokenizer's vocabulary size and special ids (the config's when the
    directory ships no tokenizer, e.g. a randomly initialised test model)."""
    source = tokenizer or model_path
    path = resolve_model_path(source, field="tokenizer" if tokenizer else "model_path")
    has_tokenizer = any((path / f).exists() for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "spiece.model"))
    facts = tokenizer_facts(str(path)) if has_tokenizer else _facts_from_config(path)
    if multi_label:
        loss, options = "bce_multilabel", {}
    else:
        loss, options = "cross_entropy", ({"label_smoothing": float(label_smoothing)} if label_smoothing else {})
    return HFTextTask(loss=loss, loss_options=options, vocab_size=facts["vocab_size"], special_ids=tuple(facts["special_ids"]))


# ---------------------------------------------------------------------------------------------
# checkpoint layouts: a saved sequence-classification model, or a bare encoder (BertModel ...)
# ---------------------------------------------------------------------------------------------
def _detect_hf_full(state: Mapping[str, Tensor], model: nn.Module) -> bool:
    prefix = getattr(model, "base_model_prefix", "")
    return bool(prefix) and any(k.startswith(prefix + ".") for k in state)


def _detect_hf_base(state: Mapping[str, Tensor], model: nn.Module) -> bool:
    prefix = getattr(model, "base_model_prefix", "")
    base_keys = {k[len(prefix) + 1:] for k in model.state_dict() if k.startswith(prefix + ".")}
    return bool(prefix) and bool(state) and not any(k.startswith(prefix + ".") for k in state) \
        and len(set(state) & base_keys) > 0


def _convert_hf_base(state: StateDict, model: nn.Module) -> StateDict:
    """Encoder-only checkpoint (keys without the base-model prefix): add the prefix. The head is
    absent, so load it with scope='backbone'."""
    return add_prefix(state, getattr(model, "base_model_prefix") + ".")


register_layout("text", Layout("hf", _detect_hf_full, lambda s, m: dict(s),
                               "a saved *ForSequenceClassification (keys start with the base-model prefix)"))
register_layout("text", Layout("hf-base", _detect_hf_base, _convert_hf_base,
                               "a bare encoder directory (BertModel/DistilBertModel keys, no prefix)"))
# The head: classifier (+ DistilBERT's pre_classifier) and BERT's pooler.
register_head("text", ("classifier.", "pre_classifier.", "bert.pooler.", "roberta.pooler."))
register_preset(Preset(
    "text", build_text, text_task,
    {"weight_decay": 1e-4, "epochs": 3, "lr": 0.05, "batch_size": 32, "optimizer": "sgd", "max_length": 128},
    "HF sequence classifier from a local directory (BERT, DistilBERT, MiniLM); CE or multi-label BCE",
))
