"""Tasks: how a model is called on a batch, its per-sample loss, and how inputs are perturbed.

A task turns any ``nn.Module`` into something the removal methods can work with. Batches are
dicts of tensors: dense inputs (images, features) live under ``"x"``; token inputs under
``"input_ids"`` and ``"attention_mask"``; targets under ``"y"``.

Loss conventions (per sample; the training objective is their mean plus (lambda/2)||w||^2):
  cross_entropy   -log softmax(f(x))_y, optional label smoothing
  bce_multilabel  mean over labels of BCE-with-logits (multi-label text, LEDGAR style)
  mse             mean over outputs of (f(x) - y)^2 (so the mean loss is the mean over
                  samples *and* outputs, as torch.nn.MSELoss)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

Batch = dict[str, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]


def _cross_entropy(label_smoothing: float = 0.0) -> LossFn:
    def loss(logits: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(logits, y.long(), reduction="none", label_smoothing=label_smoothing)

    return loss


def _bce_multilabel() -> LossFn:
    def loss(logits: Tensor, y: Tensor) -> Tensor:
        per = F.binary_cross_entropy_with_logits(logits, y.to(logits.dtype), reduction="none")
        return per.reshape(per.shape[0], -1).mean(dim=1)

    return loss


def _mse() -> LossFn:
    def loss(out: Tensor, y: Tensor) -> Tensor:
        diff = out - y.to(out.dtype).reshape(out.shape)
        return diff.pow(2).reshape(diff.shape[0], -1).mean(dim=1)

    return loss


LOSSES: dict[str, Callable[..., LossFn]] = {
    "cross_entropy": _cross_entropy,
    "bce_multilabel": _bce_multilabel,
    "mse": _mse,
}


def make_loss(name: str, **options: Any) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"loss '{name}' is unknown; choose one of {sorted(LOSSES)}")
    return LOSSES[name](**options)


def output_logits(outputs: Any) -> Tensor:
    """Model outputs as a tensor: plain tensors pass through, HF outputs give ``.logits``."""
    if isinstance(outputs, Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, (tuple, list)):
        logits = outputs[0]
    if not isinstance(logits, Tensor):
        raise TypeError("the model returned neither a tensor nor an object with .logits")
    return logits


class PerturbOptions(BaseModel):
    """How the probe perturbs the forget samples; the field names are the method settings'
    (``perturb_sigma``, ``token_replacements``) all the way down, and unknown keys are errors.

    It is also a read-only mapping of its fields, so ``task.perturb(batch, g, **options)``
    works and re-validates."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    perturb_sigma: float = Field(0.1, ge=0, description="std of the input noise (dense inputs)")
    token_replacements: int = Field(2, ge=0, description="tokens replaced per sequence (text); 0 = none")

    def keys(self) -> list[str]:
        return list(type(self).model_fields)

    def __getitem__(self, key: str) -> Any:
        if key not in type(self).model_fields:
            raise KeyError(key)
        return getattr(self, key)


@dataclass
class Task:
    """Base task. Subclasses say which batch keys feed the model and how to perturb them."""

    loss: str = "cross_entropy"
    loss_options: dict[str, Any] = field(default_factory=dict)
    kind: ClassVar[str] = "base"

    def __post_init__(self) -> None:
        self._loss_fn = make_loss(self.loss, **self.loss_options)

    # -- calling the model -------------------------------------------------------------
    def model_args(self, batch: Batch) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
        raise NotImplementedError

    def forward(self, model: torch.nn.Module, batch: Batch) -> Tensor:
        args, kwargs = self.model_args(batch)
        return output_logits(model(*args, **kwargs))

    def per_sample_loss(self, logits: Tensor, batch: Batch) -> Tensor:
        return self._loss_fn(logits, batch["y"])

    def batch_size_of(self, batch: Batch) -> int:
        return int(batch["y"].shape[0])

    # -- perturbations for the probe -------------------------------------------------------
    def perturb(self, batch: Batch, generator: torch.Generator, **options: Any) -> Batch:
        """A perturbed copy of ``batch``. ``options`` are ``PerturbOptions`` fields (a
        ``PerturbOptions`` can be splatted): an unknown or misspelt key is an error."""
        return self._perturb(batch, generator, PerturbOptions.model_validate(options))

    def _perturb(self, batch: Batch, generator: torch.Generator, options: "PerturbOptions") -> Batch:
        raise NotImplementedError


@dataclass
class DenseInputTask(Task):
    """Images or feature vectors under ``"x"``; perturbation x + N(0, sigma^2) in input space."""

    kind: ClassVar[str] = "dense"

    def model_args(self, batch: Batch) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
        return (batch["x"],), {}

    def _perturb(self, batch: Batch, generator: torch.Generator, options: "PerturbOptions") -> Batch:
        x = batch["x"]
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device="cpu").to(x.device)
        return {**batch, "x": x + options.perturb_sigma * noise}


@dataclass
class TokenTask(Task):
    """Token ids under ``"input_ids"`` (+ ``"attention_mask"``); perturbation replaces ``k``
    random non-special, non-padding tokens of each sequence by random vocabulary ids."""

    vocab_size: int = 30522
    special_ids: tuple[int, ...] = (0, 100, 101, 102, 103)
    kind: ClassVar[str] = "tokens"

    def model_args(self, batch: Batch) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
        kwargs = {"input_ids": batch["input_ids"]}
        if "attention_mask" in batch:
            kwargs["attention_mask"] = batch["attention_mask"]
        return (), kwargs

    def _perturb(self, batch: Batch, generator: torch.Generator, options: "PerturbOptions") -> Batch:
        k = options.token_replacements
        ids = batch["input_ids"].clone()
        special = torch.tensor(self.special_ids, dtype=ids.dtype)
        mask = batch.get("attention_mask")
        ids_cpu = ids.cpu()
        eligible = ~torch.isin(ids_cpu, special)
        if mask is not None:
            eligible &= mask.cpu().bool()
        scores = torch.rand(ids_cpu.shape, generator=generator)
        scores[~eligible] = -1.0
        kk = min(k, ids_cpu.shape[1])
        top = torch.topk(scores, kk, dim=1)
        # Replacement ids are drawn uniformly from the NON-special vocabulary.
        allowed = torch.ones(self.vocab_size, dtype=torch.bool)
        allowed[special[(special >= 0) & (special < self.vocab_size)].long()] = False
        pool = torch.nonzero(allowed).flatten()
        if pool.numel() == 0:
            raise ValueError(f"vocab_size={self.vocab_size} leaves no non-special token id to perturb with")
        new_tokens = pool[torch.randint(0, pool.numel(), top.indices.shape, generator=generator)]
        chosen = top.values > 0  # only eligible positions are replaced
        rows = torch.arange(ids_cpu.shape[0]).unsqueeze(1).expand_as(top.indices)
        replaced = ids_cpu.clone()
        replaced[rows[chosen], top.indices[chosen]] = new_tokens[chosen].to(ids.dtype)
        return {**batch, "input_ids": replaced.to(ids.device)}


TASKS: dict[str, type[Task]] = {"dense": DenseInputTask, "tokens": TokenTask}


def make_task(kind: str, **options: Any) -> Task:
    if kind not in TASKS:
        raise ValueError(f"task kind '{kind}' is unknown; choose one of {sorted(TASKS)}")
    return TASKS[kind](**options)
