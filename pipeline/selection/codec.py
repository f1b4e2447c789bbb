"""CODEC and L-CODEC: the conditional dependence coefficient of Azadkia & Chatterjee.

Source: M. Azadkia and S. Chatterjee, "A simple measure of conditional dependence",
Annals of Statistics 49(6), 2021; L-CODEC: R. Mehta, S. Pal, V. Singh, S. N. Ravi,
"Deep Unlearning via Randomized Conditionally Independent Hessians", CVPR 2022.

For n samples of Y (scalar), Z (candidate) and X (conditioning set, possibly empty):

    R_i  = #{j : Y_j <= Y_i}          L_i = #{j : Y_j >= Y_i}
    N(i) = nearest neighbour of i in X        (Euclidean, excluding i)
    M(i) = nearest neighbour of i in (X, Z)

    T(Y, Z | X) = sum_i [min(R_i, R_M(i)) - min(R_i, R_N(i))] / sum_i [R_i - min(R_i, R_N(i))]
    T(Y, Z)     = sum_i [n min(R_i, R_M(i)) - L_i^2] / sum_i L_i (n - L_i)        (X empty)

Numerators and denominators are exact integer sums; T is their float64 ratio.  If the
conditional denominator is 0 (on the sample, Y is already determined by X) T is defined as 0:
there is nothing left for Z to explain.

Ties.  Plain CODEC (``generator=None``) is deterministic: ranks count ties as above, and a
nearest neighbour at exactly the same distance as another is resolved towards the LOWEST
sample index (what ``argmin`` over a full distance row returns).  L-CODEC (a
``torch.Generator`` given) first adds tiny uniform noise to every column of Y, Z and X,
smaller than half the smallest non-zero gap between distinct values of that column
(|noise| <= 0.45 * gap), so the order of distinct values is kept while ties -- in ranks and
in nearest neighbours -- are broken at random.  Any tie that survives the noise (the noise
can round away next to very large values) falls back to the lowest-index rule.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipeline.selection._nn import (
    DEFAULT_BLOCK_BYTES,
    BaseSpace,
    best_by_bounds,
    compiled_ok,
    dense_segment,
    gap_bound,
    merge_lex,
    refine_round,
    schedule,
    dense_pass,
    default_k0,
    default_zwindow,
    SortedColumns,
    nn_1d,
    nn_given_base,
    squared_distances,
)

JITTER_FRACTION = 0.45  # |noise| <= 0.45 * (smallest non-zero gap) < gap / 2


# --------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------
def _float_dtype(t: Tensor) -> torch.dtype:
    if t.dtype in (torch.float32, torch.float64):
        return t.dtype
    if t.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if t.is_complex():
        raise ValueError("complex inputs are not supported")
    return torch.float64


def as_vector(y: Any, name: str = "y") -> Tensor:
    """``y`` as a finite float vector of length n >= 2 (a (n, 1) matrix is accepted)."""
    t = torch.as_tensor(y)
    if t.dim() == 2 and t.shape[1] == 1:
        t = t[:, 0]
    if t.dim() != 1:
        raise ValueError(f"{name} must be a vector of n samples (shape (n,) or (n, 1)), got shape {tuple(t.shape)}")
    t = t.to(_float_dtype(t))
    if t.shape[0] < 2:
        raise ValueError(f"{name} has {t.shape[0]} sample(s); CODEC needs at least 2")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or infinite values; remove or impute them first")
    return t


def as_matrix(z: Any, n: int, name: str, device: torch.device, *, allow_empty: bool = False) -> Tensor:
    """``z`` as a finite (n, m) float matrix on ``device`` (a vector is one column)."""
    t = torch.as_tensor(z)
    if t.dim() == 1:
        t = t.unsqueeze(1)
    if t.dim() != 2:
        raise ValueError(f"{name} must have shape (n,) or (n, m), got shape {tuple(t.shape)}")
    if t.shape[0] != n:
        raise ValueError(f"{name} has {t.shape[0]} rows but y has {n} samples; they must match")
    if t.shape[1] == 0 and not allow_empty:
        raise ValueError(f"{name} has no columns")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but y is on {device}; put them on the same device")
    t = t.to(_float_dtype(t))
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or infinite values; remove or impute them first")
    return t


def check_not_constant(y: Tensor, name: str = "y") -> None:
    if bool((y == y[0]).all()):
        raise ValueError(f"{name} is constant: its dependence on anything is undefined")


def check_generator(generator: Any) -> torch.Generator | None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return generator


# --------------------------------------------------------------------------------------
# ranks and jitter
# --------------------------------------------------------------------------------------
def rank_stats(y: Tensor) -> tuple[Tensor, Tensor]:
    """R_i = #{j: y_j <= y_i} and L_i = #{j: y_j >= y_i} (int64)."""
    s = torch.sort(y).values
    n = y.shape[0]
    r = torch.searchsorted(s, y, right=True)
    ell = n - torch.searchsorted(s, y, right=False)
    return r, ell


