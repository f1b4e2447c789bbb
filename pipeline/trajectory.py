"""The recorded training trajectory of an SGD recipe: its weights at epoch boundaries and how much of
each stretch's gradients reached the final weights. What ``trajectory-refit`` removes from
(``pipeline.methods.trajectory_refit``).

Heavy-ball SGD (``pipeline.training.fit_sgd``: b <- beta b + g_k; w <- w - eta_k b) moves the weights by
    w_K - w_0 = - sum_k c_k g_k,      c_k = sum_{j=k}^{K-1} eta_j beta^(j-k),
g_k the step's mini-batch gradient (weight decay included): c_k is the share of g_k the final weights
carry, counted to the end of the run (no curvature feedback). The record keeps the weights c_e at the
E + 1 epoch boundaries (or at most ``recipe.trajectory_checkpoints``, 16 by default, evenly spaced ones:
every k-th epoch and the last) and, per
stretch e between checkpoints e and e + 1, its total rate C_e = sum_{k in e} c_k. Only trainable
parameters are kept, plus the floating buffers (batch-norm statistics) a model in eval mode reads.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from pipeline.checkpoint import sha256_of


if TYPE_CHECKING:
    from pipeline.models.card import ModelCard
    from pipeline.recipe import Recipe

__all__ = ["TRAJECTORY_FILE", "TRAJECTORY_MOVED", "TRAJECTORY_REFERENCE", "Trajectory", "TrajectoryRecorder", "TrajectoryReferenceError",
           "checkpoint_epochs", "checkpoint_every", "locate_trajectory", "read_trajectory", "recorded_trajectory",
           "refer_to_trajectory", "save_trajectory", "stretch_rates", "without_trajectory_reference"]

TRAJECTORY_FILE = "trajectory.safetensors"
TRAJECTORY_MOVED = "trajectory.moved.json"  # a directory whose copy of the run was deleted: where the same run is
TRAJECTORY_REFERENCE = "trajectory"   # the card's training.extra key a later version refers to it by


def checkpoint_every(epochs: int, checkpoints: int) -> int:
    """The recorder's spacing: a checkpoint every ceil(epochs / checkpoints) epochs (and after the last)."""
    return max(1, math.ceil(epochs / max(1, checkpoints)))


def checkpoint_epochs(epochs: int, checkpoints: int) -> list[int]:
    """The epoch each recorded checkpoint follows, the start (epoch 0) first: every ``checkpoint_every`` epochs and
    the last."""
    return [*range(0, epochs, checkpoint_every(epochs, checkpoints)), epochs]


def stretch_rates(step_rates: list[float], momentum: float, per: int) -> list[float]:
    """C_e for stretches of ``per`` steps: sum over the stretch's steps k of c_k = sum_{j >= k} eta_j beta^(j-k)."""
    carried = [0.0] * len(step_rates)
    tail = 0.0
    for k in range(len(step_rates) - 1, -1, -1):  # c_k = eta_k + beta c_{k+1}
        tail = step_rates[k] + momentum * tail
        carried[k] = tail
    return [sum(carried[s:s + per]) for s in range(0, len(carried), per)]


@dataclass
class Trajectory:
    """Checkpoints c_0..c_E (name -> tensor: trainable parameters and floating buffers) and the stretch
    rates C_0..C_{E-1}; ``n`` the training set size the recipe ran on."""

    checkpoints: list[dict[str, Tensor]]
    rates: list[float]
    n: int

    def __post_init__(self) -> None:
        if len(self.checkpoints) != len(self.rates) + 1:
            raise ValueError(f"a trajectory needs one checkpoint more than stretches (got {len(self.checkpoints)} "
                             f"checkpoints, {len(self.rates)} rates)")
        if self.n < 1 or not all(math.isfinite(r) and r >= 0 for r in self.rates):
            raise ValueError("a trajectory needs n >= 1 and finite rates >= 0")

    @property
    def parameters(self) -> list[str]:
        return sorted(self.checkpoints[0])

    def require_parameters(self, names: list[str], what: str) -> None:
        """Refuse (``ValueError``, naming the first five) ``names`` the record does not hold: a run of another
        model. ``what`` says which parameters they are."""
        missing = sorted(set(names) - set(self.checkpoints[0]))
        if missing:
            raise ValueError(f"the recorded trajectory does not hold {what} {missing[:5]}: it belongs to another model")


