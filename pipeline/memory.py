"""Memory budgets: how big a chunk (samples per batch, tangent columns per vmapped pass,
perturbations per probe pass) a stage may take so that its working memory stays inside the
machine.

  ``MemoryBudget``       bytes a stage may allocate on top of what is already resident (the
                         loaded model and data); ``MemoryBudget.from_setting("8GiB" | "auto" |
                         int)``. ``auto`` = ``AUTO_FRACTION`` of the memory available now: CUDA
                         free memory on a GPU device, else MemAvailable (psutil, or
                         /proc/meminfo).
  ``use_budget``         scope a budget (``remove`` scopes the run's ``memory_budget``); maths
                         functions that are not given one explicitly use ``current_budget()``
                         (the scoped one, else ``auto``)
  ``forwarded``          what a Ray worker is sent of the scoped budget: a set budget's bytes,
                         or None for ``auto`` (the worker derives it from its own machine)
  ``ModelCost``          an analytic estimate of a model pass: bytes of every tensor a forward
                         pass of ONE sample creates (measured once by a dispatch mode that
                         sums the outputs of every operator, views excluded) and the parameter
                         bytes a block touches
  ``chunk_size``         (budget, per-item bytes, fixed bytes) -> the largest chunk >= 1 that
                         fits, or ``MemoryBudgetError`` naming ``memory_budget`` and the fix
  ``plan_*``             the chunk sizes of each stage (forward, gradient, Hessian-vector
                         product, vmapped Hessian columns, probe passes)

The estimates are deliberately pessimistic: the sum of all operator outputs of a forward pass
bounds both what autograd saves for the backward pass and the peak of a no-grad pass, and
every stage multiplies it by the number of such passes it keeps alive (tangents, gradients).
A chunk is only ever made smaller than the caller asked for, never larger, and chunking only
splits sums (results agree up to float rounding). No Ray, HTTP or storage here.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import re
import weakref
from dataclasses import dataclass
from typing import Annotated, Any, Iterator, Mapping

import torch
from pydantic import AfterValidator
from torch import nn

__all__ = [
    "AUTO_FRACTION", "MemoryBudget", "MemoryBudgetError", "ModelCost", "Setting", "available_bytes", "call_batch_size",
    "chunk_size",
    "current_budget", "format_bytes", "forwarded", "parse_bytes", "use_budget", "worker_budget",
]

#: Share of the memory available when a stage starts that ``auto`` lets it use.
AUTO_FRACTION = 0.5
#: When nothing can be read about the machine (no psutil, no /proc/meminfo).
FALLBACK_AVAILABLE = 4 * 2**30
SETTING = "memory_budget"

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


class MemoryBudgetError(ValueError):
    """The memory budget cannot hold even one chunk of a stage (or the setting is malformed);
    the message names ``memory_budget`` and the fix. Raised before the stage allocates."""


def parse_bytes(text: str | int | float) -> int:
    """"8GiB", "512 MiB", "2G", "1.5GB", 123456 -> bytes (binary units KiB/MiB/GiB/TiB, decimal
    KB/MB/GB/TB or K/M/G/T)."""
    if isinstance(text, bool):
        raise MemoryBudgetError(f"{SETTING} must be 'auto', a byte count or a size like '8GiB' (got {text!r})")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise MemoryBudgetError(
                f"{SETTING} {text!r} is not a size: write 'auto', a byte count, or a number with a unit "
                "(KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. '8GiB'")
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(value) or value < 1:
        raise MemoryBudgetError(f"{SETTING} must be a positive size (got {text!r})")
    return int(value)


def format_bytes(n: float) -> str:
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def available_bytes(device: str | torch.device | None = None) -> int:
    """Memory a stage could use now: CUDA free memory for a CUDA device; otherwise the
    kernel's MemAvailable (psutil when installed, else /proc/meminfo)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - psutil missing or unusable: read the kernel's figure
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return FALLBACK_AVAILABLE


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes a stage may allocate on top of the resident model and data."""

    bytes: int
    source: str = "setting"  # "setting", or how "auto" was derived

    def __post_init__(self) -> None:
        if int(self.bytes) < 1:
            raise MemoryBudgetError(f"{SETTING} must be positive (got {self.bytes})")

    @classmethod
    def auto(cls, device: str | torch.device | None = None, fraction: float = AUTO_FRACTION) -> "MemoryBudget":
        avail = available_bytes(device)
        where = "CUDA free memory" if device is not None and torch.device(device).type == "cuda" else "available RAM"
        return cls(max(1, int(fraction * avail)), f"auto: {fraction:g} x {where} ({format_bytes(avail)})")

    @classmethod
    def from_setting(cls, value: "MemoryBudget | str | int | float | None",
                     device: str | torch.device | None = None) -> "MemoryBudget":
        """``"auto"`` / None -> ``auto(device)``; ``"8GiB"``, ``"512MB"``, an int of bytes."""
        if isinstance(value, MemoryBudget):
            return value
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return cls.auto(device)
        return cls(parse_bytes(value), "setting")

    def describe(self) -> str:
        return f"{format_bytes(self.bytes)} ({self.source})"

    def named(self) -> str:
        """How an error names this budget: ``memory_budget 2 GiB``, with its source unless it is
        the plain setting (``auto: ...``, or the share of a setting a worker got)."""
        note = "" if self.source == "setting" else f" ({self.source})"
        return f"{SETTING} {format_bytes(self.bytes)}{note}"

    def __str__(self) -> str:
        return format_bytes(self.bytes)


def check_setting(value: Any) -> Any:
    """Pydantic helper: validate a ``memory_budget`` field's value, return it unchanged."""
    if value is None or isinstance(value, MemoryBudget):
        return value
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        parse_bytes(value)
    except MemoryBudgetError as err:
        raise ValueError(str(err)) from None
    return value


