"""Exact, batched nearest-neighbour search for CODEC scores of many candidate columns.

Problem: n points, a shared "base" space X (n x k, k >= 0) and S candidate columns Z_j.
For every candidate j and every point i we need

    M_j(i) = argmin_{l != i}  D_X(i, l) + (Z_ij - Z_lj)^2          (squared Euclidean)

where D_X(i, l) = sum_c (X_ic - X_lc)^2 is accumulated column by column, in column order
(so that brute force and this module compute bit-identical distances).

Tie rule (everywhere in this package): among points at exactly the same distance the one
with the LOWEST sample index wins -- what ``argmin`` over a full distance row returns.

Two exact algorithms, both vectorised over candidates (no Python loop over candidates):

* ``nn_1d`` (k = 0): each column is sorted once; a point's nearest neighbour is in one of the
  two adjacent groups of equal values (or in its own group, at distance 0).
* ``nn_given_base`` (k >= 1): D_X is shared by all candidates, and d_j(i,l) >= D_X(i,l),
  d_j(i,l) >= (Z_ij - Z_lj)^2.  ``dense_pass`` scores every pair (i, j) against the K0
  nearest points of i in X (row gathers of a candidate chunk, tiled to stay in cache) and,
  optionally, against the w nearest points in the candidate's own sorted order (shifted
  slices of the sorted layout).  Every point not visited has D_X(i,l) >= A (the next
  X-distance of i) and (Z_ij - Z_lj)^2 >= B (the squared gap to the first sorted neighbour
  beyond the window), hence d_j(i,l) >= A + B; a pair whose best distance is < A + B is exact.
  The others are refined in rounds (``refine_round``: per-pair gathers; ``dense_segment``:
  the dense kernel for rows where most candidates are unresolved) that visit further
  X-neighbours and a wider window; the last round visits everything, so every pair ends exact.

Memory: D_X and its row sort (3 n^2 numbers), the sorted candidate columns (4 n S numbers)
and one tile (``block_bytes``).  Cost of a step: about n S (K0 + 2w) evaluations plus the
refined tail; the per-candidate loop it replaces costs n^2 S.

On the CPU (``compiled_ok``: numba installed, a CPU float tensor) the same functions run
compiled kernels (``_kernels``) with the same answers bit for bit: ``nn_1d`` a walk over each
sorted column, ``nn_given_base`` / ``dense_pass`` an exact search per pair (dense pass over the
K0 X-neighbours, then two walks stopped by the bound fl(A + B) > best), and ``best_by_bounds``
(called by ``codec.Scorer.best_conditional``) the argmax over candidates by branch and bound
over rounds of points.  Given the columns of X (``BaseSpace.from_distances(d, x)``) the kernels
recompute D_X(i, l) from them instead of reading the n x n matrix.  CUDA keeps the torch path.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from pipeline.selection import _kernels

BIG_INDEX = torch.iinfo(torch.int64).max

# working-memory budget of one dense tile (bytes); about 1 MiB keeps a tile in cache
DEFAULT_BLOCK_BYTES = 2**20
WALK_TOP = 64  # X-neighbours per point kept contiguous for the compiled walk
ZWINDOW = 8  # half width of the dense z-window of the first pass (when used)


@dataclass(frozen=True)
class SortedColumns:
    """Candidate columns in candidate-major layout, plus their per-column sort.

    values[j, i] = Z[i, j];  sorted[j, q] = values[j, perm[j, q]];  pos[j, perm[j, q]] = q.
    """

    values: Tensor  # (S, n)
    sorted: Tensor  # (S, n)
    perm: Tensor  # (S, n) int64
    pos: Tensor  # (S, n) int64

    @classmethod
    def build(cls, z: Tensor) -> "SortedColumns":
        """Sort every column of ``z`` (n x S) once (batched ``torch.sort``)."""
        values = z.t().contiguous()
        s, n = values.shape
        srt, perm = torch.sort(values, dim=1)
        pos = torch.empty_like(perm)
        pos.scatter_(1, perm, torch.arange(n, device=z.device).expand(s, n))
        return cls(values, srt, perm, pos)

    @property
    def n(self) -> int:
        return int(self.values.shape[1])


def compiled_ok(t: Tensor) -> bool:
    """Use the compiled CPU kernels (``_kernels``) for ``t``: numba present, a CPU float tensor.

    CUDA tensors keep the torch path.  ``UNLEARN_SELECTION_KERNEL=torch`` forces the torch
    path on the CPU as well (used by the tests that compare the two).
    """
    return (_kernels.HAVE_NUMBA and t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)
            and os.environ.get("UNLEARN_SELECTION_KERNEL", "numba") != "torch")


def _np(t: Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def _lexmin(d: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """Row-wise minimum of ``d`` (P x m) and the lowest ``idx`` attaining it."""
    dmin = d.amin(dim=1)
    lmin = torch.where(d == dmin.unsqueeze(1), idx, BIG_INDEX).amin(dim=1)
    return dmin, lmin


def merge_lex(bd: Tensor, bl: Tensor, d: Tensor, l: Tensor) -> tuple[Tensor, Tensor]:
    """Lexicographic (distance, index) minimum of two candidate sets."""
    better = (d < bd) | ((d == bd) & (l < bl))
    return torch.where(better, d, bd), torch.where(better, l, bl)


# --------------------------------------------------------------------------------------
# k = 0: one-dimensional nearest neighbours from the per-column sort
# --------------------------------------------------------------------------------------
def nn_1d(v: Tensor, idx: Tensor) -> Tensor:
    """Nearest neighbour of every point of every row, in the sorted layout.

    ``v`` (C x n) holds each row sorted ascending, ``idx`` (C x n) the original sample index
    of each entry.  Returns ``m`` (C x n, int64): ``m[j, q]`` is the sample index of the
    nearest neighbour (l != idx[j, q], lowest index among ties) of the point at sorted
    position q of row j, with distance (v_q - v_l)^2 exactly as brute force computes it.
    """
    c, n = v.shape
    dev = v.device
    if compiled_ok(v):
        m = torch.empty((c, n), dtype=torch.int64)
        _kernels.nn_1d_sorted(_np(v), _np(idx.to(torch.int64)), m.numpy())
        return m
    inf = torch.tensor(float("inf"), dtype=v.dtype, device=dev)
    eq_next = v[:, 1:] == v[:, :-1]
    if not bool(eq_next.any()):
        m, flag = _nn_1d_distinct(v, idx, inf)
    else:
        m, flag = _nn_1d_groups(v, idx, inf)
    if bool(flag.any()):
        rows, cols = flag.nonzero(as_tuple=True)
        for start in range(0, rows.numel(), 4096):
            r, cq = rows[start:start + 4096], cols[start:start + 4096]
            d = (v[r] - v[r, cq].unsqueeze(1)).square()
            d[torch.arange(r.numel(), device=dev), cq] = inf
            _, lm = _lexmin(d, idx[r])
            m[r, cq] = lm
    return m


def _nn_1d_distinct(v: Tensor, idx: Tensor, inf: Tensor) -> tuple[Tensor, Tensor]:
    """All values of each row distinct: neighbours are the adjacent sorted entries."""
    c, n = v.shape
    gap = (v[:, 1:] - v[:, :-1]).square()  # (v_q - v_{q-1})^2 == (v_{q-1} - v_q)^2 exactly
    dl = torch.cat([inf.expand(c, 1), gap], dim=1)
    dr = torch.cat([gap, inf.expand(c, 1)], dim=1)
    il = torch.cat([idx[:, :1], idx[:, :-1]], dim=1)
    ir = torch.cat([idx[:, 1:], idx[:, -1:]], dim=1)
    m = torch.where(dl < dr, il, torch.where(dr < dl, ir, torch.minimum(il, ir)))
    # rounding can make a farther value tie with the adjacent one: hand those to brute force
    flag = torch.zeros((c, n), dtype=torch.bool, device=v.device)
    if n >= 3:
        dmin = torch.minimum(dl, dr)
        gap2 = (v[:, 2:] - v[:, :-2]).square()
        flag[:, 2:] |= gap2 == dmin[:, 2:]
        flag[:, :-2] |= gap2 == dmin[:, :-2]
    return m, flag


def _nn_1d_groups(v: Tensor, idx: Tensor, inf: Tensor) -> tuple[Tensor, Tensor]:
    """General case with repeated values: work with groups of equal values."""
    c, n = v.shape
    dev = v.device
    q = torch.arange(n, device=dev).expand(c, n)
    new = torch.ones((c, n), dtype=torch.bool, device=dev)
    new[:, 1:] = v[:, 1:] != v[:, :-1]
    gid = new.cumsum(dim=1) - 1
    gf = torch.where(new, q, 0).cummax(dim=1).values
    starts = torch.where(new, q, n)
    nxt = torch.full_like(starts, n)
    nxt[:, :-1] = starts[:, 1:].flip(1).cummin(dim=1).values.flip(1)
    gl = nxt - 1
    g1 = torch.full_like(idx, BIG_INDEX).scatter_reduce_(1, gid, idx, "amin")
    gmin = g1.gather(1, gid)
    rest = torch.where(idx == gmin, BIG_INDEX, idx)
    g2 = torch.full_like(idx, BIG_INDEX).scatter_reduce_(1, gid, rest, "amin")
    has_mates = gl > gf
    mate = torch.where(idx == gmin, g2.gather(1, gid), gmin)

    lp, rp = gf - 1, gl + 1
    has_l, has_r = lp >= 0, rp < n
    lpc, rpc = lp.clamp(min=0), rp.clamp(max=n - 1)
    dl = torch.where(has_l, (v - v.gather(1, lpc)).square(), inf)
    dr = torch.where(has_r, (v - v.gather(1, rpc)).square(), inf)
    d0 = torch.where(has_mates, 0.0, inf).to(v.dtype)
    dmin = torch.minimum(d0, torch.minimum(dl, dr))
    m = torch.where(has_mates & (d0 == dmin), mate, BIG_INDEX)
    m = torch.minimum(m, torch.where(has_l & (dl == dmin), gmin.gather(1, lpc), BIG_INDEX))
    m = torch.minimum(m, torch.where(has_r & (dr == dmin), gmin.gather(1, rpc), BIG_INDEX))
    # a tie reaching beyond the adjacent group (possible only through rounding) -> brute force
    llp = gf.gather(1, lpc) - 1
    rrp = gl.gather(1, rpc) + 1
    dll = (v - v.gather(1, llp.clamp(min=0))).square()
    drr = (v - v.gather(1, rrp.clamp(max=n - 1))).square()
    flag = (has_l & (llp >= 0) & (dll == dmin)) | (has_r & (rrp < n) & (drr == dmin))
    return m, flag


# --------------------------------------------------------------------------------------
# k >= 1: nearest neighbours in (X, Z_j) for many candidates sharing D_X
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BaseSpace:
    """Squared distances in the base space X, sorted per row (shared by all candidates)."""

    d: Tensor  # (n, n) D_X with +inf on the diagonal
    a: Tensor  # (n, n) each row of d sorted ascending (the +inf of i itself last)
    order: Tensor  # (n, n) int64, a[i, t] = d[i, order[i, t]] (stable: ties by index)
    x: Tensor | None = None  # (n, k) the columns d was built from (optional; faster CPU kernel)

    @classmethod
    def from_distances(cls, d: Tensor, x: Tensor | None = None) -> "BaseSpace":
        """``d`` from ``squared_distances``; ``x``, if given, must be the columns it was built
        from, in the same order (the compiled kernel recomputes D_X(i, l) from them)."""
        a, order = torch.sort(d, dim=1, stable=True)
        if x is not None:
            x = x.reshape(d.shape[0], -1).to(d.dtype).contiguous()
        return cls(d, a, order, x)

    @cached_property
    def top(self) -> tuple[Tensor, Tensor]:
        """The first ``WALK_TOP`` columns of ``a`` and ``order`` as contiguous copies."""
        t = min(WALK_TOP, self.n)
        return self.a[:, :t].contiguous(), self.order[:, :t].contiguous()

    @property
    def n(self) -> int:
        return int(self.d.shape[0])

    def nearest(self) -> Tensor:
        """N(i): nearest neighbour of i in X (lowest index among ties)."""
        return self.order[:, 0]


def squared_distances(x: Tensor, d: Tensor | None = None) -> Tensor:
    """D_X accumulated column by column (in column order), +inf on the diagonal.

    Passing the previous ``d`` adds the columns of ``x`` to it (in place when possible).
    """
    n = x.shape[0]
    if d is None:
        d = torch.zeros((n, n), dtype=x.dtype, device=x.device)
        d.fill_diagonal_(float("inf"))
    for c in range(x.shape[1]):
        col = x[:, c]
        d.add_((col.unsqueeze(1) - col.unsqueeze(0)).square())
    return d


def default_zwindow(k: int) -> int:
    """Half width of the first pass's z-window: only worth its cost when X is one column."""
    return ZWINDOW if k <= 1 else 0


