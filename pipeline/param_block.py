"""Parameter blocks: a subset of a model's parameters addressed by qualified name and rows.

A block is an ordered list of parts ``(name, rows)``; ``rows`` are indices along the
parameter's first dimension (one output unit of a Linear, one filter of a Conv2d), or
``None`` for the whole parameter. A block has a flat coordinate vector (parts in order,
rows in order, each row flattened in C order): curvature operators, solves and noise all
work on that vector, and ``insert`` maps a flat displacement back onto the parameters.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class BlockPart:
    name: str
    shape: tuple[int, ...]
    rows: Tensor | None = None  # int64 indices along dim 0, sorted, unique

    @property
    def row_size(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    @property
    def numel(self) -> int:
        if self.rows is None:
            return math.prod(self.shape)
        return int(self.rows.numel()) * self.row_size

    def take(self, value: Tensor) -> Tensor:
        """This part of a full parameter tensor, flattened."""
        if self.rows is None:
            return value.reshape(-1)
        return value.index_select(0, self.rows.to(value.device)).reshape(-1)

    def add(self, value: Tensor, delta_flat: Tensor) -> Tensor:
        """value + E delta (out of place; differentiable in delta, vmap-friendly)."""
        if self.rows is None:
            return value + delta_flat.reshape(self.shape)
        rows = self.rows.to(value.device)
        block = delta_flat.reshape((int(rows.numel()),) + tuple(self.shape[1:]))
        return value.index_add(0, rows, block.to(value.dtype))


class ParamBlock:
    """An ordered set of parameter parts with a flat coordinate system."""

    def __init__(self, parts: Iterable[BlockPart]):
        self.parts: tuple[BlockPart, ...] = tuple(parts)
        names = [p.name for p in self.parts]
        if len(set(names)) != len(names):
            raise ValueError("a parameter appears twice in the block; merge its rows into one part")
        if not self.parts:
            raise ValueError("a parameter block needs at least one part")
        self.offsets: list[int] = []
        total = 0
        for part in self.parts:
            self.offsets.append(total)
            total += part.numel
        self.numel = total

    # -- construction --------------------------------------------------------------------
    @classmethod
    def all_parameters(cls, model: nn.Module) -> "ParamBlock":
        return cls(BlockPart(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad)

    @classmethod
    def from_rows(cls, model: nn.Module, rows: Mapping[str, Iterable[int] | None]) -> "ParamBlock":
        """Block from ``{parameter name: rows or None}``, in the model's parameter order.
        Frozen parameters (``requires_grad`` False) are refused: they are not part of the
        trained objective, and a block would add a weight-decay penalty they never had."""
        params = dict(model.named_parameters())
        unknown = sorted(set(rows) - set(params))
        if unknown:
            raise KeyError(f"parameters {unknown} are not in the model; names are qualified, e.g. 'fc.weight'")
        frozen = sorted(name for name in rows if not params[name].requires_grad)
        if frozen:
            raise ValueError(
                f"parameters {frozen} are frozen (requires_grad=False): the training objective never "
                "moved or penalised them, so a removal step must not either; leave them out of the block "
                "(or unfreeze them and retrain)"
            )
        parts = []
        for name, p in params.items():
            if name not in rows:
                continue
            r = rows[name]
            if r is None:
                parts.append(BlockPart(name, tuple(p.shape)))
                continue
            idx = torch.unique(torch.as_tensor(list(r), dtype=torch.long))
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= p.shape[0]):
                raise IndexError(f"rows of '{name}' must lie in [0, {p.shape[0]})")
            if idx.numel():
                parts.append(BlockPart(name, tuple(p.shape), idx))
        return cls(parts)

    # -- coordinates ---------------------------------------------------------------------
    def gather(self, tensors: Mapping[str, Tensor]) -> Tensor:
        """Flat vector of the block's entries of ``tensors`` (parameters or gradients)."""
        return torch.cat([part.take(tensors[part.name]) for part in self.parts])

    def split(self, flat: Tensor) -> list[Tensor]:
        return [flat[o : o + part.numel] for o, part in zip(self.offsets, self.parts)]

    def insert(self, params: Mapping[str, Tensor], delta: Tensor) -> dict[str, Tensor]:
        """``params`` with ``delta`` added on the block (a new dict; others shared)."""
        out = dict(params)
        for part, piece in zip(self.parts, self.split(delta)):
            out[part.name] = part.add(params[part.name], piece)
        return out

    @torch.no_grad()
    def add_to_model(self, model: nn.Module, delta: Tensor) -> None:
        params = dict(model.named_parameters())
        for part, piece in zip(self.parts, self.split(delta)):
            p = params[part.name]
            p.copy_(part.add(p, piece.to(device=p.device, dtype=p.dtype)))

    def is_whole(self, model: nn.Module, module: nn.Module) -> bool:
        """True when the block is exactly every parameter of ``module`` (a submodule of
        ``model``), each whole: no other parameter, no row subset."""
        owned = {id(p) for p in module.parameters()}
        names = {name for name, p in model.named_parameters() if id(p) in owned}
        return {part.name for part in self.parts} == names and all(part.rows is None for part in self.parts)

    def describe(self) -> list[dict]:
        return [
            {"parameter": part.name, "rows": None if part.rows is None else part.rows.tolist(), "numel": part.numel}
            for part in self.parts
        ]
