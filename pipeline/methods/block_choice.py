"""How the parameter block P of a Newton removal is chosen: a registry of strategies.

  auto        the default: every trainable parameter when the whole model's Newton system fits
              the dense solver (trainable count <= ``whole_model_max``, default ``dense_max``);
              otherwise ``lfoci``
  lfoci       probe the forget samples (perturbed forward passes), run L-FOCI on
              (losses, standardised slice activations) and take the selected slices' rows
              (Mehta et al. 2022); then, unless switched off, the output layer (the last probed
              layer: it holds the decision, so a class or identity can move) and, while the
              block holds less than ``forget_gradient_share`` of the forget gradient's norm,
              the slices with the largest forget-gradient norm (up to ``block_numel_max``)
  all         every trainable parameter (exact Newton; the convex oracle uses this)
  parameters  the whole of the named parameters

Forget-gradient share of a block P: ||g_P(U)|| / ||g(U)||, g(U) = sum_{z in U} grad f(w, z)
over all trainable parameters (weight decay included), the share of the forget samples' pull
that a step restricted to P can act on.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from pipeline.methods.base import PerturbOptions, RandomStream, RemovalProblem
from pipeline.param_block import ParamBlock
from pipeline.probe import ProbeResult, SliceMap, run_probe

Chooser = Callable[[RemovalProblem, Any], tuple[ParamBlock, dict]]
CHOOSERS: dict[str, Chooser] = {}


def chooser(name: str) -> Callable[[Chooser], Chooser]:
    def deco(fn: Chooser) -> Chooser:
        CHOOSERS[name] = fn
        return fn

    return deco


def local_probe(model, task, forget, *, seed: int, perturbations: int, pass_size: int, perturb_options: dict) -> ProbeResult:
    """All perturbations in this process."""
    return run_probe(model, task, forget, seed=seed, start=0, stop=perturbations,
                     pass_size=pass_size, perturb_options=perturb_options)


def trainable_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def forget_gradient_rows(problem: RemovalProblem) -> dict[str, torch.Tensor]:
    """Squared norm of g(U) per row (dim 0) of every trainable parameter, CPU float64."""
    from pipeline.curvature import block_gradient

    everything = ParamBlock.all_parameters(problem.model)
    g = block_gradient(problem.model, problem.task, problem.forget, everything, problem.weight_decay,
                       reduction="sum", batch_size=problem.batch_size)
    out = {}
    for part, piece in zip(everything.parts, everything.split(g)):
        rows = part.shape[0] if part.shape else 1
        out[part.name] = piece.reshape(rows, -1).pow(2).sum(dim=1)
    return out


def block_share(rows_sq: dict[str, torch.Tensor], rows: dict[str, list[int] | None]) -> float:
    """||g_P(U)|| / ||g(U)|| for a block given as {parameter: rows or None (whole)}."""
    total = sum(float(v.sum()) for v in rows_sq.values())
    if total == 0.0:
        return 1.0
    inside = 0.0
    for name, r in rows.items():
        v = rows_sq[name]
        inside += float(v.sum()) if r is None else float(v[torch.as_tensor(sorted(set(r)), dtype=torch.long)].sum())
    return math.sqrt(inside / total)


def _rows_numel(model: torch.nn.Module, rows: dict[str, list[int] | None]) -> int:
    params = dict(model.named_parameters())
    total = 0
    for name, r in rows.items():
        p = params[name]
        row = p[0].numel() if p.dim() > 0 else 1
        total += p.numel() if r is None else len(set(r)) * row
    return total


@chooser("lfoci")
def choose_lfoci(problem: RemovalProblem, settings: Any) -> tuple[ParamBlock, dict]:
    from pipeline.selection import lfoci

    timings: dict[str, float] = {}
    slice_map = SliceMap(problem.model)
    with problem.stage("probe", timings):
        probed = problem.forget
        cap = getattr(settings, "probe_forget_max", None)
        if cap is not None and len(probed) > cap:  # the probe's cost is m x perturbations forward passes
            gen = problem.generator(RandomStream.PROBE_FORGET_SUBSAMPLE)
            probed = probed.take(torch.randperm(len(probed), generator=gen)[:cap].sort().values)
        forget = probed.columns
        runner = problem.probe_runner or local_probe
        options = PerturbOptions(perturb_sigma=settings.perturb_sigma, token_replacements=settings.token_replacements)
        probe = runner(problem.model, problem.task, forget, seed=problem.seed,
                       perturbations=settings.perturbations, pass_size=settings.pass_size, perturb_options=options)
    with problem.stage("selection", timings):
        result = lfoci(probe.losses, probe.activations.double(), max_picks=settings.max_slices,
                       generator=problem.generator(RandomStream.PROBE))
        picks = [int(i) for i in result.picks]
        rows: dict[str, list[int] | None] = {k: list(v) for k, v in slice_map.rows_for(picks).items()}
        record: dict[str, Any] = {
            "slices_probed": slice_map.size,
            "forget_samples_probed": len(probed),
            "perturbations": int(probe.losses.shape[0]),
            "selected": [{**slice_map.describe(i), "T": float(t)} for i, t in zip(picks, result.scores)],
        }
        if settings.include_output_layer:
            out = slice_map.groups[-1]
            rows[out.weight] = None
            if out.bias is not None:
                rows[out.bias] = None
            record["output_layer"] = out.module
        target = settings.forget_gradient_share
        if target > 0:
            rows_sq = forget_gradient_rows(problem)
            share = block_share(rows_sq, rows)
            record["forget_gradient_share_after_lfoci"] = share
            added = _add_by_gradient(problem.model, slice_map, rows_sq, rows, target, settings.block_numel_max)
            record["added_by_forget_gradient"] = [slice_map.describe(i) for i in added]
            record["forget_gradient_share"] = block_share(rows_sq, rows)
    record["timings"] = timings
    return ParamBlock.from_rows(problem.model, rows), record


def _add_by_gradient(model, slice_map: SliceMap, rows_sq: dict[str, torch.Tensor],
                     rows: dict[str, list[int] | None], target: float, numel_max: int) -> list[int]:
    """Add slices in decreasing forget-gradient norm until the block's share reaches ``target``
    or the next slice would take the block past ``numel_max`` entries. Mutates ``rows``."""
    total = sum(float(v.sum()) for v in rows_sq.values())
    if total == 0.0:
        return []
    scores = []
    for group in slice_map.groups:
        s = rows_sq[group.weight].clone()
        if group.bias is not None:
            s = s + rows_sq[group.bias]
        scores.append(s)
    order = torch.argsort(torch.cat(scores), descending=True, stable=True)
    params = dict(model.named_parameters())
    numel = _rows_numel(model, rows)
    added: list[int] = []
    for index in order.tolist():
        if block_share(rows_sq, rows) >= target:
            break
        group, unit = slice_map.locate(index)
        names = [group.weight] + ([group.bias] if group.bias is not None else [])
        if all(rows.get(n, []) is None or unit in (rows.get(n) or []) for n in names):
            continue  # already in the block
        cost = sum(params[n][0].numel() if params[n].dim() > 0 else 1 for n in names)
        if numel + cost > numel_max:
            break
        for n in names:
            if rows.get(n, []) is not None:
                rows.setdefault(n, []).append(unit)
        numel += cost
        added.append(index)
    return added


@chooser("auto")
def choose_auto(problem: RemovalProblem, settings: Any) -> tuple[ParamBlock, dict]:
    limit = settings.whole_model_max if settings.whole_model_max is not None else settings.dense_max
    count = trainable_numel(problem.model)
    if count <= limit:
        return ParamBlock.all_parameters(problem.model), {
            "selected": "all", "strategy_used": "all",
            "why": f"the whole model ({count} trainable entries) fits the dense solver (whole_model_max {limit})",
            "timings": {},
        }
    block, record = choose_lfoci(problem, settings)
    return block, {**record, "strategy_used": "lfoci"}


@chooser("all")
def choose_all(problem: RemovalProblem, settings: Any) -> tuple[ParamBlock, dict]:
    return ParamBlock.all_parameters(problem.model), {"selected": "all", "timings": {}}


@chooser("parameters")
def choose_parameters(problem: RemovalProblem, settings: Any) -> tuple[ParamBlock, dict]:
    if not settings.parameters:
        raise ValueError("selection 'parameters' needs settings.parameters: a list of qualified parameter names")
    block = ParamBlock.from_rows(problem.model, {name: None for name in settings.parameters})
    return block, {"selected": list(settings.parameters), "timings": {}}