class TrajectoryRecorder:
    """Collects the checkpoints of one ``fit_sgd`` run of ``recipe`` on ``model``: every
    ceil(epochs / ``recipe.trajectory_checkpoints``) epochs and the last, its trainable parameters under the full
    model's names (also when the run fits a suffix module that shares them)."""

    def __init__(self, model: nn.Module, recipe: "Recipe") -> None:
        from pipeline.target.replay import ReplaySchedule

        if recipe.optimizer != "sgd" or recipe.trajectory_checkpoints < 1:
            raise ValueError("a trajectory is recorded for an SGD recipe with trajectory_checkpoints >= 1")
        self.model = model
        self.names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
        self.epochs = recipe.epochs
        self.every = checkpoint_every(recipe.epochs, recipe.trajectory_checkpoints)
        self.schedule = ReplaySchedule(recipe.epochs, recipe.lr, recipe.momentum, recipe.batch_size,
                                       recipe.weight_decay)
        self.checkpoints: list[dict[str, Tensor]] = [self._snapshot()]

    def _snapshot(self) -> dict[str, Tensor]:
        out = {self.names[id(p)]: p.detach().cpu().clone() for p in self.model.parameters() if id(p) in self.names}
        for name, buf in self.model.named_buffers():
            if buf.is_floating_point():
                out.setdefault(f"buffer:{name}", buf.detach().cpu().clone())
        return out

    def callback(self) -> Callable[[int, float], None]:
        def after_epoch(epoch: int, _loss: float) -> None:
            if (epoch + 1) % self.every == 0 or epoch + 1 == self.epochs:
                self.checkpoints.append(self._snapshot())
        return after_epoch

    def trajectory(self, n: int) -> Trajectory:
        """The record of the run on ``n`` samples (the fit's rates: ``ReplaySchedule.step_rates``)."""
        steps = self.schedule.step_rates(n)
        per = self.every * len(steps) // self.epochs
        return Trajectory(self.checkpoints, stretch_rates(steps, self.schedule.momentum, per), n)


