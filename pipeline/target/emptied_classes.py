"""The part of Retrain's target a request that empties a class fixes: the decision layer's rows of that class.

A request that removes every training sample of a class c (a whole identity, a whole class) leaves D \\ U
without a sample of c. Retrain never pushes the decision layer's row theta_c = (w_c, b_c) towards c's inputs: its
only forces are the weight decay and the push every retained sample x gives it through the softmax,

    d theta_c / dt = - [ mean_{x in R} (p_c(x) - s / K) (h(x), 1) + lambda theta_c ],

p_c(x) the model's probability of c, s the label smoothing, K the classes, h(x) the decision layer's input, t the
recipe's carried rate (heavy-ball SGD: c_k = sum_{j >= k} eta_j beta^(j - k) per step, summed per stretch between
recorded checkpoints, ``pipeline.trajectory``). The push-down is an early-training force: while the network is
unsure, p_c(x) ~ 1 / K for every x; once it is sure of the other classes p_c ~ 0 and only the decay is left (on the
digits CNN of the tests the retrains' bias of the emptied class ends at -0.95 from an initial 0.09; with final
features the push is already ~0). So this module integrates the row's equation along the recorded run itself:
h(x) and the other classes' logits at each checkpoint of the original's trajectory on a seeded sample S of D \\ U
(``checkpoint_views``: they read the recorded run, not the weights, so a caller keeps them for later requests and
drops U's rows with ``CheckpointViews.take``; the original's run differs from Retrain's by U's pushes, which the row
replaces), linearly interpolated inside a
stretch, explicit Euler sub-steps of the stretch's rate (at least the recipe's steps, more where the row loss's
curvature needs them for stability: at most 1 / L each, ``max_substeps`` in all), from the recorded initial row. The
row loss's Hessian is mean_x J(x) (x) (h,1)(h,1)^T + lambda I, J(x) = diag(p_C) - p_C p_C^T the softmax Jacobian on the
rows C, whose largest eigenvalue is at most max_c p_c(x) (and at most 1/4 for one row, 1/2 for several), so
L = q lambda_max(mean (h,1)(h,1)^T) + lambda with q the largest probability of an emptied class on the sample along the
stretch (capped at 1/4 or 1/2). A class no retained sample has is improbable on them (on the identities, q is 1e-3 to
9e-3 all run), so a stretch is integrated with q read at its start, times ``PROBABILITY_MARGIN``, and again with more
sub-steps wherever the probabilities it meets, times that margin, ask for more.

The time is Retrain's: the recipe on D \\ U takes ceil((n - m) / B) steps an epoch, not ceil(n / B)
(``pipeline.trajectory.retrain_rates``; a Fashion-MNIST class is a tenth of D). Features are read as training
computed them: batch normalisation on the batch's statistics (the first checkpoint's running statistics are the
initial 0 / 1), dropout off.

A removal that moves the trained weights by a correction (``pipeline.methods.trajectory_refit``) leaves row c
where training's up-pushes put it less the share taken back, and the class's logit on its own inputs far from
Retrain's (docs/NOTES.md). What the replay leaves out: Retrain's own features differ from the original's run
(the class's images drive the shared layers there); the checkpoints are the recipe's epochs, and the push-down
happens within the first of them, so its linear interpolation keeps p_c high for longer than a run does; S is a
sample. (A class an earlier request emptied is replayed with the new one, ``pipeline.methods.emptied_rows``, not read
with the original run's logits.)
Single-label cross-entropy only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from pipeline.decision_layer import decision_layer_block
from pipeline.eval_mode import eval_mode_restored
from pipeline.trajectory import load_checkpoint

#: the largest probability of an emptied class read at a stretch's start, or met along it, is taken times this in the
#: step's stability bound (the probabilities between sub-steps, and a rise within the stretch)
PROBABILITY_MARGIN = 2.0

__all__ = ["CheckpointViews", "checkpoint_views", "emptied_classes", "emptied_rows_record", "integrate_rows",
           "output_layer_names", "replayed_rows", "reset_emptied_rows"]


def emptied_classes(labels: Tensor, forget_positions: Tensor | list[int]) -> list[int]:
    """The classes every training sample of which is in U (sorted): in U's labels, absent from D \\ U's."""
    labels = torch.as_tensor(labels).reshape(-1).long()
    positions = torch.as_tensor(forget_positions, dtype=torch.long).reshape(-1)
    keep = torch.ones(labels.numel(), dtype=torch.bool)
    keep[positions] = False
    in_forget = set(labels[positions].tolist())
    in_retain = set(labels[keep].tolist())
    return sorted(in_forget - in_retain)


def output_layer_names(model: nn.Module) -> tuple[str, str | None]:
    """(weight, bias or None) of the decision layer (``pipeline.decision_layer.decision_layer_block``: a Sequential's
    last Linear, or a classifier's Linear ``classifier``); ``ValueError`` where there is none."""
    block = decision_layer_block(model, [])
    params = dict(model.named_parameters())
    names = [part.name for part in block.parts]
    weight = [n for n in names if params[n].dim() == 2]
    bias = [n for n in names if params[n].dim() == 1]
    if len(weight) != 1 or len(bias) > 1:
        raise ValueError(f"the decision layer's parameters {names} are not one weight and at most one bias")
    return weight[0], (bias[0] if bias else None)


def _checkpoint_view(model: nn.Module, task: Any, sample: Any, layer: nn.Linear, batch_size: int
                     ) -> tuple[Tensor, Tensor]:
    """(h, z) on ``sample`` at the weights ``model`` holds, as training computed them: batch normalisation on the
    batch's statistics (a checkpoint's running statistics lag the batches', and the first checkpoint's are the
    initial 0 / 1), dropout off; the decision layer's inputs (float64, with a column of ones) and the logits
    (float64). Every module's mode and buffer is put back (``pipeline.eval_mode.eval_mode_restored``)."""
    feats: list[Tensor] = []
    logits: list[Tensor] = []
    with eval_mode_restored(model):
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.train()
        handle = layer.register_forward_hook(lambda _m, inputs, _out: feats.append(inputs[0].detach()))
        try:
            with torch.no_grad():
                for batch in sample.batches(batch_size):
                    logits.append(task.forward(model, batch).detach())
        finally:
            handle.remove()
    h = torch.cat(feats).double().cpu()
    return torch.cat([h, torch.ones(h.shape[0], 1, dtype=h.dtype)], 1), torch.cat(logits).double().cpu()


@dataclass
class CheckpointViews:
    """What the replay reads of the recorded run on a sample S: at each checkpoint the decision layer's inputs h
    (float64, a column of ones appended) and the logits z (float64), rows in S's order; ``sample_ids`` S's ids.
    Independent of U and of the model's current weights: computed once per model (a removal drops U's rows with
    ``take``)."""

    sample_ids: Tensor
    features: list[Tensor]
    logits: list[Tensor]

    def __len__(self) -> int:
        return int(self.sample_ids.numel())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.features, *self.logits))

    def take(self, rows: Tensor) -> "CheckpointViews":
        """The views of S's ``rows`` (a bool mask or positions)."""
        return CheckpointViews(self.sample_ids[rows], [h[rows] for h in self.features], [z[rows] for z in self.logits])


