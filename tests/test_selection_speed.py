"""The compiled CPU kernels of L-FOCI (pipeline/selection/_kernels.py) against exact oracles.

Oracle: a brute-force distance matrix per candidate (columns accumulated in order, +inf on the
diagonal, ``argmin`` = lowest index among ties) and the torch path of the same functions
(``UNLEARN_SELECTION_KERNEL=torch``).  Data with heavy ties (rounded values) and mixed scales.
"""
from __future__ import annotations

import pytest
import torch

from pipeline.selection import codec_scores, lcodec_jitter, lfoci
from pipeline.selection import _kernels
from pipeline.selection._nn import (
    BaseSpace,
    SortedColumns,
    best_by_bounds,
    compiled_ok,
    nn_1d,
    nn_given_base,
    squared_distances,
)
from pipeline.selection.codec import Scorer, rank_stats

pytestmark = pytest.mark.skipif(not _kernels.HAVE_NUMBA, reason="numba not installed")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def brute_nn(w: torch.Tensor) -> torch.Tensor:
    """Nearest neighbour of each row of w (n, q): squared distances summed column by column."""
    n = w.shape[0]
    d = torch.zeros((n, n), dtype=w.dtype)
    for c in range(w.shape[1]):
        d += (w[:, c, None] - w[None, :, c]) ** 2
    d.fill_diagonal_(float("inf"))
    return d.argmin(dim=1)


def data(seed: int, n: int, s: int, k: int, ties: bool, dtype=torch.float64):
    g = gen(seed)
    scale = torch.logspace(-1.5, 1.5, s, dtype=dtype)
    z = torch.randn(n, s, generator=g, dtype=dtype) * scale
    x = torch.randn(n, k, generator=g, dtype=dtype)
    if ties:  # about 10 distinct values per column: ties in distances and in ranks
        z, x = (z / scale).round() * scale, x.round()
    return z, x


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("with_x", [True, False])
def test_compiled_nn_equals_bruteforce(k: int, ties: bool, with_x: bool) -> None:
    z, x = data(100 + k + 10 * ties, 300, 12, k, ties)
    base = BaseSpace.from_distances(squared_distances(x), x if with_x else None)
    cols = SortedColumns.build(z)
    assert compiled_ok(base.d)
    got = nn_given_base(base, cols, torch.arange(z.shape[1]))
    for j in range(z.shape[1]):
        want = brute_nn(torch.cat([x, z[:, j:j + 1]], dim=1))
        assert torch.equal(got[:, j], want), f"candidate {j}"


def test_compiled_nn_float32() -> None:
    z, x = data(7, 250, 8, 2, False, torch.float32)
    base = BaseSpace.from_distances(squared_distances(x), x)
    got = nn_given_base(base, SortedColumns.build(z), torch.arange(8))
    for j in range(8):
        assert torch.equal(got[:, j], brute_nn(torch.cat([x, z[:, j:j + 1]], dim=1)))


@pytest.mark.parametrize("ties", [False, True])
def test_compiled_nn_1d_equals_torch_and_bruteforce(ties: bool, monkeypatch) -> None:
    z, _ = data(3 + ties, 400, 10, 1, ties)
    cols = SortedColumns.build(z)
    got = nn_1d(cols.sorted, cols.perm)
    monkeypatch.setenv("UNLEARN_SELECTION_KERNEL", "torch")
    assert torch.equal(got, nn_1d(cols.sorted, cols.perm))
    for j in range(z.shape[1]):
        m = torch.empty(z.shape[0], dtype=torch.int64)
        m[cols.perm[j]] = got[j]
        assert torch.equal(m, brute_nn(z[:, j:j + 1]))


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("ties", [False, True])
def test_scores_equal_torch_path(k: int, ties: bool, monkeypatch) -> None:
    z, x = data(40 + k + ties, 260, 20, max(k, 1), ties)
    x = x if k else None
    y = z[:, 4] / z[:, 4].std() + torch.randn(z.shape[0], generator=gen(1), dtype=z.dtype)
    if ties:
        y = y.round()
    fast = codec_scores(y, z, x)
    monkeypatch.setenv("UNLEARN_SELECTION_KERNEL", "torch")
    slow = codec_scores(y, z, x)
    assert torch.equal(fast, slow)
    assert float(fast.abs().max()) > 0.05  # not a degenerate all-zero comparison


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_bounds_argmax_equals_exact_scores(seed: int) -> None:
    """best_by_bounds (rounds of points, pruning) = argmax of the exact conditional scores."""
    z, x = data(seed, 300, 60, 2, seed % 2 == 1)
    y = x[:, 0] * z[:, 7] / z[:, 7].std() + 0.5 * torch.randn(300, generator=gen(seed), dtype=z.dtype)
    if seed % 2:
        y = y.round(decimals=1)
    y, z, x = lcodec_jitter(y, gen(50 + seed)), lcodec_jitter(z, gen(60 + seed)), lcodec_jitter(x, gen(70 + seed))
    scorer = Scorer(y, z)
    base = BaseSpace.from_distances(squared_distances(x), x)
    which = torch.arange(z.shape[1])
    rn = torch.minimum(scorer.r, scorer.r[base.nearest()])
    slack = scorer.r - rn
    pos, num, den = best_by_bounds(base, scorer.cols, which, scorer.r, rn, slack, 16)
    exact = codec_scores(y, z, x)
    assert den == int(slack.sum())
    best = int(torch.argmax(exact))  # first maximum = lowest position
    if float(exact[best]) > 0:
        assert pos == best and num / den == float(exact[best])
    else:
        assert pos is None


@pytest.mark.parametrize("seed", [0, 1])
def test_lfoci_compiled_equals_torch_path(seed: int, monkeypatch) -> None:
    g = gen(seed)
    n, s = 400, 40
    z = torch.randn(n, s, generator=g, dtype=torch.float64) @ torch.randn(s, s, generator=g, dtype=torch.float64)
    z[:, ::3] = torch.relu(z[:, ::3])  # exact zeros: ties until the jitter breaks them
    z = z * torch.exp(torch.randn(s, generator=g, dtype=torch.float64))
    y = z[:, 0] + torch.relu(z[:, 3]) * z[:, 5] / z[:, 5].std() + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    fast = lfoci(y, z, generator=gen(9 + seed))
    monkeypatch.setenv("UNLEARN_SELECTION_KERNEL", "torch")
    slow = lfoci(y, z, generator=gen(9 + seed))
    assert fast.picks == slow.picks and fast.scores == slow.scores
    assert len(fast.picks) >= 2


def test_ranks_and_kernel_switch(monkeypatch) -> None:
    y = torch.tensor([3.0, 1.0, 3.0, 2.0])
    r, ell = rank_stats(y)
    assert r.tolist() == [4, 1, 4, 2] and ell.tolist() == [2, 4, 2, 3]
    assert compiled_ok(y)
    monkeypatch.setenv("UNLEARN_SELECTION_KERNEL", "torch")
    assert not compiled_ok(y)
