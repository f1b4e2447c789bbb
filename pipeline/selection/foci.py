"""L-FOCI: forward stepwise feature selection with (L-)CODEC.

Source: Azadkia & Chatterjee 2021 (FOCI, "Feature Ordering by Conditional Independence");
Mehta et al., CVPR 2022 (L-FOCI: FOCI on L-CODEC, used to pick the parameter slices that a
deletion request depends on).

Step 1 picks argmax_j T(Y, Z_j); step k+1 picks argmax_j T(Y, Z_j | Z_picked) among the columns
not yet picked.  Selection stops before step k+1 when its best T is <= 0 (the first pick is
always kept), when ``max_picks`` columns are picked, or when no column is left.  Ties in the
argmax go to the lowest column index.

Every step scores all remaining columns with one batched, exact nearest-neighbour search
(see ``pipeline.selection._nn``): no Python loop over candidates and no per-candidate
distance matrix.  The squared distances of the picked columns, D_X, are kept and extended by
one column per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pipeline.progress import tick
from pipeline.selection._nn import BaseSpace, default_k0, default_zwindow, squared_distances
from pipeline.selection.codec import (
    Scorer,
    as_matrix,
    as_vector,
    check_generator,
    check_not_constant,
    lcodec_jitter,
)


@dataclass(frozen=True)
class FociResult:
    """Selected columns in pick order and the T value each had when it was picked."""

    picks: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.picks)


def standardize_columns(z: Tensor) -> Tensor:
    """(z - mean) / std per column (population std); a constant column becomes 0.

    The same bits on every device and layout: the column means and standard deviations are
    reductions, whose order of operations differs between the CPU and CUDA (and with the
    memory layout), so they are computed on the CPU from a contiguous copy; only the
    elementwise (z - mean) / std (correctly rounded everywhere) runs on z's device.  A
    last-bit difference here would move nearest neighbours that are nearly tied, and with
    them the picks.
    """
    host = z.to("cpu").contiguous()
    mean = host.mean(dim=0, keepdim=True)
    std = (host - mean).pow(2).mean(dim=0, keepdim=True).sqrt()
    mean, std = mean.to(z.device), std.to(z.device)
    centred = z - mean
    return torch.where(std > 0, centred / torch.where(std > 0, std, torch.ones_like(std)), torch.zeros_like(centred))


def lfoci(
    y: Any,
    z: Any,
    *,
    max_picks: int | None = None,
    generator: torch.Generator | None = None,
    block_bytes: int | None = None,
    standardize: bool = True,
) -> FociResult:
    """Forward stepwise selection of columns of ``z`` (n x S) that ``y`` (n,) depends on.

    With ``generator`` (L-FOCI) y and every column of z get the L-CODEC tie-breaking noise
    once, before the first step (y first, then z column by column); without it ties are
    broken deterministically (lowest sample index; see ``pipeline.selection.codec``).
    ``block_bytes`` is the working memory of one dense tile (default 1 MiB, cache-sized for
    CPUs; use tens of MiB on a GPU); refinement batches use 16 times that.  The D_X matrix and
    its row sort (3 x n x n) and the sorted candidate columns (4 x n x S) come on top.
    Works on the device and float dtype of the inputs (integers become float64).

    ``standardize`` (default, as the reference FOCI implementation does) centres every column
    of z and divides it by its standard deviation before anything else, so that the nearest
    neighbours in (Z_picked, Z_j) -- and so the picks -- do not follow the columns' scales
    (activations of different layers differ by orders of magnitude). Constant columns stay 0.
    """
    generator = check_generator(generator)
    if max_picks is not None:
        if isinstance(max_picks, bool) or not isinstance(max_picks, int) or max_picks < 1:
            raise ValueError(f"max_picks must be a positive integer or None, got {max_picks!r}")
    yt = as_vector(y, "y")
    zt = as_matrix(z, yt.shape[0], "z", yt.device)
    dtype = torch.promote_types(yt.dtype, zt.dtype)
    yt, zt = yt.to(dtype), zt.to(dtype)
    check_not_constant(yt)
    if standardize:
        zt = standardize_columns(zt)
    if generator is not None:
        yt = lcodec_jitter(yt, generator)
        zt = lcodec_jitter(zt, generator)

    n, s = zt.shape
    limit = s if max_picks is None else min(max_picks, s)
    scorer = Scorer(yt, zt, block_bytes=block_bytes)
    dev = zt.device
    remaining = torch.ones(s, dtype=torch.bool, device=dev)
    picks: list[int] = []
    scores: list[float] = []
    d_x: Tensor | None = None

    while len(picks) < limit:
        which = remaining.nonzero().squeeze(1)
        if d_x is None:
            # step 1: every T(Y, Z_j) exactly (1-D neighbours from the column sort)
            num = scorer.numerators_unconditional(which)
            best = int(torch.argmax(num))  # integer numerators, common denominator
            t_best = int(num[best]) / scorer.den0
        else:
            k = len(picks)
            pos, num_best, den = scorer.best_conditional(
                BaseSpace.from_distances(d_x, zt[:, picks]), which, default_k0(k, n), default_zwindow(k))
            if pos is None:  # best T <= 0 (or Y already determined by the picks): stop
                break
            best, t_best = pos, num_best / den
        col = int(which[best])
        picks.append(col)
        scores.append(float(t_best))
        remaining[col] = False
        tick(total=limit, phase="L-FOCI picks", unit="pick")
        d_x = squared_distances(zt[:, col:col + 1], d_x)
    return FociResult(picks, scores)