#: The type of a ``memory_budget`` field in a pydantic config: "auto", a byte count or a size like
#: "8GiB", checked by ``check_setting`` (a malformed value is a validation error naming the field).
Setting = Annotated[str | int, AfterValidator(check_setting)]


_SCOPED: contextvars.ContextVar[MemoryBudget | None] = contextvars.ContextVar("memory_budget", default=None)


@contextlib.contextmanager
def use_budget(budget: "MemoryBudget | str | int | None", device: str | torch.device | None = None) -> Iterator[MemoryBudget]:
    """Within the block, ``current_budget()`` is ``budget`` (parsed by ``from_setting``)."""
    resolved = MemoryBudget.from_setting(budget, device)
    token = _SCOPED.set(resolved)
    try:
        yield resolved
    finally:
        _SCOPED.reset(token)


def current_budget(device: str | torch.device | None = None) -> MemoryBudget:
    """The scoped budget (``use_budget``), else ``auto`` for ``device``."""
    scoped = _SCOPED.get()
    return scoped if scoped is not None else MemoryBudget.auto(device)


def resolve(budget: "MemoryBudget | str | int | None", device: str | torch.device | None = None) -> MemoryBudget:
    """An explicit budget, or ``current_budget`` when None."""
    return current_budget(device) if budget is None else MemoryBudget.from_setting(budget, device)


def forwarded(budget: MemoryBudget | None = None) -> int | None:
    """What a stage running on another machine (a Ray worker) is sent of ``budget`` (default: the
    scoped one): a set budget's bytes, the same per-stage limit there; None for ``auto``, which
    that machine derives from its own memory."""
    budget = budget if budget is not None else _SCOPED.get()
    return None if budget is None or budget.source != "setting" else int(budget.bytes)