def min_gaps(t: Tensor) -> Tensor:
    """Smallest non-zero gap between distinct values of each column of ``t`` (n, m); inf if constant."""
    s = torch.sort(t, dim=0).values
    g = s[1:] - s[:-1]
    g = torch.where(g > 0, g, torch.inf)
    return g.amin(dim=0) if g.shape[0] else torch.full((t.shape[1],), torch.inf, dtype=t.dtype, device=t.device)


def lcodec_jitter(t: Tensor, generator: torch.Generator) -> Tensor:
    """L-CODEC noise: each column of ``t`` (n,) or (n, m) plus U(-c, c), c = 0.45 * its smallest gap.

    The noise is drawn from ``generator`` on the generator's device, in column-major order
    (column 0 first), then moved to ``t``'s device.  A constant column has no gap; it gets the
    smallest gap found in the other columns (or 1.0 if all are constant) -- any scale keeps its
    (empty) order, a small one keeps it from dominating distances.
    """
    vec = t.dim() == 1
    m = t.unsqueeze(1) if vec else t
    n, cols = m.shape
    gaps = min_gaps(m)
    finite = torch.isfinite(gaps)
    fallback = gaps[finite].min() if bool(finite.any()) else torch.tensor(1.0, dtype=m.dtype, device=m.device)
    scale = torch.where(finite, gaps, fallback) * JITTER_FRACTION
    u = torch.rand((cols, n), generator=generator, device=generator.device, dtype=m.dtype)
    u = u.to(m.device).t()
    out = m + (2.0 * u - 1.0) * scale
    return out[:, 0] if vec else out


# --------------------------------------------------------------------------------------
# scores
# --------------------------------------------------------------------------------------
def ratio(num: Tensor, den: int) -> Tensor:
    """num / den in float64, correctly rounded on every device.

    (On CUDA, dividing by a Python number multiplies by its reciprocal, which can differ in
    the last bit; a tensor divisor gives true division everywhere.)
    """
    num = num.double()
    return num / torch.full_like(num, float(den))


