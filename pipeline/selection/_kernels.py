"""Compiled (numba) nearest-neighbour kernels for CODEC on the CPU, one thread.

The same searches as the torch code in ``_nn`` and the same answers, bit for bit: squared
Euclidean distances computed with the same floating-point operations in the same order
(``D_X(i, l) + (z_i - z_l)^2``, no fused multiply-add), ties to the LOWEST sample index.

``nn_1d_sorted`` (X empty): in a sorted column the distances from position q grow (weakly)
outwards, so the nearest neighbours of q are found by walking left and right from q while the
distance equals the smallest one seen (a run of equal values costs its length).

``_walk`` (X given by its distance matrix D_X, each row sorted): for a point i and a
candidate column z, walk two orders at once -- i's X-neighbours by increasing D_X and the
column's sorted order outwards from z_i -- stepping the walk whose lower bound grows more
with its next step (greedy; on probe-like data about 8-17 points per search for |X| = 1..5,
against 60-190 when stepping the smaller bound).  Every point not visited by either walk has
D_X(i, l) >= A (next X-distance) and (z_i - z_l)^2 >= B (next squared gap in the column), so,
floating-point addition being monotone, its distance is >= fl(A + B); the search stops once
that exceeds the best distance found (equality continues: a lower index could tie).  D_X(i, l)
of a point met on the column walk is recomputed from the k columns of X (cache-resident) when
they are given, rather than read from the n x n matrix.

``exact_chunk`` (all points x a block of candidates) and ``exact_rows`` (some points x a block
of candidates) first score every pair against the K0 nearest X-neighbours with a loop over
candidates (SIMD), then finish the pairs that this does not settle with ``_walk``.  Nothing of
size n x n x S is formed.
"""
from __future__ import annotations

import numpy as np

try:  # numba is a declared dependency; the torch path in ``_nn`` stays usable without it
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    HAVE_NUMBA = False

    def njit(*args, **kwargs):  # type: ignore[no-redef]
        def wrap(f):
            return f

        return wrap(args[0]) if args and callable(args[0]) else wrap


@njit(cache=True, nogil=True)
def nn_1d_sorted(v, idx, out):  # pragma: no cover - compiled
    """``v`` (C, n) rows sorted ascending, ``idx`` (C, n) sample index of each entry.

    Writes ``out[c, q]``: sample index of the nearest neighbour (lowest index among ties) of
    the point at sorted position q of row c, distances (v_q - v_l)^2.
    """
    c_n, n = v.shape
    for c in range(c_n):
        for q in range(n):
            vq = v[c, q]
            # smallest distance: one of the two adjacent entries (distances grow outwards)
            best = np.inf
            if q > 0:
                dz = vq - v[c, q - 1]
                best = dz * dz
            if q + 1 < n:
                dz = v[c, q + 1] - vq
                dr = dz * dz
                if dr < best:
                    best = dr
            bl = n + idx.shape[1]  # larger than any index
            p = q - 1
            while p >= 0:
                dz = vq - v[c, p]
                if dz * dz != best:
                    break
                if idx[c, p] < bl:
                    bl = idx[c, p]
                p -= 1
            p = q + 1
            while p < n:
                dz = v[c, p] - vq
                if dz * dz != best:
                    break
                if idx[c, p] < bl:
                    bl = idx[c, p]
                p += 1
            out[c, q] = bl


@njit(cache=True, nogil=True, inline="always")
def _dx(x, d, use_x, i, l):  # pragma: no cover - compiled
    """D_X(i, l): from the columns of X, summed in column order as ``squared_distances`` does
    (bit-identical), or read from the matrix."""
    if not use_x:
        return d[i, l]
    s = x[i, 0] - x[l, 0]
    s = s * s
    for c in range(1, x.shape[1]):
        t = x[i, c] - x[l, c]
        s = s + t * t
    return s


@njit(cache=True, nogil=True, inline="always")
def _at_row(a_rows, a_full, r, i, t, inf):  # pragma: no cover - compiled
    """a[i, t] from the per-row copy (row r) while t is inside it, else from the full array."""
    if t < a_rows.shape[1]:
        return a_rows[r, t]
    if t < a_full.shape[1]:
        return a_full[i, t]
    return inf