def worker_budget(set_bytes: int | None, sharing: int, device: str | torch.device | None = None) -> MemoryBudget:
    """The budget of one of ``sharing`` Ray workers that compute in one machine's memory (a
    local Ray: every worker on the driver's machine): a set budget (``forwarded`` bytes) split
    ``sharing`` ways, ``auto`` = AUTO_FRACTION / ``sharing`` of the memory available there, so
    that the workers together stay inside what one budget allows. A CUDA worker computes in its
    own device's memory: nothing is split."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    share = 1 if dev.type == "cuda" else max(1, int(sharing))
    if set_bytes is None:
        budget = MemoryBudget.auto(dev, AUTO_FRACTION / share)
        return budget if share == 1 else MemoryBudget(budget.bytes, f"{budget.source}, shared by {share} workers")
    if share == 1:
        return MemoryBudget(int(set_bytes), "setting")
    return MemoryBudget(max(1, int(set_bytes) // share),
                        f"the set {format_bytes(set_bytes)} shared by {share} workers on one machine")


def chunk_size(budget: MemoryBudget, per_item: float, fixed: float = 0.0, *, limit: int | None = None,
               what: str = "item", fix: str = "use a smaller model") -> int:
    """The largest n <= ``limit`` with fixed + n * per_item <= budget; at least 1, else
    ``MemoryBudgetError`` (nothing has been allocated yet)."""
    per_item = max(float(per_item), 1.0)
    room = budget.bytes - float(fixed)
    n = int(room // per_item) if room > 0 else 0
    if n < 1:
        raise MemoryBudgetError(
            f"{budget.named()} cannot hold one {what} of this model (needs "
            f"~{format_bytes(fixed + per_item)}): raise {SETTING} or {fix}")
    return n if limit is None else max(1, min(int(limit), n))


# -- the cost of a model pass ---------------------------------------------------------------------
class _OutputBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Sums the bytes of every operator output (views, which share storage, excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage(t) not in inputs:
                self.total += t.numel() * t.element_size()
        return out


def _output_bytes(model: nn.Module, call: Any) -> int:
    """Bytes of every operator output of ``call()`` (at least 1), run no-grad with ``model`` in
    eval mode."""
    from pipeline.eval_mode import eval_mode_restored

    mode = _OutputBytes()
    with eval_mode_restored(model), torch.no_grad(), mode:
        call()
    return max(int(mode.total), 1)


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage
        return id(t)


def _dtype_bytes(model: nn.Module) -> int:
    for p in model.parameters():
        return p.element_size()
    return 4


@dataclass
class ModelCost:
    """Analytic per-sample costs of passes through ``model`` (see the module docstring)."""

    activation_bytes: int  # all operator outputs of a forward pass of one sample
    param_bytes: int       # all parameters
    element_size: int      # bytes per parameter entry

    @classmethod
    def measure(cls, model: nn.Module, task: Any, batch_of_one: Mapping[str, torch.Tensor]) -> "ModelCost":
        """One no-grad forward of one sample under a dispatch mode summing every output."""
        activations = _output_bytes(model, lambda: task.per_sample_loss(task.forward(model, dict(batch_of_one)),
                                                                         dict(batch_of_one)))
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        return cls(activations, int(params), _dtype_bytes(model))

    @classmethod
    def of(cls, model: nn.Module, task: Any, data: Any) -> "ModelCost":
        """Measured on the first sample of a ``SampleSet`` (samples share their shape)."""
        if len(data) == 0:
            return cls(1, sum(p.numel() * p.element_size() for p in model.parameters()), _dtype_bytes(model))
        first = next(iter(data.batches(1)))
        return cls.measure(model, task, first)

    def touched_bytes(self, block: Any) -> int:
        """Bytes of the whole parameters a block's parts live in (``insert`` copies them)."""
        return sum(math.prod(part.shape) for part in block.parts) * self.element_size

    # -- stage plans: (fixed bytes, bytes per item) ----------------------------------------------
    # Multipliers of the one-sample forward cost: a no-grad pass keeps at most all of its outputs
    # alive; a gradient pass keeps them for backward and makes as many gradients (x3 with the
    # temporaries); forward-over-reverse (jvp of grad) doubles that with the tangents, and so does one
    # vector's reverse-over-reverse product (the gradient pass's graph kept, then differentiated again).
    FORWARD, GRADIENT, HVP_PRIMAL, HVP_TANGENT = 1.5, 4.0, 4.0, 6.0

    def forward_plan(self) -> tuple[float, float]:
        return 0.0, self.FORWARD * self.activation_bytes

    def gradient_plan(self, block: Any) -> tuple[float, float]:
        fixed = 3.0 * self.touched_bytes(block) + 8.0 * block.numel
        return fixed, self.GRADIENT * self.activation_bytes

    def hvp_plan(self, block: Any) -> tuple[float, float]:
        fixed = 6.0 * self.touched_bytes(block) + 16.0 * block.numel
        return fixed, (self.HVP_PRIMAL + self.HVP_TANGENT) * self.activation_bytes


def sample_chunk(budget: MemoryBudget, cost: ModelCost, plan: tuple[float, float], *, limit: int,
                 what: str, fix: str) -> int:
    """Samples per batch of a pass whose plan is (fixed, per sample)."""
    fixed, per_sample = plan
    return chunk_size(budget, per_sample, fixed, limit=limit, what=what, fix=fix)


