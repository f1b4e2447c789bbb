"""The probe of L-CODEC / L-FOCI (Mehta et al., CVPR 2022, section 4): perturbed forward
passes of the forget samples, one scalar per parameter *slice* per perturbation.

Slices: every ``nn.Linear`` and ``nn.Conv2d`` (the Linear projections inside attention
included) contributes one slice per output unit j: weight row j (+ bias j). Its scalar for a
perturbation is the mean over the forget batch (and over tokens, or H x W) of unit j's output.
Perturbation p of the forget batch (m samples): dense inputs get x + N(0, sigma^2), token ids
get k random non-special tokens replaced (``Task.perturb``). Each perturbation also records
the mean loss of the forget batch. Result: an (m_p x S) activation matrix and an m_p loss vector.

A probed module that does not run in a pass leaves its columns at zero (constant: L-FOCI never
selects it) and is listed in ``ProbeResult.not_run``; a module called several times in one pass
(shared weights) contributes the SUM of its per-call means, because its weight row moves all
of those outputs.

Determinism: perturbation p draws from its own generator seeded by (seed, p), and passes are
cut at absolute multiples of ``pass_size``; so any contiguous shard [start, stop) aligned to
``pass_size`` yields exactly the rows the whole run yields there, whatever the sharding.

Memory: a pass of ``pass_size`` perturbations is run in sub-passes of as many perturbations as
the memory budget holds (``pipeline.memory``; the one given, else the scoped / ``auto`` one);
the cuts at multiples of ``pass_size`` stay where they are, and a budget that cannot hold one
perturbed forward pass of the forget batch raises ``MemoryBudgetError`` before any pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor, nn

from pipeline import memory
from pipeline.eval_mode import eval_mode_restored
from pipeline.param_block import ParamBlock
from pipeline.progress import tick
from pipeline.tasks import Batch, Task

PROBED_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d)


@dataclass(frozen=True)
class SliceGroup:
    module: str  # qualified module name
    weight: str  # qualified parameter names
    bias: str | None
    units: int
    offset: int  # index of this module's first slice


class SliceMap:
    """Slice index <-> (module, unit) <-> (parameter name, row) for weight and bias."""

    def __init__(self, model: nn.Module):
        groups: list[SliceGroup] = []
        offset = 0
        for name, module in model.named_modules():
            if not isinstance(module, PROBED_TYPES) or not module.weight.requires_grad:
                continue
            units = int(module.weight.shape[0])
            bias = f"{name}.bias" if module.bias is not None and module.bias.requires_grad else None
            groups.append(SliceGroup(name, f"{name}.weight", bias, units, offset))
            offset += units
        if not groups:
            raise ValueError("the model has no trainable nn.Linear or nn.Conv2d layer to probe")
        self.groups = groups
        self.size = offset
        self._starts = torch.tensor([g.offset for g in groups])

    def locate(self, index: int) -> tuple[SliceGroup, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"slice {index} outside [0, {self.size})")
        g = int(torch.searchsorted(self._starts, torch.tensor(index), right=True)) - 1
        group = self.groups[g]
        return group, index - group.offset

    def describe(self, index: int) -> dict:
        group, unit = self.locate(index)
        return {"slice": index, "module": group.module, "unit": unit, "weight": group.weight, "bias": group.bias}

    def rows_for(self, indices: list[int]) -> dict[str, list[int]]:
        rows: dict[str, list[int]] = {}
        for i in indices:
            group, unit = self.locate(int(i))
            rows.setdefault(group.weight, []).append(unit)
            if group.bias is not None:
                rows.setdefault(group.bias, []).append(unit)
        return rows

    def block_for(self, model: nn.Module, indices: list[int]) -> ParamBlock:
        return ParamBlock.from_rows(model, self.rows_for(indices))


@dataclass
class ProbeResult:
    activations: Tensor  # (perturbations, slices), float32, CPU
    losses: Tensor  # (perturbations,), float64, CPU
    start: int = 0
    not_run: tuple[str, ...] = ()  # probed modules that never ran (their columns are zero)


def perturbation_generator(seed: int, index: int) -> torch.Generator:
    """Generator of perturbation ``index`` for a removal seeded with ``seed``."""
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 0x9E3779B1 + index * 0x85EBCA77 + 0x165667B1) % (2**63 - 1))
    return g


def _stack(batches: list[Batch]) -> Batch:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


class _Recorder:
    """Forward hooks writing the per-perturbation mean of each unit into one matrix."""

    def __init__(self, slice_map: SliceMap, model: nn.Module):
        self.slice_map = slice_map
        self.modules = dict(model.named_modules())
        self.handles: list = []
        self.out: Tensor | None = None
        self.groups_per_pass = 1
        self.token_weights: Tensor | None = None  # (P*m, T) normalised mask, for token inputs
        self.calls: dict[str, int] = {g.module: 0 for g in slice_map.groups}

    def __enter__(self) -> "_Recorder":
        for group in self.slice_map.groups:
            module = self.modules[group.module]
            self.handles.append(module.register_forward_hook(self._hook(group)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()

    def _hook(self, group: SliceGroup):
        def hook(module: nn.Module, inputs: tuple, output: Tensor) -> None:
            assert self.out is not None
            p = self.groups_per_pass
            y = output.detach()
            if isinstance(module, nn.Conv2d):  # (B, C, H, W) -> mean over batch-in-group, H, W
                per = y.reshape(p, -1, *y.shape[1:]).mean(dim=(1, 3, 4))
            elif y.dim() == 3 and self.token_weights is not None and y.shape[1] == self.token_weights.shape[1]:
                w = self.token_weights.to(y.dtype)  # (B, T), rows sum to 1 over real tokens
                per_sample = (y * w.unsqueeze(-1)).sum(dim=1)  # (B, units)
                per = per_sample.reshape(p, -1, y.shape[-1]).mean(dim=1)
            else:  # (B, ..., units): mean over batch-in-group and any middle dims
                per = y.reshape(p, -1, y.shape[-1]).mean(dim=1)
            self.out[:, group.offset : group.offset + group.units] += per.float().cpu()
            self.calls[group.module] += 1

        return hook


@torch.no_grad()
def run_probe(
    model: nn.Module, task: Task, forget: Batch, *, seed: int, start: int, stop: int,
    pass_size: int = 32, perturb_options: dict | None = None, slice_map: SliceMap | None = None,
) -> ProbeResult:
    """Rows [start, stop) of the probe, in eval mode (each module's mode restored afterwards), its
    passes sized from the scoped memory budget. ``start`` must be a multiple of ``pass_size``."""
    if start % pass_size:
        raise ValueError(f"start={start} must be a multiple of pass_size={pass_size} (shard alignment)")
    if stop <= start:
        raise ValueError("the probe needs at least one perturbation (stop > start)")
    slice_map = slice_map or SliceMap(model)
    options = perturb_options or {}
    rows = stop - start
    acts = torch.empty(rows, slice_map.size, dtype=torch.float32)
    losses = torch.empty(rows, dtype=torch.float64)
    m = task.batch_size_of(forget)
    per_pass = probe_pass_size(model, task, forget, pass_size, slice_map.size)
    with eval_mode_restored(model), _Recorder(slice_map, model) as rec:
        for a in _sub_passes(start, stop, pass_size, per_pass):
            b = min(stop, (a // pass_size + 1) * pass_size, a + per_pass)
            batches = [task.perturb(forget, perturbation_generator(seed, p), **options) for p in range(a, b)]
            stacked = _stack(batches)
            rec.groups_per_pass = b - a
            rec.out = torch.zeros(b - a, slice_map.size, dtype=torch.float32)
            mask = stacked.get("attention_mask")
            rec.token_weights = None
            if mask is not None:
                mk = mask.to(torch.float64)
                rec.token_weights = mk / mk.sum(dim=1, keepdim=True).clamp(min=1.0)
            logits = task.forward(model, stacked)
            per = task.per_sample_loss(logits, stacked).reshape(b - a, m).mean(dim=1)
            acts[a - start : b - start] = rec.out
            losses[a - start : b - start] = per.double().cpu()
            tick(b - a, total=rows, phase="perturbation passes", unit="perturbation")
    not_run = tuple(name for name, count in rec.calls.items() if count == 0)
    return ProbeResult(acts, losses, start, not_run)


def probe_pass_size(model: nn.Module, task: Task, forget: Batch, pass_size: int, slices: int) -> int:
    """Perturbations per forward pass: ``pass_size`` or fewer, so that a pass fits the budget."""
    from pipeline.data.sampleset import SampleSet

    m = task.batch_size_of(forget)
    device = next(iter(model.parameters())).device
    sample = SampleSet({k: v[:1] for k, v in forget.items()}, torch.zeros(1, dtype=torch.long))
    cost = memory.cost_of(model, task, sample)
    batch_bytes = sum(v[:1].numel() * v.element_size() for v in forget.values())
    per_perturbation = m * (cost.forward_plan()[1] + 2 * batch_bytes) + 8 * slices
    return memory.chunk_size(
        memory.available_in(memory.current_budget(device)), per_perturbation, limit=pass_size,
        what=f"perturbed forward pass of the {m} forget samples",
        fix="forget fewer samples per request")


def _sub_passes(start: int, stop: int, pass_size: int, per_pass: int) -> Iterator[int]:
    """Starts of the sub-passes: each pass [a, a + pass_size) cut into ``per_pass`` pieces."""
    for a in range(start, stop, pass_size):
        yield from range(a, min(stop, a + pass_size), per_pass)


def gather(results: list[ProbeResult]) -> ProbeResult:
    """Concatenate shard results in perturbation order (they must tile a contiguous range)."""
    ordered = sorted(results, key=lambda r: r.start)
    expect = ordered[0].start
    for r in ordered:
        if r.start != expect:
            raise ValueError(f"probe shards leave a gap or overlap at perturbation {expect}")
        expect += r.losses.shape[0]
    not_run = tuple(sorted(set.intersection(*(set(r.not_run) for r in ordered))))
    return ProbeResult(
        torch.cat([r.activations for r in ordered]), torch.cat([r.losses for r in ordered]), ordered[0].start, not_run
    )