class Scorer:
    """Everything about (Y, candidate columns) that does not change between FOCI steps."""

    def __init__(self, y: Tensor, z: Tensor, *, block_bytes: int | None = None) -> None:
        self.n = y.shape[0]
        self.r, self.ell = rank_stats(y)
        if int(self.ell.min()) == self.n:
            raise ValueError("y is constant: its dependence on anything is undefined")
        self.cols = SortedColumns.build(z)
        self.block_bytes = block_bytes
        n = self.n
        self.den0 = int((self.ell * (n - self.ell)).sum())
        self.sum_l2 = int((self.ell * self.ell).sum())

    def _kw(self) -> dict:
        return {} if self.block_bytes is None else {"block_bytes": self.block_bytes}

    def numerators_unconditional(self, which: Tensor, chunk: int = 512) -> Tensor:
        """n * sum_i min(R_i, R_M(i)) - sum_i L_i^2 for each candidate (X empty)."""
        out = torch.empty(which.numel(), dtype=torch.int64, device=self.r.device)
        for c0 in range(0, which.numel(), chunk):
            w = which[c0:c0 + chunk]
            v, idx = self.cols.sorted.index_select(0, w), self.cols.perm.index_select(0, w)
            m = nn_1d(v, idx)
            s = torch.minimum(self.r.take(idx), self.r.take(m)).sum(dim=1)
            out[c0:c0 + w.numel()] = self.n * s - self.sum_l2
        return out

    def scores_unconditional(self, which: Tensor) -> Tensor:
        return ratio(self.numerators_unconditional(which), self.den0)

    def _conditional_setup(self, base: BaseSpace) -> tuple[Tensor, Tensor, int]:
        """min(R_i, R_N(i)), the slack R_i - min(R_i, R_N(i)) >= 0 and its sum (the denominator)."""
        rn = torch.minimum(self.r, self.r[base.nearest()])
        slack = self.r - rn
        return rn, slack, int(slack.sum())

    def numerators_conditional(self, base: BaseSpace, which: Tensor, k0: int = 16, zwindow: int = 0
                               ) -> tuple[Tensor, int]:
        """(sum_i [min(R_i,R_M(i)) - min(R_i,R_N(i))] per candidate, the common denominator)."""
        rn, _, den = self._conditional_setup(base)
        m = nn_given_base(base, self.cols, which, k0=k0, zwindow=zwindow, **self._kw())
        num = torch.minimum(self.r.unsqueeze(1), self.r[m]).sum(dim=0) - int(rn.sum())
        return num, den

    def scores_conditional(self, base: BaseSpace, which: Tensor, k0: int = 16, zwindow: int = 0) -> Tensor:
        num, den = self.numerators_conditional(base, which, k0, zwindow)
        if den == 0:
            return torch.zeros(which.numel(), dtype=torch.float64, device=num.device)
        return ratio(num, den)

    def _refine_round(self, base: BaseSpace, which: Tensor, i_p: Tensor, c_p: Tensor, d_p: Tensor,
                      l_p: Tensor, lo: int, hi: int, w: int) -> tuple[Tensor, Tensor, Tensor]:
        """One refinement round for the pairs (i_p, which[c_p]); returns (d, l, done).

        Rows where at least a quarter of the candidates still in play are unresolved (a
        cluster of near-equal X values does this) go through the dense kernel
        (``dense_segment``); the scattered rest through per-pair gathers (``refine_round``).
        Either way X-positions lo..hi-1 are visited, so the same lower bound applies.
        """
        n = base.n
        bb = self.block_bytes or DEFAULT_BLOCK_BYTES
        cand, c_loc = torch.unique(c_p, return_inverse=True)
        cnt = torch.bincount(i_p, minlength=n)
        dense_rows = (cnt * 4 >= max(cand.numel(), 4)) & (hi > lo)
        sel = dense_rows[i_p]
        done = torch.empty_like(sel)
        d_p, l_p = d_p.clone(), l_p.clone()
        if bool(sel.any()):
            rows = dense_rows.nonzero().squeeze(1)
            row_loc = torch.full((n,), -1, dtype=torch.int64, device=i_p.device)
            row_loc[rows] = torch.arange(rows.numel(), device=i_p.device)
            rd, rl = dense_segment(base, self.cols, rows, which[cand], lo, hi, bb)
            i_s, c_s = i_p[sel], c_loc[sel]
            nd, nl = rd[row_loc[i_s], c_s], rl[row_loc[i_s], c_s]
            bd, bl = merge_lex(d_p[sel], l_p[sel], nd, nl)
            d_p[sel], l_p[sel] = bd, bl
            bound = base.a[:, min(hi, n - 1)][i_s] + gap_bound(self.cols, i_s, which[c_p[sel]])
            done[sel] = bd < bound
        rest = ~sel
        if bool(rest.any()):
            d, l, dn = refine_round(base, self.cols, i_p[rest], which[c_p[rest]], d_p[rest], l_p[rest],
                                    lo, hi, w, 16 * bb)
            d_p[rest], l_p[rest], done[rest] = d, l, dn
        return d_p, l_p, done

    def best_conditional(self, base: BaseSpace, which: Tensor, k0: int = 16, zwindow: int = 0
                         ) -> tuple[int | None, int, int]:
        """Exact argmax of T(Y, Z_j | X) over ``which`` among candidates with T > 0.

        Returns (position in ``which`` or None if no candidate has T > 0, its numerator, the
        denominator).  Branch and bound on exact integers.  The dense pass (width ``k0``)
        resolves most pairs (i, j); a candidate's numerator is then bounded above by the sum
        of its exact terms plus, for each unresolved i, the largest possible term
        R_i - min(R_i, R_N(i)) (as min(R_i, R_M(i)) <= R_i).  The unresolved pairs are refined
        round by round (``refine_round``, all candidates batched); between rounds every
        candidate whose bound is <= 0, or cannot beat the best candidate already made exact,
        is dropped with its pairs.  Ties go to the lowest position.  The result equals the
        argmax over the exact scores of all candidates.
        """
        rn, slack, den = self._conditional_setup(base)
        if den == 0:
            return None, 0, 0
        if compiled_ok(base.d):  # CPU: compiled kernels, bounds over rounds of points (same result)
            return best_by_bounds(base, self.cols, which, self.r, rn, slack, k0)
        r = self.r
        dev = r.device
        ncand = which.numel()
        upper = torch.empty(ncand, dtype=torch.int64, device=dev)
        pend = torch.zeros(ncand, dtype=torch.int64, device=dev)  # unresolved pairs left
        ii, cc, dd, ll = [], [], [], []
        for ch in dense_pass(base, self.cols, which, k0, zwindow=zwindow, **self._kw()):
            term = torch.minimum(r.unsqueeze(1), r[ch.best_l]) - rn.unsqueeze(1)
            upper[ch.pos] = torch.where(ch.resolved, term, slack.unsqueeze(1)).sum(dim=0)
            un = ~ch.resolved
            pend[ch.pos] = un.sum(dim=0)
            jj, i = un.t().nonzero(as_tuple=True)  # candidate-major: better locality
            ii.append(i)
            cc.append(ch.pos[jj])
            dd.append(ch.best_d[i, jj])
            ll.append(ch.best_l[i, jj])
        i_p, c_p, d_p, l_p = (torch.cat(t) for t in (ii, cc, dd, ll))
        alive = upper > 0
        best_pos: int | None = None
        best_num = 0
        rounds = iter(schedule(base.n, min(k0, base.n - 1), zwindow))
        while True:
            # candidates with no unresolved pair are exact: update the incumbent
            ex = (alive & (pend == 0)).nonzero().squeeze(1)
            if ex.numel():
                v = upper[ex]
                top = int(v.max())
                if top > 0:
                    p = int(ex[v == top].min())
                    if best_pos is None or top > best_num or (top == best_num and p < best_pos):
                        best_pos, best_num = p, top
            if best_pos is not None:
                idx = torch.arange(ncand, device=dev)
                alive &= (upper > best_num) | ((upper == best_num) & (idx <= best_pos))
            alive &= (pend > 0) & (upper > 0)  # exact ones are settled; T <= 0 is never picked
            if best_pos is not None:
                alive[best_pos] = False
            keep = alive[c_p]
            i_p, c_p, d_p, l_p = i_p[keep], c_p[keep], d_p[keep], l_p[keep]
            if i_p.numel() == 0:
                break
            lo, hi, w = next(rounds)
            d_p, l_p, done = self._refine_round(base, which, i_p, c_p, d_p, l_p, lo, hi, w)
            if bool(done.any()):
                i_d, c_d = i_p[done], c_p[done]
                term = torch.minimum(r[i_d], r[l_p[done]]) - rn[i_d]
                upper.index_add_(0, c_d, term - slack[i_d])
                pend.index_add_(0, c_d, torch.full_like(c_d, -1))
                i_p, c_p, d_p, l_p = i_p[~done], c_p[~done], d_p[~done], l_p[~done]
        return best_pos, best_num, den