def checkpoint_views(model: nn.Module, task: Any, sample: Any, trajectory: Any, weight: str, batch_size: int = 512,
                     work: nn.Module | None = None) -> CheckpointViews:
    """(h, z) of ``sample`` at every checkpoint of ``trajectory`` (loaded into ``model`` in turn; its own weights and
    buffers put back, also on failure), read as training computed them (``_checkpoint_view``). ``weight``: the
    decision layer's weight name. ``work``: the module the passes run through (``model`` itself, or its suffix over
    a frozen prefix's outputs, ``sample`` then holding those outputs; the suffix shares ``model``'s parameters)."""
    work = model if work is None else work
    layer = _layer_of(work, dict(model.named_parameters())[weight])
    kept = {k: v.detach().clone() for k, v in model.state_dict().items()}
    features: list[Tensor] = []
    logits: list[Tensor] = []
    try:
        for checkpoint in trajectory.checkpoints:
            load_checkpoint(model, checkpoint)
            h, z = _checkpoint_view(work, task, sample, layer, batch_size)
            features.append(h)
            logits.append(z)
    finally:
        model.load_state_dict(kept)
    return CheckpointViews(torch.as_tensor(sample.sample_ids).clone(), features, logits)


def replayed_rows(model: nn.Module, task: Any, sample: Any, trajectory: Any, names: tuple[str, str | None],
                  classes: list[int], weight_decay: float, steps_per_stretch: int, batch_size: int = 512,
                  rates: list[float] | None = None, max_substeps: int = 50000
                  ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Retrain's rows of ``classes`` by the row equation above along ``trajectory`` (its checkpoints loaded into
    ``model`` in turn, its own weights and buffers put back): ``integrate_rows`` over ``checkpoint_views``."""
    views = checkpoint_views(model, task, sample, trajectory, names[0], batch_size)
    return integrate_rows(views, trajectory, names, classes, weight_decay, steps_per_stretch,
                          float(task.loss_options.get("label_smoothing", 0.0)), rates=rates, max_substeps=max_substeps)


def integrate_rows(views: CheckpointViews, trajectory: Any, names: tuple[str, str | None], classes: list[int],
                   weight_decay: float, steps_per_stretch: int, label_smoothing: float = 0.0,
                   rates: list[float] | None = None, max_substeps: int = 50000
                   ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Retrain's rows of ``classes`` by the row equation above over the checkpoint ``views`` of ``trajectory``, over
    ``rates`` (Retrain's stretch rates, ``pipeline.trajectory.retrain_rates``; the recorded ones when None), from the
    recorded initial rows; ({name: rows}, what the record says: the sample, the sub-steps, the stretches integrated
    (a stretch integrated again with more sub-steps counts twice), and the largest step x L met, L from the
    probabilities met, above 1 only where ``max_substeps`` capped a stretch)."""
    if len(views.features) != len(trajectory.checkpoints):
        raise ValueError(f"{len(views.features)} checkpoint views for a trajectory of {len(trajectory.checkpoints)} "
                         "checkpoints")
    if len(views) == 0:
        raise ValueError("the replay's sample is empty")
    index = torch.as_tensor(classes, dtype=torch.long)
    first = trajectory.checkpoints[0]
    theta = first[names[0]].index_select(0, index).double()
    n_classes = int(first[names[0]].shape[0])
    bias0 = first[names[1]].index_select(0, index).double() if names[1] is not None else \
        torch.zeros(len(classes), dtype=torch.float64)
    theta = torch.cat([theta, bias0[:, None]], 1)  # (|C|, d + 1)
    has_bias = names[1] is not None
    others = torch.ones(n_classes, dtype=torch.bool)
    others[index] = False
    pairs = [(h, torch.logsumexp(z[:, others], 1)) for h, z in zip(views.features, views.logits)]
    if not has_bias:  # no bias: its column of (h, 1) off, so theta's last entry stays 0
        pairs = [(torch.cat([h[:, :-1], torch.zeros_like(h[:, -1:])], 1), o) for h, o in pairs]
    smooth = label_smoothing / n_classes  # the smoothed target's s / K
    # the row loss's gradient is Lipschitz with L <= q lambda_max(mean h h^T) + lambda, q the largest probability of
    # an emptied class met along the stretch, at most 1/4 for one row (p (1 - p) <= 1/4) and 1/2 for several (the
    # softmax Jacobian's largest eigenvalue): steps of at most 1 / L
    ceiling = 0.25 if len(classes) == 1 else 0.5
    spread = [_largest_eigenvalue(h) / h.shape[0] for h, _ in pairs]
    substeps_total, worst, tries = 0, 0.0, 0
    rates = list(trajectory.rates) if rates is None else list(rates)
    if len(rates) != len(trajectory.rates):
        raise ValueError(f"{len(rates)} stretch rates for a trajectory of {len(trajectory.rates)} stretches")
    cap = max(1, max_substeps // max(1, len(rates)))
    for e, rate in enumerate(rates):
        (h0, o0), (h1, o1) = pairs[e], pairs[e + 1]
        width = max(spread[e], spread[e + 1])
        factor = min(ceiling, PROBABILITY_MARGIN * float(_probabilities(theta, h0, o0).max()))
        while True:
            count = min(cap, max(int(steps_per_stretch), math.ceil(rate * (factor * width + weight_decay))))
            step = rate / count
            end, met = _euler_stretch(theta, (h0, o0), (h1, o1), count, step, smooth, weight_decay)
            needed = min(ceiling, PROBABILITY_MARGIN * met)
            tries += 1
            if step * (needed * width + weight_decay) <= 1.0 or factor >= ceiling or count >= cap:
                break
            factor = min(ceiling, max(2.0 * factor, needed))  # rises to the ceiling's bound: the loop ends
        theta = end
        worst = max(worst, step * (min(ceiling, met) * width + weight_decay))
        substeps_total += count
    dtype = first[names[0]].dtype
    out = {names[0]: theta[:, :-1].to(dtype)}
    if has_bias:
        out[names[1]] = theta[:, -1].to(dtype)
    return out, {"samples": len(views), "substeps": substeps_total, "checkpoints": len(pairs),
                 "stretch_integrations": tries, "step_times_lipschitz": worst}


def _probabilities(theta: Tensor, h: Tensor, other: Tensor) -> Tensor:
    """p_C(x) on the sample (|S|, |C|): the emptied rows' logits h theta^T against the other classes' log-sum-exp."""
    zc = h @ theta.T
    return torch.exp(zc - torch.logaddexp(other, torch.logsumexp(zc, 1))[:, None])


def _euler_stretch(theta: Tensor, start: tuple[Tensor, Tensor], end: tuple[Tensor, Tensor], count: int, step: float,
                   smooth: float, weight_decay: float) -> tuple[Tensor, float]:
    """``count`` explicit Euler sub-steps of ``step`` across one stretch (features and the other classes' log-sum-exp
    interpolated linearly at each sub-step's midpoint); the rows at its end and the largest p_C met."""
    (h0, o0), (h1, o1) = start, end
    met = 0.0
    for k in range(count):
        a = (k + 0.5) / count
        h, other = torch.lerp(h0, h1, a), torch.lerp(o0, o1, a)
        p = _probabilities(theta, h, other)  # (|S|, |C|)
        met = max(met, float(p.max()))
        theta = theta - step * ((p - smooth).T @ h / h.shape[0] + weight_decay * theta)
    return theta, met


def _largest_eigenvalue(h: Tensor) -> float:
    """lambda_max(h^T h) from the smaller of the two Gram matrices (a 4,096-wide embedding over 256 samples: 256 x 256)."""
    gram = h @ h.T if h.shape[0] < h.shape[1] else h.T @ h
    return float(torch.linalg.eigvalsh(gram)[-1])


def _layer_of(model: nn.Module, weight: Tensor) -> nn.Linear:
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight is weight:
            return module
    raise ValueError("the decision layer's weight is not a Linear module's of this model")


def reset_emptied_rows(model: nn.Module, rows: dict[str, Tensor], classes: list[int]) -> None:
    """Write ``rows`` (``replayed_rows``) into the model's decision layer, in place."""
    params = dict(model.named_parameters())
    index = torch.as_tensor(classes, dtype=torch.long)
    with torch.no_grad():
        for name, value in rows.items():
            target = params[name]
            target.index_copy_(0, index.to(target.device), value.to(target.device, target.dtype))


def emptied_rows_record(classes: list[int], names: tuple[str, str | None]) -> dict[str, Any]:
    """What the record says of the rows set."""
    return {"classes": classes, "parameters": [n for n in names if n is not None],
            "rows": "replayed from the recipe's initial rows along the recorded run (weight decay and the retained "
                    "samples' softmax pushes)"}