def retrain_rates(trajectory: Trajectory, recipe: "Recipe", n: int) -> list[float]:
    """The stretch rates C_e of the same recipe run on ``n`` samples (Retrain on D \\ U: ceil(n / B) steps an epoch
    instead of ceil(trajectory.n / B)), over the trajectory's stretches (every ceil(epochs / trajectory_checkpoints)
    epochs, the last one possibly shorter); each recorded rate scaled by the two runs' total ratio where the
    stretches do not line up (a trajectory recorded under another setting)."""
    from pipeline.target.replay import ReplaySchedule

    schedule = ReplaySchedule(recipe.epochs, recipe.lr, recipe.momentum, recipe.batch_size, recipe.weight_decay)
    steps = schedule.step_rates(n)
    every = checkpoint_every(recipe.epochs, recipe.trajectory_checkpoints)
    rates = stretch_rates(steps, schedule.momentum, every * len(steps) // recipe.epochs)
    if len(rates) == len(trajectory.rates):
        return rates
    recorded = sum(stretch_rates(schedule.step_rates(trajectory.n), schedule.momentum, 1))
    return [r * sum(rates) / recorded for r in trajectory.rates]


def load_checkpoint(model: nn.Module, checkpoint: dict[str, Tensor]) -> None:
    """A checkpoint's parameters and buffers into ``model`` (names as the recorder keeps them), in place."""
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    with torch.no_grad():
        for name, value in checkpoint.items():
            target = buffers[name[len("buffer:"):]] if name.startswith("buffer:") else params[name]
            target.copy_(value.to(target.device, target.dtype))


class TrajectoryReferenceError(ValueError):
    """A card's reference to a recorded trajectory is malformed (not {path, sha256})."""


def _reference_of(card: "ModelCard") -> dict[str, str] | None:
    ref = card.training.extra.get(TRAJECTORY_REFERENCE)
    if ref is None:
        return None
    if not isinstance(ref, dict) or not isinstance(ref.get("path"), str) or not isinstance(ref.get("sha256"), str):
        raise TrajectoryReferenceError(f"the card's training.extra.{TRAJECTORY_REFERENCE} must be {{path, sha256}}, "
                                       f"got {ref!r}")
    return ref


def recorded_trajectory(model_dir: str | Path, card: "ModelCard") -> Path | None:
    """``locate_trajectory``'s path alone."""
    return locate_trajectory(model_dir, card)[0]


def locate_trajectory(model_dir: str | Path, card: "ModelCard") -> tuple[Path | None, str | None]:
    """Where a model directory's recorded trajectory is: its own ``trajectory.safetensors`` (the directory
    ``unlearn train`` wrote, or a store's version 0), else the file its card refers to (``training.extra.trajectory``:
    a path relative to the directory and its sha256, checked), else the file a ``TRAJECTORY_MOVED`` record beside it
    refers to in the same way (a store's version whose own copy was deleted). None where it has none, where the file referred to
    is gone (e.g. the original pruned on purpose), or where it changed (its sha256 differs: warned, never read).
    Without it trajectory-refit refuses, the recorded-run variants of lfoci-newton take U's gradient at the trained
    weights instead, and the emptied-class replay (lfoci-newton's default, trajectory-refit's) is skipped; each
    record says so. Returns (the path, None) or (None, why: None where no run was ever recorded, else which of
    gone / changed, for the records)."""
    own = Path(model_dir) / TRAJECTORY_FILE
    if own.exists():
        return own, None
    ref = _reference_of(card)
    moved = Path(model_dir) / TRAJECTORY_MOVED
    if ref is None and moved.is_file():  # its own copy deleted (a store's version published with one): the record
        ref = moved_reference(moved)      # says where the same run is kept, if anywhere
        if ref is None:
            return None, "this version's copy of the recorded training run was deleted and no other copy was kept"
    if ref is None:
        return None, None
    path = (Path(model_dir) / ref["path"]).resolve()
    if not path.exists():
        return None, f"the recorded training run the card refers to ({path}) is gone"
    if sha256_of(path) != ref["sha256"]:
        why = (f"the recorded training run the card refers to ({path}) has changed (its sha256 is not the "
               f"{ref['sha256'][:12]}... the card records): not read")
        warnings.warn(why, stacklevel=2)
        return None, why
    return path, None


def moved_reference(path: str | Path) -> dict[str, str] | None:
    """The reference ({path, sha256}, the path relative to the directory) a ``TRAJECTORY_MOVED`` record gives to the
    kept copy of a deleted run, or None where no copy was kept. The file read through it is checked against the
    sha256 the reference records; a store checks, when it verifies the version, that the reference is its version 0's
    copy and that sha256 the one its manifest hashed for the deleted file."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise TrajectoryReferenceError(f"{path} is unreadable ({err})") from None
    ref = record.get("reference") if isinstance(record, dict) else None
    if ref is None:
        return None
    if not isinstance(ref, dict) or not isinstance(ref.get("path"), str) or not isinstance(ref.get("sha256"), str):
        raise TrajectoryReferenceError(f"{path}: reference must be {{path, sha256}}, got {ref!r}")
    return ref


def without_trajectory_reference(card: "ModelCard") -> "ModelCard":
    """``card`` less its reference to a recorded run (a model whose run it is not, or a version that holds it)."""
    extra = {k: v for k, v in card.training.extra.items() if k != TRAJECTORY_REFERENCE}
    return card.model_copy(update={"training": card.training.model_copy(update={"extra": extra})})


def refer_to_trajectory(card: "ModelCard", source_dir: str | Path, target_dir: str | Path) -> "ModelCard":
    """The card of a new version written to ``target_dir`` from ``source_dir``'s model: a reference to the recorded
    trajectory (its path relative to ``target_dir`` and its sha256) in place of a copy. The run was recorded on all
    of D, the removed samples included, and its last checkpoint is the original's weights, so no version a removal
    publishes holds it: it stays with the original (or the store's version 0), and the methods that read it find it
    there. A reference of ``source_dir``'s card is carried, re-pointed from ``target_dir``, whether or not its file is
    there now (a file moved away and back is found again). Where ``source_dir`` has neither, the card without one."""
    from pipeline.models.card import read_card

    own = Path(source_dir) / TRAJECTORY_FILE
    if own.exists():
        where, digest = own.resolve(), sha256_of(own)
    else:
        ref = _reference_of(read_card(source_dir))
        moved = Path(source_dir) / TRAJECTORY_MOVED
        if ref is None and moved.is_file():  # its own copy dropped: the record says where the run is kept
            ref = moved_reference(moved)
        if ref is None:
            return without_trajectory_reference(card)
        where, digest = (Path(source_dir) / ref["path"]).resolve(), ref["sha256"]
    extra = {**card.training.extra,
             TRAJECTORY_REFERENCE: {"path": os.path.relpath(where, Path(target_dir).resolve()), "sha256": digest}}
    return card.model_copy(update={"training": card.training.model_copy(update={"extra": extra})})


def save_trajectory(path: str | Path, trajectory: Trajectory) -> None:
    """One safetensors file: ``{e}/{name}`` tensors, the rates and n in its metadata."""
    tensors = {f"{e}/{name}": t.contiguous() for e, ckpt in enumerate(trajectory.checkpoints) for name, t in ckpt.items()}
    save_file(tensors, str(path), metadata={"rates": json.dumps(trajectory.rates), "n": str(trajectory.n),
                                            "checkpoints": str(len(trajectory.checkpoints))})


def read_trajectory(path: str | Path) -> Trajectory:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
    try:
        rates, n, count = json.loads(meta["rates"]), int(meta["n"]), int(meta["checkpoints"])
    except (KeyError, ValueError) as err:
        raise ValueError(f"{path}: not a training trajectory (metadata rates / n / checkpoints: {err})") from err
    flat = load_file(str(path))
    checkpoints: list[dict[str, Tensor]] = [{} for _ in range(count)]
    for key, tensor in flat.items():
        e, _, name = key.partition("/")
        checkpoints[int(e)][name] = tensor
    return Trajectory(checkpoints, [float(r) for r in rates], n)
