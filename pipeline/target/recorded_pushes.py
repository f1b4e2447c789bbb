"""The forget set's pushes along the recorded training run: what the recipe's SGD gave U and Retrain never took.

The recipe moved the weights by w_K - w_0 = - sum_k c_k g_k (heavy-ball SGD, c_k the share of step k's gradient the
final weights carry; ``pipeline.trajectory`` records the epoch checkpoints c_e and each stretch's total rate C_e).
A sample of U sits in one batch of B per epoch, so over stretch e U's own pushes sum to about
(C_e / n) (G_U(c_e) + G_U(c_{e+1})) / 2, G_U(w) = sum_{z in U} grad loss(w, z), n the size of the set the recipe
ran on. Their sum is the trapezium over the checkpoints,

    delta = (1 / n) sum_k W_k G_U(c_k),      W_k = (C_{k-1} + C_k) / 2  (C_{-1} = C_E = 0),

read at fewer checkpoints by interpolating the left-out ones' G_U between their kept neighbours
(``checkpoint_weights``). The same sum over all of D needs no pass: the run's own displacement less its weight
decay's share,

    delta_D = (1 / n) sum_k W_k G_D(c_k) = (c_0 - c_K) - lambda sum_k W_k c_k       (``data_pushes``),

so that U's pushes split into its share of D's, (m / n) delta_D, and its own, delta - (m / n) delta_D. (A model with
batch normalisation: the displacement holds the run's training-mode gradients, batch statistics included; delta
reads G_U in the mode the model is in.)
trajectory-refit adds back a share of delta (``pipeline.methods.trajectory_refit``); lfoci-newton's one-window
target reads U's term as mu delta (``pipeline.methods.lfoci_newton``, ``_forget_term``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pipeline.trajectory import Trajectory, load_checkpoint

__all__ = ["checkpoint_weights", "data_pushes", "forget_pushes", "kept_checkpoints"]


def kept_checkpoints(count: int, wanted: int | None) -> list[int]:
    """Indices of ``wanted`` of ``count`` checkpoints, as evenly spaced as rounding i (count - 1) / (wanted - 1) to
    the nearest index allows, the first and the last among them (all: None or ``wanted`` >= ``count``)."""
    if wanted is None or wanted >= count:
        return list(range(count))
    return sorted({round(i * (count - 1) / (wanted - 1)) for i in range(wanted)})


def checkpoint_weights(rates: list[float], kept: list[int]) -> dict[int, float]:
    """W_k of sum_k W_k G_U(c_k) over the ``kept`` checkpoints: the trapezium's (C_{k-1} + C_k) / 2, a left-out
    checkpoint's share split between its kept neighbours a < k < b as (b - k) / (b - a) and (k - a) / (b - a)
    (its G_U the linear interpolation of theirs). All kept: the trapezium's weights themselves."""
    last = len(rates)
    if not kept or kept[0] != 0 or kept[-1] != last or sorted(set(kept)) != kept:
        raise ValueError(f"the kept checkpoints must rise from 0 to {last} (got {kept})")
    full = [0.5 * ((rates[k - 1] if k > 0 else 0.0) + (rates[k] if k < last else 0.0)) for k in range(last + 1)]
    weights = {k: 0.0 for k in kept}
    for a, b in zip(kept, kept[1:]):
        weights[a] += full[a]
        for k in range(a + 1, b):
            weights[a] += full[k] * (b - k) / (b - a)
            weights[b] += full[k] * (k - a) / (b - a)
    weights[last] += full[last]
    return weights


def forget_pushes(model: nn.Module, trajectory: Trajectory, forget_gradient: Callable[[], torch.Tensor],
                  checkpoints: int | None = None) -> torch.Tensor:
    """(1 / n) sum_k W_k G_U(c_k) (CPU float64; ``checkpoint_weights`` over ``kept_checkpoints``; all of them:
    (1 / n) sum_e C_e (G_U(c_e) + G_U(c_{e+1})) / 2), ``forget_gradient()`` giving G_U (summed over U, no weight
    decay) at the weights ``model`` holds; each checkpoint is loaded into ``model`` in turn and its parameters and
    buffers are as they were when it returns. A sum that is not finite raises ``FloatingPointError``."""
    weights = checkpoint_weights(trajectory.rates, kept_checkpoints(len(trajectory.checkpoints), checkpoints))
    kept = {k: v.detach().clone() for k, v in model.state_dict().items()}
    total: torch.Tensor | None = None
    try:
        for k, weight in weights.items():
            load_checkpoint(model, trajectory.checkpoints[k])
            term = weight * forget_gradient()
            total = term if total is None else total + term
    finally:
        model.load_state_dict(kept)
    assert total is not None
    if not bool(torch.isfinite(total).all()):
        raise FloatingPointError("the forget set's recorded pushes are not finite; nothing was changed")
    return total / trajectory.n


def data_pushes(trajectory: Trajectory, gather: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                weight_decay: float) -> torch.Tensor:
    """delta_D = (1 / n) sum_k W_k G_D(c_k), D's pushes over the recorded run, read from the run itself: heavy-ball
    SGD moved the weights by c_K - c_0 = -sum_t s_t (mean batch gradient + lambda w_t), s_t the share of step t's
    gradient the final weights carry (``pipeline.trajectory``), so over the trapezium's weights
    (1 / n) sum_k W_k G_D(c_k) = (c_0 - c_K) - lambda sum_k W_k c_k, ``lambda`` the recipe's weight decay; ``gather``
    maps a checkpoint (name -> tensor) to the block's flat vector. CPU float64; no forward or backward pass; each
    checkpoint gathered once, and no more than three block-sized vectors held at a time."""
    weights = checkpoint_weights(trajectory.rates, list(range(len(trajectory.checkpoints))))
    first = point = decayed = None
    for k, checkpoint in enumerate(trajectory.checkpoints):
        point = gather(checkpoint).to("cpu", torch.float64)
        first = point if first is None else first
        decayed = weights[k] * point if decayed is None else decayed.add_(point, alpha=weights[k])
    total = first - point - weight_decay * decayed
    if not bool(torch.isfinite(total).all()):
        raise FloatingPointError("the recorded run's displacement is not finite")
    return total
