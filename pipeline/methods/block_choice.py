"""How the parameter block P of a Newton removal is chosen: a registry of strategies.

  lfoci       probe the forget samples (perturbed forward passes), run L-FOCI on
              (losses, slice activations) and take the selected slices' rows (Mehta et al. 2022)
  all         every trainable parameter (exact Newton; the convex oracle uses this)
  parameters  the whole of the named parameters
"""
from __future__ import annotations

import time
from typing import Any, Callable

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


@chooser("lfoci")
def choose_lfoci(problem: RemovalProblem, settings: Any) -> tuple[ParamBlock, dict]:
    from pipeline.selection import lfoci

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    slice_map = SliceMap(problem.model)
    forget = problem.forget.columns
    runner = problem.probe_runner or local_probe
    options = PerturbOptions(perturb_sigma=settings.perturb_sigma, token_replacements=settings.token_replacements)
    probe = runner(problem.model, problem.task, forget, seed=problem.seed,
                   perturbations=settings.perturbations, pass_size=settings.pass_size, perturb_options=options)
    timings["probe"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    result = lfoci(probe.losses, probe.activations.double(), max_picks=settings.max_slices,
                   generator=problem.generator(RandomStream.PROBE))
    timings["select"] = time.perf_counter() - t1
    picks = [int(i) for i in result.picks]
    block = slice_map.block_for(problem.model, picks)
    record = {
        "slices_probed": slice_map.size,
        "perturbations": int(probe.losses.shape[0]),
        "selected": [
            {**slice_map.describe(i), "T": float(t)} for i, t in zip(picks, result.scores)
        ],
        "timings": timings,
    }
    return block, record


@chooser("all")
def choose_all(problem: RemovalProblem, settings: Any) -> tuple[ParamBlock, dict]:
    return ParamBlock.all_parameters(problem.model), {"selected": "all", "timings": {}}


@chooser("parameters")
def choose_parameters(problem: RemovalProblem, settings: Any) -> tuple[ParamBlock, dict]:
    if not settings.parameters:
        raise ValueError("selection 'parameters' needs settings.parameters: a list of qualified parameter names")
    block = ParamBlock.from_rows(problem.model, {name: None for name in settings.parameters})
    return block, {"selected": list(settings.parameters), "timings": {}}