def _prepare(y: Any, z: Any, x: Any, generator: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    generator = check_generator(generator)
    yt = as_vector(y, "y")
    zt = as_matrix(z, yt.shape[0], "z", yt.device)
    xt = None if x is None else as_matrix(x, yt.shape[0], "x", yt.device, allow_empty=True)
    if xt is not None and xt.shape[1] == 0:
        xt = None
    dtype = torch.promote_types(yt.dtype, zt.dtype)
    if xt is not None:
        dtype = torch.promote_types(dtype, xt.dtype)
    yt, zt = yt.to(dtype), zt.to(dtype)
    xt = None if xt is None else xt.to(dtype)
    check_not_constant(yt)
    if generator is not None:
        yt = lcodec_jitter(yt, generator)
        zt = lcodec_jitter(zt, generator)
        if xt is not None:
            xt = lcodec_jitter(xt, generator)
    return yt, zt, xt


def codec_scores(y: Any, z: Any, x: Any = None, *, generator: torch.Generator | None = None) -> Tensor:
    """T(Y, Z_j | X) for every column Z_j of ``z`` (n x S), each scored on its own.

    Vectorised over candidates (one batched nearest-neighbour search, see ``_nn``).
    With ``generator`` this is L-CODEC: y, z and x are jittered first (in that order).
    Returns a float64 tensor of shape (S,) on y's device.
    """
    yt, zt, xt = _prepare(y, z, x, generator)
    scorer = Scorer(yt, zt)
    which = torch.arange(zt.shape[1], device=zt.device)
    if xt is None:
        return scorer.scores_unconditional(which)
    base = BaseSpace.from_distances(squared_distances(xt))
    k = xt.shape[1]
    return scorer.scores_conditional(base, which, default_k0(k, xt.shape[0]), default_zwindow(k))


def codec(y: Any, z: Any, x: Any = None, *, generator: torch.Generator | None = None) -> Tensor:
    """T(Y, Z | X) (Azadkia & Chatterjee 2021); L-CODEC when a ``generator`` is given.

    ``y``: (n,) response; ``z``: (n,) or (n, q) -- all q columns form one variable;
    ``x``: None (unconditional T(Y, Z)) or (n,) / (n, k).  Returns a 0-dim float64 tensor.
    Raises ``ValueError`` (naming the argument) for mismatched lengths, n < 2, NaN/inf or a
    constant y.
    """
    yt, zt, xt = _prepare(y, z, x, generator)
    n = yt.shape[0]
    scorer_z = zt[:, -1:]
    lead = zt[:, :-1]
    # M(i): nearest neighbour in (X, Z): base space (X, Z_1..Z_{q-1}), candidate Z_q
    scorer = Scorer(yt, scorer_z)
    which = torch.zeros(1, dtype=torch.int64, device=yt.device)
    if xt is None and lead.shape[1] == 0:
        return scorer.scores_unconditional(which)[0]
    full = lead if xt is None else torch.cat([xt, lead], dim=1)
    base_m = BaseSpace.from_distances(squared_distances(full))
    m = nn_given_base(base_m, scorer.cols, which)[:, 0]
    r = scorer.r
    s_m = torch.minimum(r, r[m]).sum()
    if xt is None:
        return ratio(n * s_m - scorer.sum_l2, scorer.den0)
    base_n = base_m if lead.shape[1] == 0 else BaseSpace.from_distances(squared_distances(xt))
    rn = torch.minimum(r, r[base_n.nearest()])
    den = int((r - rn).sum())
    if den == 0:
        return torch.zeros((), dtype=torch.float64, device=yt.device)
    return ratio(s_m - rn.sum(), den)
