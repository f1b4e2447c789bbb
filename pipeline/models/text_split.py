"""Where a Hugging Face BERT-family sequence classifier divides for a removal (``pipeline.frozen_prefix``).

The classifier is embeddings -> transformer layers 0..L-1 -> pooler (tanh(W h_[CLS] + b)) ->
dropout -> classifier. For a block whose parameters all lie in the layers from k on (and the
pooler and classifier), everything before layer k is constant during the removal: its output on D
(the hidden states entering layer k, (n, T, H)) is cached once and the removal's passes run layers
k.. and the head only (``TextSuffix``). A block in the head alone caches less: the [CLS] hidden
state for the pooler, the pooled features for the classifier (then the decision layer, in closed
form). The prefix's outputs are read off the model's own forward pass (a pre-hook on the first
suffix module captures its input and stops the pass there), so they are exactly what the whole model
computes, whatever its attention implementation; the suffix is the model's own module objects under
their qualified names (``bert.encoder.layer.5.attention...``, ``classifier.weight``).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.frozen_prefix import Split, register_splitter
from pipeline.param_block import ParamBlock
from pipeline.tasks import Batch, DenseInputTask, Task

__all__ = ["HiddenStateTask", "TextSuffix", "text_split"]


class _Stop(Exception):
    """Raised by the capturing pre-hook: the rest of the forward pass is not needed."""


def _input_of(model: nn.Module, module: nn.Module, task: Task, batch: Batch) -> Tensor:
    """The first positional input ``module`` receives when ``model`` runs on ``batch`` (the pass
    stops there)."""
    captured: list[Tensor] = []

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.append(args[0] if args else kwargs["hidden_states"])
        raise _Stop

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        args, kwargs = task.model_args(batch)
        model(*args, **kwargs)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{type(module).__name__} never ran in the model's forward pass")
    return captured[0].detach()


@dataclass
class HiddenStateTask(Task):
    """The suffix of a text classifier: hidden states entering a transformer layer under
    ``"hidden"`` (n, T, H) and the 0/1 padding mask under ``"attention_mask"``. No perturbation
    (the probe perturbs tokens, before the prefix)."""

    kind = "hidden"

    def model_args(self, batch: Batch) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
        return (batch["hidden"], batch["attention_mask"]), {}

    def _perturb(self, batch: Batch, generator: torch.Generator, options: Any) -> Batch:
        raise ValueError("hidden states are not perturbed: probe the whole model (its tokens) instead")


class TextSuffix(nn.Module):
    """Transformer layers ``start``.. of a BERT-family classifier, its pooler, dropout and
    classifier, under the model's own qualified names; forward(hidden, attention_mask) -> logits."""

    def __init__(self, model: nn.Module, start: int):
        super().__init__()
        prefix = model.base_model_prefix
        base, head = model.base_model, nn.Module()
        head.encoder = nn.Module()
        head.encoder.layer = nn.ModuleDict(OrderedDict((str(i), base.encoder.layer[i])
                                                       for i in range(start, len(base.encoder.layer))))
        head.pooler = base.pooler
        setattr(self, prefix, head)
        self.base_name = prefix
        self.dropout, self.classifier = model.dropout, model.classifier

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        base = getattr(self, self.base_name)
        keep = attention_mask[:, None, None, :].to(hidden.dtype)
        additive = (1.0 - keep) * torch.finfo(hidden.dtype).min  # the mask HFTextTask hands the model
        for layer in base.encoder.layer.values():
            out = layer(hidden, attention_mask=additive)
            hidden = out[0] if isinstance(out, tuple) else out
        pooled = base.pooler(hidden) if base.pooler is not None else hidden[:, 0]
        return self.classifier(self.dropout(pooled))


class _PooledHead(nn.Module):
    """The pooler, dropout and classifier over the [CLS] hidden state (n, 1, H), model names."""

    def __init__(self, model: nn.Module):
        super().__init__()
        holder = nn.Module()
        holder.pooler = model.base_model.pooler
        setattr(self, model.base_model_prefix, holder)
        self.base_name = model.base_model_prefix
        self.dropout, self.classifier = model.dropout, model.classifier

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.dropout(getattr(self, self.base_name).pooler(x)))


def _is_bert_classifier(model: nn.Module) -> bool:
    base = getattr(model, "base_model", None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    return (isinstance(getattr(model, "classifier", None), nn.Linear) and isinstance(layers, nn.ModuleList)
            and hasattr(model, "dropout") and hasattr(base, "pooler") and bool(getattr(model, "base_model_prefix", "")))


@register_splitter
def text_split(model: nn.Module, task: Task, block: ParamBlock) -> Split | None:
    """The split of a BERT-family classifier at the first module holding a block parameter
    (module docstring); None for other models or a block that reaches the embeddings."""
    if getattr(task, "kind", None) != "tokens" or not _is_bert_classifier(model):
        return None
    prefix = model.base_model_prefix
    names = [part.name for part in block.parts]
    layer_of = [int(n[len(f"{prefix}.encoder.layer."):].split(".", 1)[0]) for n in names
                if n.startswith(f"{prefix}.encoder.layer.")]
    in_pooler = any(n.startswith(f"{prefix}.pooler.") for n in names)
    if any(not (n.startswith((f"{prefix}.encoder.layer.", f"{prefix}.pooler.", "classifier."))) for n in names):
        return None  # the block reaches the embeddings (or a module this split does not know)
    dense = DenseInputTask(loss=task.loss, loss_options=dict(task.loss_options))
    if layer_of:
        start = min(layer_of)
        if start == 0:
            return None  # nothing before the block but the embeddings: the whole model runs anyway
        hidden_task = HiddenStateTask(loss=task.loss, loss_options=dict(task.loss_options))

        def prefix_hidden(m: nn.Module, batch: Batch) -> Batch:
            return {"hidden": _input_of(m, m.base_model.encoder.layer[start], task, batch)}

        return Split(f"{prefix}.encoder.layer.{start}", prefix_hidden, lambda m: TextSuffix(m, start), hidden_task,
                     ("input_ids", "token_type_ids"), ("hidden",))
    if in_pooler and model.base_model.pooler is not None:
        def prefix_cls(m: nn.Module, batch: Batch) -> Batch:
            return {"x": _input_of(m, m.base_model.pooler, task, batch)[:, :1]}

        return Split(f"{prefix}.pooler", prefix_cls, _PooledHead, dense, ("input_ids", "attention_mask",
                                                                          "token_type_ids"))

    def prefix_pooled(m: nn.Module, batch: Batch) -> Batch:
        return {"x": _input_of(m, m.classifier, task, batch)}

    return Split("classifier", prefix_pooled, lambda m: nn.Sequential(OrderedDict(classifier=m.classifier)), dense,
                 ("input_ids", "attention_mask", "token_type_ids"))