@njit(cache=True, nogil=True, inline="always")
def _walk(x, d, use_x, a_rows, o_rows, r, a_full, o_full, i, zv, srt, perm, zi, t, lq, rq, bd, bl,
          inf):  # pragma: no cover - compiled
    """The two walks for point i and one candidate, from X-position ``t`` and sorted positions
    ``lq`` (leftwards) / ``rq`` (rightwards), given the best (bd, bl) over what was visited.

    ``zv``: the candidate's values by sample; ``srt``/``perm``: its sorted values and their
    samples; ``a_rows``/``o_rows`` row r: the first columns of i's sorted D_X row and order
    (``a_full``/``o_full`` beyond).  Steps the walk whose bound grows more (greedy on the next
    increment) until fl(A + B) > bd; returns the exact (bd, bl), ties to the lowest index.
    """
    n = a_full.shape[0]
    ttop = o_rows.shape[1]
    aa = _at_row(a_rows, a_full, r, i, t, inf)
    if lq >= 0:
        dz = zi - srt[lq]
        bl_z = dz * dz
    else:
        bl_z = inf
    if rq < n:
        dz = srt[rq] - zi
        br_z = dz * dz
    else:
        br_z = inf
    while True:
        canx = t < n
        canl = lq >= 0
        canr = rq < n
        if not (canx or canl or canr):
            break
        left = canl and (bl_z <= br_z or not canr)
        bz = bl_z if left else br_z
        if aa + bz > bd:
            break
        if not canx:
            usex = False
        elif not (canl or canr):
            usex = True
        else:
            a_next = _at_row(a_rows, a_full, r, i, t + 1, inf)
            if left:
                nb = br_z
                if lq >= 1:
                    dz = zi - srt[lq - 1]
                    if dz * dz < nb:
                        nb = dz * dz
            else:
                nb = bl_z
                if rq + 1 < n:
                    dz = srt[rq + 1] - zi
                    if dz * dz < nb:
                        nb = dz * dz
            usex = (a_next - aa) >= (nb - bz)
        if usex:
            l = o_rows[r, t] if t < ttop else o_full[i, t]
            dist = aa
            t += 1
            aa = _at_row(a_rows, a_full, r, i, t, inf)
            if l == i:
                continue
            dz = zi - zv[l]
            dist = dist + dz * dz
        elif left:
            l = perm[lq]
            dist = _dx(x, d, use_x, i, l) + bl_z
            lq -= 1
            if lq >= 0:
                dz = zi - srt[lq]
                bl_z = dz * dz
            else:
                bl_z = inf
        else:
            l = perm[rq]
            dist = _dx(x, d, use_x, i, l) + br_z
            rq += 1
            if rq < n:
                dz = srt[rq] - zi
                br_z = dz * dz
            else:
                br_z = inf
        if dist < bd or (dist == bd and l < bl):
            bd = dist
            bl = l
    return bd, bl


@njit(cache=True, nogil=True)
def dense_top(zc, top, a_top, out_d, out_l):  # pragma: no cover - compiled
    """Every point i against its K0 X-neighbours ``top[i]`` (sorted by sample index), for all
    candidate columns of ``zc`` (n, C) at once: the lexicographic minimum of
    a_top[i, t] + (zc[l, c] - zc[i, c])^2 over t (first minimum = lowest index), written to
    ``out_d``/``out_l`` (n, C).  The inner loop runs over candidates (SIMD-friendly)."""
    n, n_c = zc.shape
    k0 = top.shape[1]
    for i in range(n):
        bd = out_d[i]
        bl = out_l[i]
        zi = zc[i]
        l = top[i, 0]
        av = a_top[i, 0]
        zl = zc[l]
        for c in range(n_c):
            dz = zl[c] - zi[c]
            bd[c] = av + dz * dz
            bl[c] = l
        for t in range(1, k0):
            l = top[i, t]
            av = a_top[i, t]
            zl = zc[l]
            for c in range(n_c):
                dz = zl[c] - zi[c]
                dist = av + dz * dz
                better = dist < bd[c]
                bd[c] = dist if better else bd[c]
                bl[c] = l if better else bl[c]