def hessian_chunks(budget: MemoryBudget, cost: ModelCost, block: Any, *, columns: int, batch_size: int) -> tuple[int, int]:
    """(columns per vmapped pass, samples per batch) for ``BlockHessian.matmat``.

    Per pass: fixed (the primal pass over b samples, shared by the columns) + c x (the column's
    parameter tangents and its float64 output rows) + c x b x (its activation tangents)."""
    dim_bytes = 8.0 * block.numel
    per_column = 6.0 * cost.touched_bytes(block) + 3.0 * dim_bytes
    primal = ModelCost.HVP_PRIMAL * cost.activation_bytes
    tangent = ModelCost.HVP_TANGENT * cost.activation_bytes
    fix = "choose fewer parameters (a smaller block: lower block_numel_max / max_slices, or selection: lfoci)"

    def most_columns(b: int) -> int:
        room = budget.bytes - 4.0 * cost.touched_bytes(block) - b * primal
        return int(room // (per_column + b * tangent)) if room > 0 else 0

    if most_columns(1) < 1:
        needs = 4.0 * cost.touched_bytes(block) + primal + per_column + tangent
        raise MemoryBudgetError(
            f"{budget.named()} cannot hold one Hessian column of this model (needs "
            f"~{format_bytes(needs)}): raise {SETTING} or {fix}")
    want_c = max(1, int(columns))
    b = max(1, int(batch_size))
    # Fewer samples per batch before fewer columns, down to a pass of at least 8 columns (or the
    # wanted number): the primal pass is shared by the columns of a pass.
    while b > 1 and most_columns(b) < min(want_c, 8):
        b = max(1, b // 2)
    c = max(1, min(want_c, most_columns(b)))
    return c, b


_RESERVED: contextvars.ContextVar[int] = contextvars.ContextVar("memory_reserved", default=0)


@contextlib.contextmanager
def reserved(nbytes: int) -> Iterator[None]:
    """Within the block, ``nbytes`` of every budget are taken (a dense matrix being filled):
    ``available_in`` subtracts them."""
    token = _RESERVED.set(_RESERVED.get() + int(nbytes))
    try:
        yield
    finally:
        _RESERVED.reset(token)


def available_in(budget: MemoryBudget) -> MemoryBudget:
    """``budget`` less what enclosing stages hold (``reserved``); at least one byte."""
    held = _RESERVED.get()
    if not held:
        return budget
    return MemoryBudget(max(1, budget.bytes - held), f"{budget.source}, less {format_bytes(held)} held")


_COSTS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def cost_of(model: nn.Module, task: Any, data: Any) -> ModelCost:
    """``ModelCost.of``, cached per model and sample shape (parameter values do not matter)."""
    key = tuple(sorted((k, tuple(v.shape[1:]), str(v.dtype)) for k, v in data.columns.items()))
    per_model = _COSTS.setdefault(model, {})
    if key not in per_model:
        per_model[key] = ModelCost.of(model, task, data)
    return per_model[key]


def model_device(model: nn.Module) -> torch.device:
    """Where the model computes: its first parameter's (or buffer's) device; CPU for a module
    that holds neither (a wrapper whose tensors live in plain attributes)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def forward_batch_size(model: nn.Module, task: Any, data: Any, batch_size: int,
                       budget: "MemoryBudget | str | int | None" = None) -> int:
    """Samples per no-grad forward pass (evaluation, line search): ``batch_size`` or fewer."""
    if len(data) == 0:
        return batch_size
    device = model_device(model)
    cost = cost_of(model, task, data)
    return sample_chunk(available_in(resolve(budget, device)), cost, cost.forward_plan(),
                        limit=min(batch_size, len(data)), what="sample's forward pass", fix="use a smaller model")


def call_batch_size(model: nn.Module, fn: Any, data: Any, batch_size: int,
                    budget: "MemoryBudget | str | int | None" = None) -> int:
    """Samples per no-grad call ``fn(batch["x"])`` of one of ``model``'s methods other than the
    task's forward (retrieval features): ``batch_size`` or fewer, from the bytes of every
    operator output of a one-sample call (measured once per model, method and sample shape)."""
    if len(data) == 0:
        return batch_size
    key = ("call", getattr(fn, "__name__", repr(fn)), tuple(data.columns["x"].shape[1:]), str(data.columns["x"].dtype))
    per_model = _COSTS.setdefault(model, {})
    if key not in per_model:
        first = next(iter(data.batches(1)))
        per_model[key] = _output_bytes(model, lambda: fn(first["x"]))
    return chunk_size(available_in(resolve(budget, model_device(model))), ModelCost.FORWARD * per_model[key],
                      limit=min(batch_size, len(data)), what=f"sample's {key[1]} pass", fix="use a smaller model")


def check_one_sample(model: nn.Module, task: Any, data: Any, budget: MemoryBudget) -> None:
    """Fail up front when ``budget`` cannot hold a forward and a gradient pass of one sample
    through the whole model (every method needs both)."""
    if len(data) == 0:
        return
    cost = cost_of(model, task, data)
    needs = 3.0 * cost.param_bytes + ModelCost.GRADIENT * cost.activation_bytes
    if needs > budget.bytes:
        raise MemoryBudgetError(
            f"{budget.named()} cannot hold one sample's gradient pass through this model "
            f"(needs ~{format_bytes(needs)}): raise {SETTING} or use a smaller model")