def default_k0(k: int, n: int) -> int:
    """Width of the dense pass: wider in low dimension, where X-neighbours are poorer guides.

    Tuned on n = 1000 realistic probe data (bench/bench_selection.py): a pair left unresolved
    costs about ten dense evaluations to refine, so the dense pass should resolve most pairs.
    """
    k0 = 48 if k <= 2 else 32 if k == 3 else 24
    return max(1, min(k0, n - 1))


@dataclass
class DenseChunk:
    """Result of the dense pass for a chunk of candidates (all (n, C))."""

    which: Tensor  # (C,) candidate indices into SortedColumns
    best_d: Tensor  # best distance found among the K0 nearest X-neighbours
    best_l: Tensor  # its sample index (lowest among ties)
    resolved: Tensor  # bool: best_l is the exact nearest neighbour
    pos: Tensor  # (C,) positions of these candidates in the ``which`` the pass was given


COMPILED_DENSE_CHUNK = 64  # candidates per call of the compiled dense kernel (n x 64 fits in L2)


def compiled_zwindow(zwindow: int) -> int:
    """Window of the compiled kernel's second pass: wider than the torch pass's (it is cheap
    there), and a small one even where the torch pass uses none."""
    return int(os.environ.get("UNLEARN_SELECTION_ZWINDOW", 0)) or (16 if zwindow > 0 else 4)