@njit(cache=True, nogil=True)
def exact_chunk(x, d, use_x, top, a_sel, a_top, o_top, a_full, o_full, zc, srt, perm, pos, which, w,
                big, out_d, out_l, xs, bdq, blq):  # pragma: no cover - compiled
    """Exact nearest neighbour in (X, z_c) of every point for the candidate columns ``zc``
    (n, C) (= values[which].T), in three passes:

    1. ``dense_top``: i against its K0 X-neighbours ``top[i]`` (sorted by index; ``a_sel`` their
       D_X), SIMD over candidates;
    2. a window of ``w`` sorted neighbours on each side in each candidate's column (shifted
       pairs in the sorted layout: one distance serves both points of a pair);
    3. for the pairs not yet proved exact -- best >= fl(a[i, K0] + B), B the squared gap to
       the first sorted neighbour outside the window -- the two walks of ``_walk``
       continued from X-position K0 and from the window's edges.
    ``xs`` (n, k), ``bdq`` (n,), ``blq`` (n,) are scratch.  Writes out_d / out_l (n, C).
    """
    n, n_c = zc.shape
    inf = big[0]
    k0 = top.shape[1]
    kx = x.shape[1]
    dense_top(zc, top, a_sel, out_d, out_l)
    for c in range(n_c):
        j = which[c]
        # --- 2: the z-window, in the sorted layout ------------------------------------------
        if w > 0:
            if use_x:
                for q in range(n):
                    l = perm[j, q]
                    for cc in range(kx):
                        xs[q, cc] = x[l, cc]
            for q in range(n):
                bdq[q] = inf
                blq[q] = n
            for o in range(1, min(w, n - 1) + 1):
                for q in range(n - o):
                    i1 = perm[j, q]
                    i2 = perm[j, q + o]
                    if use_x:
                        s = xs[q, 0] - xs[q + o, 0]
                        s = s * s
                        for cc in range(1, kx):
                            t2 = xs[q, cc] - xs[q + o, cc]
                            s = s + t2 * t2
                    else:
                        s = d[i1, i2]
                    dz = srt[j, q] - srt[j, q + o]
                    dist = s + dz * dz
                    if dist < bdq[q] or (dist == bdq[q] and i2 < blq[q]):
                        bdq[q] = dist
                        blq[q] = i2
                    if dist < bdq[q + o] or (dist == bdq[q + o] and i1 < blq[q + o]):
                        bdq[q + o] = dist
                        blq[q + o] = i1
        # --- merge, bound, finish ---------------------------------------------------------------
        for i in range(n):  # sample order: sequential rows of a_top / out_d
            q = pos[j, i]
            bd = out_d[i, c]
            bl = out_l[i, c]
            if w > 0:
                if bdq[q] < bd or (bdq[q] == bd and blq[q] < bl):
                    bd = bdq[q]
                    bl = blq[q]
            bd, bl = _walk(x, d, use_x, a_top, o_top, i, a_full, o_full, i, zc[:, c], srt[j], perm[j],
                           srt[j, q], k0, q - w - 1, q + w + 1, bd, bl, inf)
            out_d[i, c] = bd
            out_l[i, c] = bl


@njit(cache=True, nogil=True)
def exact_rows(x, d, use_x, rows, top, a_sel, a_top, o_top, a_full, o_full, zc, values, srt, perm, pos, which,
               big, out_l):  # pragma: no cover - compiled
    """Exact nearest neighbour in (X, z_j) for the points ``rows`` and candidates ``which``.

    ``zc`` (n, C): the candidates' columns (values[which].T), for the first pass over the K0
    X-neighbours (``top``: (|rows|, K0) sorted by index, ``a_sel`` their D_X), SIMD over
    candidates; then, candidate by candidate, the two walks of ``_walk`` for the pairs
    not settled by the bound a[i, K0], continued from X-position K0 and from the point's sorted
    neighbours.  ``a_top``/``o_top`` (|rows|, T): the first T columns of a/order for these rows
    (in row order: the walk reads them sequentially).  Writes ``out_l[r, c]`` (|rows|, C).
    """
    n = d.shape[0]
    inf = big[0]
    k0 = top.shape[1]
    n_r = rows.shape[0]
    n_c = which.shape[0]
    bdm = np.empty((n_r, n_c), dtype=zc.dtype)
    blm = np.empty((n_r, n_c), dtype=np.int64)
    a_k0 = np.empty(n_r, dtype=zc.dtype)
    for r in range(n_r):  # pass 1: K0 X-neighbours, SIMD over candidates
        i = rows[r]
        a_k0[r] = _at_row(a_top, a_full, r, i, k0, inf)
        zr = zc[i]
        bdv = bdm[r]
        blv = blm[r]
        l = top[r, 0]
        av = a_sel[r, 0]
        zl = zc[l]
        for c in range(n_c):
            dz = zl[c] - zr[c]
            bdv[c] = av + dz * dz
            blv[c] = l
        for t in range(1, k0):
            l = top[r, t]
            av = a_sel[r, t]
            zl = zc[l]
            for c in range(n_c):  # branch-free select: vectorises
                dz = zl[c] - zr[c]
                dist = av + dz * dz
                better = dist < bdv[c]
                bdv[c] = dist if better else bdv[c]
                blv[c] = l if better else blv[c]
    for c in range(n_c):  # pass 2: candidate by candidate (its sorted column stays in cache)
        j = which[c]
        for r in range(n_r):
            bd = bdm[r, c]
            bl = blm[r, c]
            if bd < a_k0[r]:  # every point beyond the K0 X-neighbours is farther
                out_l[r, c] = bl
                continue
            i = rows[r]
            p = pos[j, i]
            bd, bl = _walk(x, d, use_x, a_top, o_top, r, a_full, o_full, i, values[j], srt[j], perm[j],
                           values[j, i], k0, p - 1, p + 1, bd, bl, inf)
            out_l[r, c] = bl
