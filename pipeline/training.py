"""Training to the objective the removal methods assume:
    L_D(w) = (1/n) sum_{z in D} loss(w, z) + (lambda/2) ||w||^2.

Progress (``pipeline.progress``): a tqdm bar with the time left on stderr when it is a terminal.

Two optimisers: full-batch L-BFGS with strong-Wolfe line search (to a tight optimum, used for
oracles and small models) and mini-batch SGD with momentum (large models; the weight decay is
added to the objective, not through the optimiser, so the convention is the same).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from pipeline.data.sampleset import SampleSet
from pipeline.progress import bar
from pipeline.tasks import Task


def mean_loss(model: nn.Module, task: Task, data: SampleSet, batch_size: int = 4096) -> Tensor:
    """(1/n) sum loss(w, z) over ``data`` (differentiable). Without gradients (a line search,
    an evaluation) ``batch_size`` is lowered to fit the memory budget (``pipeline.memory``)."""
    if not torch.is_grad_enabled():
        from pipeline import memory

        batch_size = memory.forward_batch_size(model, task, data, batch_size)
    total = None
    for batch in data.batches(batch_size):
        part = task.per_sample_loss(task.forward(model, batch), batch).sum()
        total = part if total is None else total + part
    assert total is not None
    return total / len(data)


def l2_penalty(model: nn.Module, weight_decay: float) -> Tensor:
    return 0.5 * weight_decay * sum(p.pow(2).sum() for p in model.parameters() if p.requires_grad)


def objective(model: nn.Module, task: Task, data: SampleSet, weight_decay: float, batch_size: int = 4096) -> Tensor:
    return mean_loss(model, task, data, batch_size) + l2_penalty(model, weight_decay)


def gradient_norm(model: nn.Module, task: Task, data: SampleSet, weight_decay: float, batch_size: int = 4096) -> float:
    """||grad L_D(w)||_2 over all trainable parameters; the gradient is accumulated batch by
    batch (no graph over the whole set), each batch sized to fit the memory budget."""
    from pipeline.curvature import gradient_batch_size
    from pipeline.param_block import ParamBlock

    params = [p for p in model.parameters() if p.requires_grad]
    batch_size = gradient_batch_size(model, task, data, ParamBlock.all_parameters(model), batch_size)
    total = [weight_decay * p.detach().clone() for p in params]
    for batch in data.batches(batch_size):
        part = task.per_sample_loss(task.forward(model, batch), batch).sum() / len(data)
        for acc, g in zip(total, torch.autograd.grad(part, params)):
            acc += g
    return float(torch.sqrt(sum(g.pow(2).sum() for g in total)))


@dataclass
class FitReport:
    final_objective: float
    gradient_norm: float
    steps: int
    report_samples: int | None = None  # the objective and gradient norm were measured on this many samples (None: all)


def fit_lbfgs(
    model: nn.Module, task: Task, data: SampleSet, weight_decay: float, *,
    max_steps: int = 500, tolerance: float = 1e-10, batch_size: int = 4096,
    callback: Callable[[int, float], None] | None = None,
) -> FitReport:
    """Full-batch L-BFGS on L_D until the gradient norm is below ``tolerance`` (or max_steps), or until a step
    leaves the weights exactly as they were: then its line search found no decrease at float precision, and every
    later step would repeat it (measured on the 64-32-10 test MLP: from step 36 on, 965 steps of 1,000 moved
    nothing and took 13 of its 14 s)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.LBFGS(params, lr=1.0, max_iter=50, history_size=50,
                            tolerance_grad=tolerance, tolerance_change=0.0, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = objective(model, task, data, weight_decay, batch_size)
        loss.backward()
        return loss

    steps = 0
    with bar(max_steps, "training (L-BFGS)", unit="step") as progress:
        for steps in range(1, max_steps + 1):
            before = [p.detach().clone() for p in params]
            loss = opt.step(closure)
            gnorm = gradient_norm(model, task, data, weight_decay, batch_size)
            progress.set_postfix(objective=f"{float(loss.detach()):.4g}", grad=f"{gnorm:.2g}", refresh=False)
            progress.update(1)
            if callback is not None:
                callback(steps, float(loss.detach()))
            if gnorm <= tolerance or all(torch.equal(p, b) for p, b in zip(params, before)):
                break
    final = float(objective(model, task, data, weight_decay, batch_size).detach())
    return FitReport(final, gradient_norm(model, task, data, weight_decay, batch_size), steps)


def fit_newton(
    model: nn.Module, task: Task, data: SampleSet, weight_decay: float, *,
    max_steps: int = 60, tolerance: float = 1e-12, batch_size: int = 2048,
) -> FitReport:
    """Damped Newton with backtracking on L_D, exact dense Hessian over all parameters.

    For small models (a few thousand parameters): converges quadratically near the optimum,
    which makes it the tight full-batch solver of the retraining oracles. Levenberg damping
    mu I is added only while the Hessian is not positive definite.

    The step length t is chosen by backtracking on L_D (Armijo: L_D(w) - L_D(w - t d) >=
    1e-4 t g^T d), judged only while the decrease it asks for exceeds the rounding of L_D
    (8 eps max(1, |L_D|)). Near the optimum the Newton decrement g^T d falls below that rounding,
    where the test would accept or refuse by the summation order of one machine (refusing every
    t stalled the fit; accepting a tiny t by a rounding crawled); a step the Armijo test cannot
    settle is backtracked on the residual ||grad L_D|| instead (Newton is a descent direction
    for it), and the fit stops, reporting the gradient norm it reached, only when neither
    merit accepts any t.
    """
    from pipeline.curvature import BlockHessian, block_gradient
    from pipeline.param_block import ParamBlock

    block = ParamBlock.all_parameters(model)

    def value() -> float:
        with torch.no_grad():
            return float(objective(model, task, data, weight_decay, batch_size))

    def gradient() -> Tensor:
        return block_gradient(model, task, data, block, weight_decay, reduction="mean", batch_size=batch_size)

    def backtrack(accepts: Callable[[float], bool], direction: Tensor, shortest: float = 1e-10) -> bool:
        """Move to the first t in 1, 1/2, ... >= ``shortest`` that ``accepts(t)``; else leave the weights."""
        t = 1.0
        while t >= shortest:
            block.add_to_model(model, -t * direction)
            if accepts(t):
                return True
            block.add_to_model(model, t * direction)
            t *= 0.5
        return False

    steps = 0
    g = gradient()
    progress = bar(max_steps, "training (Newton)", unit="step")
    for steps in range(1, max_steps + 1):
        progress.update(1)
        residual = float(torch.linalg.vector_norm(g))
        if residual <= tolerance:
            break
        h = BlockHessian(model, task, data, block, weight_decay, reduction="mean", batch_size=batch_size).to_dense()
        mu = 0.0
        while True:
            chol, info = torch.linalg.cholesky_ex(h + mu * torch.eye(block.numel, dtype=h.dtype))
            if int(info) == 0:
                break
            mu = max(2 * mu, 1e-6)
        direction = torch.cholesky_solve(g.unsqueeze(1), chol).squeeze(1)
        f0, slope = value(), float(g @ direction)
        rounding = 8 * torch.finfo(direction.dtype).eps * max(1.0, abs(f0))
        judged = max(1e-10, rounding / (1e-4 * slope)) if slope > 0 else math.inf
        if backtrack(lambda t: f0 - value() >= 1e-4 * t * slope, direction, judged):
            g = gradient()
            continue
        trial: list[Tensor] = []

        def residual_falls(t: float) -> bool:
            trial[:] = [gradient()]
            return float(torch.linalg.vector_norm(trial[0])) < residual

        if not backtrack(residual_falls, direction):
            break  # no length lowers L_D or its gradient: the fit is at its floor; the report says where
        g = trial[0]
    progress.close()
    return FitReport(value(), float(torch.linalg.vector_norm(g)), steps)


def fit_sgd(
    model: nn.Module, task: Task, data: SampleSet, weight_decay: float, *,
    epochs: int, lr: float, batch_size: int, momentum: float = 0.9, seed: int = 0,
    callback: Callable[[int, float], None] | None = None, report_samples: int | None = None,
    on_batch: Callable[[int, Tensor, Tensor], None] | None = None, start_epoch: int = 0,
) -> FitReport:
    """Mini-batch SGD with momentum on L_D (seeded shuffling); cosine learning-rate decay.

    ``start_epoch`` k: the same run's epochs k..epochs-1 from the weights the model holds (e.g. the run's recorded
    checkpoint after epoch k, ``pipeline.trajectory``): epoch e draws the order and the rate the whole run's epoch e
    would (the first k orders are drawn and dropped); the momentum buffer starts at zero (a checkpoint does not keep
    it), so with momentum 0 the resumed run ends on the whole run's weights exactly.

    ``on_batch(step, positions, per_sample_losses)``: told of every step before its backward pass (the batch's
    positions in ``data`` and its per-sample losses, with their graph; the weights are the step's), e.g. to read
    some samples' own gradients along the run (``bench.trajectory_pushes``); it must not change the weights.

    The report (final objective and gradient norm at the trained weights, in eval mode) is measured on
    all of ``data``, or on a seeded subsample of ``report_samples`` of it (the same seed as the
    shuffling): on a large set the full measurement costs about a third of an epoch of training."""
    if not 0 <= start_epoch <= epochs:
        raise ValueError(f"start_epoch must be within 0..epochs ({epochs}), got {start_epoch}")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs))
    gen = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():  # stepped before any optimiser step on purpose: the earlier epochs' rates
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*", category=UserWarning)
        for _ in range(start_epoch):  # the epochs before start_epoch: their orders drawn, their rates passed
            torch.randperm(len(data), generator=gen)
            sched.step()
    model.train()
    per_epoch = (len(data) + batch_size - 1) // batch_size
    with bar((epochs - start_epoch) * per_epoch, "training (SGD)", unit="batch") as progress:
        for epoch in range(start_epoch, epochs):
            order = torch.randperm(len(data), generator=gen)
            running, seen = 0.0, 0
            for start in range(0, len(data), batch_size):
                batch_set = data.take(order[start : start + batch_size])
                batch = batch_set.columns
                opt.zero_grad()
                per_sample = task.per_sample_loss(task.forward(model, batch), batch)
                if on_batch is not None:
                    on_batch(epoch * per_epoch + start // batch_size, order[start : start + batch_size], per_sample)
                loss = per_sample.mean() + l2_penalty(model, weight_decay)
                loss.backward()
                opt.step()
                running += float(loss.detach()) * len(batch_set)
                seen += len(batch_set)
                progress.set_postfix(epoch=f"{epoch + 1}/{epochs}", loss=f"{running / seen:.4g}", refresh=False)
                progress.update(1)
            sched.step()
            if callback is not None:
                callback(epoch, running / len(data))
    model.eval()
    measured, used = data, None
    if report_samples is not None and report_samples < len(data):
        pick = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:report_samples]
        measured, used = data.take(pick.sort().values), int(report_samples)
    with torch.no_grad():  # a value only: no graph over the whole set
        final = float(objective(model, task, measured, weight_decay))
    return FitReport(final, gradient_norm(model, task, measured, weight_decay, batch_size=max(batch_size, 256)),
                     epochs - start_epoch, used)