def _compiled_chunk(base: BaseSpace, cols: SortedColumns, which: Tensor, zc: Tensor, top: Tensor,
                    a_sel: Tensor, w: int, out_d: Tensor, out_l: Tensor) -> None:
    n = base.n
    use_x = base.x is not None
    x = base.x if use_x else base.d[:, :1]
    a_top, o_top = base.top
    big = torch.full((1,), float("inf"), dtype=base.d.dtype)
    xs = torch.empty((n, x.shape[1]), dtype=base.d.dtype)
    bdq = torch.empty(n, dtype=base.d.dtype)
    blq = torch.empty(n, dtype=torch.int64)
    _kernels.exact_chunk(_np(x), _np(base.d), use_x, _np(top), _np(a_sel), _np(a_top), _np(o_top),
                         _np(base.a), _np(base.order), _np(zc), _np(cols.sorted), _np(cols.perm),
                         _np(cols.pos), _np(which.to(torch.int64)), int(min(w, n - 1)), big.numpy(),
                         out_d.numpy(), out_l.numpy(), xs.numpy(), bdq.numpy(), blq.numpy())


def dense_pass(
    base: BaseSpace,
    cols: SortedColumns,
    which: Tensor,
    k0: int,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    zwindow: int = ZWINDOW,
):
    """Yield ``DenseChunk``s: every pair (i, j) scored against i's K0 nearest X-neighbours and
    its ``zwindow`` nearest sorted neighbours on each side in the candidate's column.

    The K0 neighbours of each i are arranged by sample index, so the first minimum along the
    block is the lowest index among ties.  A pair is resolved when its best distance is below
    A + B, A the (K0+1)-th smallest D_X(i, .) and B the squared z-gap to the first sorted
    neighbour beyond the window: every unvisited point is at least that far.
    """
    n = base.n
    k0 = max(1, min(k0, n - 1))
    top = torch.sort(base.order[:, :k0], dim=1).values  # (n, k0)
    a_top = base.d.gather(1, top).unsqueeze(2)  # (n, k0, 1)
    a_next = base.a[:, k0:k0 + 1]  # (n, 1)
    itemsize = cols.values.element_size()
    compiled = compiled_ok(base.d)
    c_chunk = COMPILED_DENSE_CHUNK if compiled else 256
    rows = max(1, min(n, int(block_bytes // (k0 * c_chunk * itemsize))))
    for c0 in range(0, which.numel(), c_chunk):
        w = which[c0:c0 + c_chunk]
        zc = cols.values.index_select(0, w).t().contiguous()  # (n, C)
        best_d = torch.empty_like(zc)
        best_l = torch.empty(zc.shape, dtype=torch.int64, device=zc.device)
        if compiled:  # exact in one call: every pair resolved
            _compiled_chunk(base, cols, w, zc, top, a_top[:, :, 0], compiled_zwindow(zwindow), best_d, best_l)
            yield DenseChunk(w, best_d, best_l, torch.ones(best_l.shape, dtype=torch.bool),
                             torch.arange(c0, c0 + w.numel(), device=w.device))
            continue
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            t = top[r0:r1]
            g = zc.index_select(0, t.reshape(-1)).view(r1 - r0, k0, -1)
            g.sub_(zc[r0:r1].unsqueeze(1)).square_().add_(a_top[r0:r1])
            bd, p = g.min(dim=1)
            best_d[r0:r1] = bd
            best_l[r0:r1] = t.gather(1, p)
        bound = a_next
        if zwindow > 0:
            zd, zl, zb = _zwindow(base, cols, w, zwindow)
            best_d, best_l = merge_lex(best_d, best_l, zd, zl)
            bound = a_next + zb
        yield DenseChunk(w, best_d, best_l, best_d < bound,
                         torch.arange(c0, c0 + w.numel(), device=w.device))


def _zwindow(base: BaseSpace, cols: SortedColumns, which: Tensor, w: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each point against its w nearest sorted neighbours on each side, for candidates ``which``.

    Works in the candidate's sorted layout with shifted slices (only D_X(i, l) is gathered);
    each offset serves both sides.  Returns, in the (n, C) sample layout, the lexicographic
    best (distance, index) and B: the squared gap to the first sorted neighbour beyond the
    window (a lower bound on (z_i - z_l)^2 for every l outside it; +inf past the ends).
    """
    n = base.n
    inf = float("inf")
    zs = cols.sorted.index_select(0, which)  # (C, n)
    pm = cols.perm.index_select(0, which)
    c = zs.shape[0]
    d_flat = base.d.reshape(-1)
    bd = torch.full_like(zs, inf)
    bl = torch.full_like(pm, BIG_INDEX)
    w = min(w, n - 1)
    for o in range(1, w + 1):
        dd = d_flat.take(pm[:, :-o] * n + pm[:, o:]).add_((zs[:, o:] - zs[:, :-o]).square_())
        for mine, other in ((slice(None, -o), slice(o, None)), (slice(o, None), slice(None, -o))):
            nd, nl = merge_lex(bd[:, mine], bl[:, mine], dd, pm[:, other])
            bd[:, mine], bl[:, mine] = nd, nl
    gap = torch.full_like(zs, inf)
    k = w + 1
    if k < n:
        g = (zs[:, k:] - zs[:, :-k]).square_()
        gap[:, k:] = g
        gap[:, :-k] = torch.minimum(gap[:, :-k], g)
    # back to the sample layout: row j, column perm[j, q]
    out_d = torch.empty_like(bd).scatter_(1, pm, bd)
    out_l = torch.empty_like(bl).scatter_(1, pm, bl)
    out_b = torch.empty_like(gap).scatter_(1, pm, gap)
    return out_d.t(), out_l.t(), out_b.t()


def nn_given_base(
    base: BaseSpace,
    cols: SortedColumns,
    which: Tensor,
    *,
    k0: int = 16,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    zwindow: int = ZWINDOW,
) -> Tensor:
    """M_j(i) for the candidates ``which`` (indices into ``cols``); returns (n, len(which)).

    Exact (same as brute force, lowest index on ties); see the module docstring.
    """
    n = base.n
    which = which.to(device=base.d.device, dtype=torch.int64)
    out = torch.empty((n, which.numel()), dtype=torch.int64, device=base.d.device)
    for ch in dense_pass(base, cols, which, k0, block_bytes, zwindow):
        finish_chunk(base, cols, ch, k0, block_bytes)
        out[:, ch.pos] = ch.best_l
    return out


def finish_chunk(base: BaseSpace, cols: SortedColumns, ch: DenseChunk, k0: int,
                 block_bytes: int = DEFAULT_BLOCK_BYTES) -> None:
    """Refine the unresolved pairs of a dense chunk in place (afterwards all are exact)."""
    unresolved = ~ch.resolved
    if bool(unresolved.any()):
        # candidate-major order: consecutive pairs read the same row of the candidate data
        jj, ii = unresolved.t().nonzero(as_tuple=True)
        bd, bl = refine(base, cols, ii, ch.which[jj], ch.best_d[ii, jj], ch.best_l[ii, jj],
                        min(k0, base.n - 1), 16 * block_bytes)
        ch.best_d[ii, jj] = bd
        ch.best_l[ii, jj] = bl
        ch.resolved[ii, jj] = True


def schedule(n: int, start: int, zwindow: int = 0) -> list[tuple[int, int, int]]:
    """Refinement rounds after a first pass of width ``start`` and z-window ``zwindow``:
    (first X-position, end X-position, z-window half width)."""
    last = n - 1
    rounds: list[tuple[int, int, int]] = []
    lo, w = start, max(2, 2 * zwindow)
    while lo < last:
        hi = min(last, max(lo * 2, 32))
        rounds.append((lo, hi, min(w, n)))
        lo, w = hi, w * 2
    return rounds


def refine(
    base: BaseSpace,
    cols: SortedColumns,
    i_p: Tensor,
    j_p: Tensor,
    bd: Tensor,
    bl: Tensor,
    start: int,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> tuple[Tensor, Tensor]:
    """Exact nearest neighbours of pairs (i_p, j_p) given the best (bd, bl) found so far.

    ``bd``/``bl`` must be the lexicographic minimum over (at least) the first ``start``
    X-neighbours of each i in D_X order.  Rounds (``refine_round``) visit further X-neighbours
    and a growing window of the candidate's own sorted order, and drop a pair once its best
    distance is below the bound on every unvisited point; the last round visits everything.
    """
    out_d, out_l = bd.clone(), bl.clone()
    live = torch.arange(i_p.numel(), device=i_p.device)
    for lo, hi, w in schedule(base.n, start):
        if live.numel() == 0:
            break
        d, l, done = refine_round(base, cols, i_p[live], j_p[live], out_d[live], out_l[live],
                                  lo, hi, w, block_bytes)
        out_d[live], out_l[live] = d, l
        live = live[~done]
    if live.numel():  # cannot happen: the last round visits every X-neighbour
        raise RuntimeError("nearest-neighbour refinement did not converge")
    return out_d, out_l


def refine_round(
    base: BaseSpace,
    cols: SortedColumns,
    i_p: Tensor,
    j_p: Tensor,
    bd: Tensor,
    bl: Tensor,
    lo: int,
    hi: int,
    w: int,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> tuple[Tensor, Tensor, Tensor]:
    """One refinement round for pairs (i_p, j_p) whose X-neighbours 0..lo-1 are visited.

    Visits X-positions lo..hi-1 (D_X order) and the w nearest sorted positions on each side in
    the candidate's column; returns the new (best distance, index) and ``done``: the best is
    below D_X(i, hi-th) + (gap to the (w+1)-th sorted neighbour)^2, a lower bound on the
    distance of every point not visited so far.
    """
    n = base.n
    dev = base.d.device
    inf = float("inf")
    itemsize = cols.values.element_size()
    width = (hi - lo) + 2 * w
    step = max(1, int(block_bytes // (width * (2 * itemsize + 24))))
    d_flat = base.d.reshape(-1)
    srt_flat, perm_flat = cols.sorted.reshape(-1), cols.perm.reshape(-1)
    val_flat, pos_flat = cols.values.reshape(-1), cols.pos.reshape(-1)
    offs = torch.cat([torch.arange(-w, 0, device=dev), torch.arange(1, w + 1, device=dev)])
    out_d, out_l = bd.clone(), bl.clone()
    done = torch.empty(i_p.numel(), dtype=torch.bool, device=dev)
    for s0 in range(0, i_p.numel(), step):
        sl = slice(s0, s0 + step)
        i, j = i_p[sl], j_p[sl]
        row = (j * n).unsqueeze(1)
        zi = val_flat.take(j * n + i).unsqueeze(1)
        cur_d, cur_l = out_d[sl], out_l[sl]
        if hi > lo:  # X-neighbours lo..hi-1 in D_X order
            l = base.order[:, lo:hi].index_select(0, i)
            d = base.a[:, lo:hi].index_select(0, i)
            d.add_((val_flat.take(row + l) - zi).square_())
            cur_d, cur_l = merge_lex(cur_d, cur_l, *_lexmin(d, l))
        # z-window: w sorted neighbours on each side
        p = pos_flat.take(j * n + i).unsqueeze(1)
        qq = p + offs
        valid = (qq >= 0) & (qq < n)
        flat = row + qq.clamp_(0, n - 1)
        lz = perm_flat.take(flat)
        dz = d_flat.take(i.unsqueeze(1) * n + lz).add_((srt_flat.take(flat) - zi).square_())
        dz = torch.where(valid, dz, inf)
        cur_d, cur_l = merge_lex(cur_d, cur_l, *_lexmin(dz, lz))
        # lower bound for every point not yet visited: A (next X-distance) + B (next z-gap)
        bound_a = base.a[:, min(hi, n - 1)].index_select(0, i)
        ql, qr = (p - w - 1).squeeze(1), (p + w + 1).squeeze(1)
        zi = zi.squeeze(1)
        gl = torch.where(ql >= 0, (zi - srt_flat.take(j * n + ql.clamp(min=0))).square(), inf)
        gr = torch.where(qr < n, (zi - srt_flat.take(j * n + qr.clamp(max=n - 1))).square(), inf)
        done[sl] = cur_d < bound_a + torch.minimum(gl, gr)
        out_d[sl], out_l[sl] = cur_d, cur_l
    return out_d, out_l, done


def dense_segment(base: BaseSpace, cols: SortedColumns, rows: Tensor, which: Tensor, lo: int, hi: int,
                  block_bytes: int = DEFAULT_BLOCK_BYTES) -> tuple[Tensor, Tensor]:
    """For rows x candidates, the lexicographic minimum over X-positions lo..hi-1 (dense).

    Same kernel as ``dense_pass`` (row gathers, no per-pair index arithmetic); used to refine
    rows where most candidates are still unresolved.  Returns (|rows|, C) distances, indices.
    """
    seg = torch.sort(base.order.index_select(0, rows)[:, lo:hi], dim=1).values  # by index: ties
    a_seg = base.d.index_select(0, rows).gather(1, seg).unsqueeze(2)
    width = hi - lo
    itemsize = cols.values.element_size()
    c_chunk = 256
    r_step = max(1, int(block_bytes // (width * c_chunk * itemsize)))
    out_d = torch.empty((rows.numel(), which.numel()), dtype=cols.values.dtype, device=rows.device)
    out_l = torch.empty((rows.numel(), which.numel()), dtype=torch.int64, device=rows.device)
    for c0 in range(0, which.numel(), c_chunk):
        zc = cols.values.index_select(0, which[c0:c0 + c_chunk]).t().contiguous()  # (n, C)
        zr = zc.index_select(0, rows)
        for r0 in range(0, rows.numel(), r_step):
            t = seg[r0:r0 + r_step]
            g = zc.index_select(0, t.reshape(-1)).view(t.shape[0], width, -1)
            g.sub_(zr[r0:r0 + r_step].unsqueeze(1)).square_().add_(a_seg[r0:r0 + r_step])
            bd, p = g.min(dim=1)
            out_d[r0:r0 + r_step, c0:c0 + zc.shape[1]] = bd
            out_l[r0:r0 + r_step, c0:c0 + zc.shape[1]] = t.gather(1, p)
    return out_d, out_l


def gap_bound(cols: SortedColumns, i: Tensor, j: Tensor) -> Tensor:
    """min over l != i of (z_ij - z_lj)^2, a lower bound from the two sorted neighbours."""
    n = cols.n
    inf = float("inf")
    p = cols.pos.reshape(-1).take(j * n + i)
    zi = cols.values.reshape(-1).take(j * n + i)
    srt = cols.sorted.reshape(-1)
    gl = torch.where(p > 0, (zi - srt.take(j * n + (p - 1).clamp(min=0))).square(), inf)
    gr = torch.where(p < n - 1, (zi - srt.take(j * n + (p + 1).clamp(max=n - 1))).square(), inf)
    return torch.minimum(gl, gr)


# --------------------------------------------------------------------------------------
# compiled branch and bound over candidates (CPU): the argmax of T without every score
# --------------------------------------------------------------------------------------
ROUND_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8, 1.0)
BOUND_CHUNK = 64  # candidates per kernel call (an n x 64 column block stays in L2)
ROW_WALK = 32  # X-positions past K0 copied per row for the walk (further ones read from the full sort)
COMPILED_K0 = 48  # X-neighbours of the compiled dense pass (tuned on bench_selection data:
# wider than the torch pass's because its pairs left over cost a scalar walk each)
COMPILED_K0_1D = 96  # with one X column its nearest points in X alone are a poorer guide


def _exact_rows(base: BaseSpace, cols: SortedColumns, rows: Tensor, which: Tensor, k0: int) -> Tensor:
    """M_j(i) for points ``rows`` x candidates ``which`` (compiled, exact): (|rows|, C) int64."""
    use_x = base.x is not None
    x = base.x if use_x else base.d[:, :1]
    width = min(base.n, k0 + ROW_WALK)
    a_top = base.a.index_select(0, rows)[:, :width].contiguous()
    o_top = base.order.index_select(0, rows)[:, :width].contiguous()
    top = torch.sort(base.order.index_select(0, rows)[:, :k0], dim=1).values
    a_sel = base.d.index_select(0, rows).gather(1, top)
    big = torch.full((1,), float("inf"), dtype=base.d.dtype)
    out = torch.empty((rows.numel(), which.numel()), dtype=torch.int64)
    for c0 in range(0, which.numel(), BOUND_CHUNK):
        w = which[c0:c0 + BOUND_CHUNK]
        zc = cols.values.index_select(0, w).t().contiguous()
        o = torch.empty((rows.numel(), w.numel()), dtype=torch.int64)
        _kernels.exact_rows(_np(x), _np(base.d), use_x, _np(rows), _np(top), _np(a_sel), _np(a_top), _np(o_top),
                            _np(base.a), _np(base.order), _np(zc), _np(cols.values), _np(cols.sorted),
                            _np(cols.perm), _np(cols.pos), _np(w), big.numpy(), o.numpy())
        out[:, c0:c0 + w.numel()] = o
    return out


def best_by_bounds(base: BaseSpace, cols: SortedColumns, which: Tensor, r: Tensor, rn: Tensor,
                   slack: Tensor, k0: int) -> tuple[int | None, int, int]:
    """Exact argmax over ``which`` of sum_i [min(R_i, R_M(i)) - rn_i] among positive ones.

    Returns (position in ``which`` or None, its numerator, the denominator sum(slack)), the
    same as ``codec.Scorer.best_conditional``.  Points are visited in rounds, highest rank
    first; after each round a candidate's numerator is bounded above by its exact partial sum
    plus the slack R_i - rn_i of the points not yet visited (min(R_i, R_M(i)) <= R_i), and the
    loss R_i - min(R_i, R_M(i)) that pulls a candidate below that bound is largest for high
    ranks.  The candidate with the highest bound is completed first (the incumbent); a
    candidate is dropped once its bound is below the incumbent (or equal, at a higher
    position) or <= 0.  Ties go to the lowest position.  Exact: every candidate kept to the
    end has its full sum.
    """
    n = base.n
    den = int(slack.sum())
    if den == 0:
        return None, 0, 0
    one_column = base.x is not None and base.x.shape[1] == 1
    k0 = max(1, min(COMPILED_K0_1D if one_column else max(k0, COMPILED_K0), n - 1))
    pts = torch.sort(r, descending=True, stable=True).indices
    ncand = which.numel()
    partial = torch.zeros(ncand, dtype=torch.int64)
    alive = torch.arange(ncand)
    best_pos: int | None = None
    best_num = 0
    lo = 0
    rem_slack = den

    def terms(rows: Tensor, cand: Tensor) -> Tensor:
        m = _exact_rows(base, cols, rows, which[cand], k0)
        return (torch.minimum(r[rows].unsqueeze(1), r[m]) - rn[rows].unsqueeze(1)).sum(dim=0)

    for frac in ROUND_FRACTIONS:
        hi = n if frac >= 1.0 else max(lo + 1, int(round(frac * n)))
        if hi <= lo:
            continue
        rows = pts[lo:hi]
        partial[alive] += terms(rows, alive)
        rem_slack -= int(slack[rows].sum())
        lo = hi
        upper = partial[alive] + rem_slack
        if lo >= n:  # every survivor is exact
            if alive.numel():
                top = int(upper.max())
                if top > 0:
                    p = int(alive[upper == top].min())
                    if best_pos is None or top > best_num or (top == best_num and p < best_pos):
                        best_pos, best_num = p, top
            break
        # incumbent: complete the survivor with the highest bound
        cand = int(alive[torch.argmax(upper)])
        if int(upper.max()) > 0:
            num = int(partial[cand]) + int(terms(pts[lo:], torch.tensor([cand]))[0])
            if num > 0 and (best_pos is None or num > best_num or (num == best_num and cand < best_pos)):
                best_pos, best_num = cand, num
        keep = (upper > 0) & (alive != cand)  # the completed one is settled either way
        if best_pos is not None:
            keep &= (upper > best_num) | ((upper == best_num) & (alive < best_pos))
        alive = alive[keep]
        if alive.numel() == 0:
            break
    return best_pos, best_num, den
