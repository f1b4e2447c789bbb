"""The torch kernel of L-FOCI / L-CODEC (the CUDA path) against the compiled CPU (numba) kernel.

Reference: the numba kernel on the CPU, float64 (itself checked against brute force in
test_selection_speed.py).  Checked: the torch kernel (``UNLEARN_SELECTION_KERNEL=torch`` on the
CPU; the only kernel on CUDA) on each device in DEVICES -- the CPU always, CUDA where a GPU is
present.  Both are exact, so picks and scores must be equal bit for bit, ties included:

* the 300 x 300 check of bench/bench_selection.py (its data, its L-CODEC jitter), and the
  bench's per-candidate loop on it -- the loop once ran on unstandardised columns while
  ``lfoci`` standardises, which is what a CUDA run reported as a device mismatch;
* integer-valued columns with exact duplicates and an integer y (ties in ranks, distances and
  scores), with and without the L-CODEC jitter (a CPU generator, so the noise is the same on
  every device), float64 and float32;
* the standardised columns themselves (their means and deviations are reductions, whose
  rounding differs between devices unless taken in one place).
"""
from __future__ import annotations

import pytest
import torch

from bench.bench_selection import loop_foci
from bench.selection_parity_check import bench_case, tie_case
from pipeline.selection import codec_scores, lfoci
from pipeline.selection import _kernels
from pipeline.selection.foci import standardize_columns

pytestmark = pytest.mark.skipif(not _kernels.HAVE_NUMBA, reason="numba not installed: no CPU kernel to compare with")

NO_CUDA = "no CUDA device: the torch kernel on the GPU is compared with the CPU numba kernel only where torch.cuda.is_available()"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gen(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def on_kernel(monkeypatch, kernel: str, fn, *args, **kwargs):
    """``fn`` with the selection kernel switch set (numba: the compiled CPU path)."""
    monkeypatch.setenv("UNLEARN_SELECTION_KERNEL", kernel)
    return fn(*args, **kwargs)


def lfoci_pair(monkeypatch, device: str, y: torch.Tensor, z: torch.Tensor, seed: int | None = None, **kw):
    """(numba on the CPU, torch kernel on ``device``) for the same inputs and L-CODEC seed."""
    ref = on_kernel(monkeypatch, "numba", lfoci, y, z, generator=gen(seed), **kw)
    got = on_kernel(monkeypatch, "torch", lfoci, y.to(device), z.to(device), generator=gen(seed), **kw)
    return ref, got


@pytest.mark.parametrize("device", DEVICES)
def test_torch_kernel_equals_numba_on_bench_check(device: str, monkeypatch) -> None:
    y, z = bench_case(0, torch.float64)
    ref, got = lfoci_pair(monkeypatch, device, y, z)
    assert ref.picks[:3] == [134, 117, 193]  # the bench's three relevant slices
    assert got.picks == ref.picks, (got, ref)
    assert got.scores == ref.scores, (got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_bench_loop_equals_lfoci_on_bench_check(device: str, monkeypatch) -> None:
    """The bench's own check: its per-candidate loop (exact distances, lfoci's standardised
    columns) on the device gives the numba kernel's picks and scores."""
    y, z = bench_case(0, torch.float64)
    ref = on_kernel(monkeypatch, "numba", lfoci, y, z, max_picks=3)
    zd = z.to(device)
    picks, scores = loop_foci(y.to(device), standardize_columns(zd), 3)
    assert picks == ref.picks and scores == ref.scores
    assert ref.scores[1] == pytest.approx(0.5647831314158883, abs=1e-15)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [None, 7], ids=["no-jitter", "lcodec"])
@pytest.mark.parametrize("standardize", [True, False], ids=["std", "raw"])
def test_torch_kernel_equals_numba_with_ties(device: str, seed: int | None, standardize: bool, monkeypatch) -> None:
    y, z = tie_case(0, torch.float64)
    ref, got = lfoci_pair(monkeypatch, device, y, z, seed, standardize=standardize)
    assert len(ref.picks) >= 2
    assert got.picks == ref.picks and got.scores == ref.scores, (got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_kernel_equals_numba_with_ties_float32(device: str, monkeypatch) -> None:
    y, z = tie_case(1, torch.float32, n=200, s=24)
    z = z * torch.logspace(-1, 1, z.shape[1])  # mixed scales
    for seed in (None, 3):
        ref, got = lfoci_pair(monkeypatch, device, y, z, seed)
        assert got.picks == ref.picks and got.scores == ref.scores, (seed, got, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("seed", [None, 11], ids=["no-jitter", "lcodec"])
def test_codec_scores_torch_kernel_equals_numba_with_ties(device: str, k: int, seed: int | None, monkeypatch) -> None:
    y, z = tie_case(2, torch.float64, n=220, s=30)
    x = z[:, 30 - k:] if k else None
    z = z[:, :30 - k]
    ref = on_kernel(monkeypatch, "numba", codec_scores, y, z, x, generator=gen(seed))
    xd = None if x is None else x.to(device)
    got = on_kernel(monkeypatch, "torch", codec_scores, y.to(device), z.to(device), xd, generator=gen(seed))
    assert torch.equal(got.cpu(), ref)
    assert float(ref.abs().max()) > 0.05  # not a degenerate all-zero comparison


@pytest.mark.parametrize("device", DEVICES)
def test_standardized_columns_same_bits_on_every_device_and_layout(device: str) -> None:
    _, z = bench_case(0, torch.float64)
    want = standardize_columns(z)
    assert torch.equal(standardize_columns(z.to(device)).cpu(), want)
    # a transposed layout reduces in another order unless copied first: the same bits
    zt = z.t().contiguous().t().to(device)
    assert torch.equal(standardize_columns(zt).cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_bench_reports_identical_picks_with_torch_kernel(device: str, tmp_path, monkeypatch) -> None:
    """``python -m bench.bench_selection --device D --kernel torch`` on its 300 x 300 check (a
    tiny full-size problem): identical picks and scores to its loop, sampled scores exact."""
    import json

    from bench.bench_selection import main

    monkeypatch.setenv("UNLEARN_SELECTION_KERNEL", "numba")  # restored after the bench sets it
    out = tmp_path / "selection.json"
    threads = torch.get_num_threads()
    try:
        main(["--device", device, "--kernel", "torch", "--threads", "1", "--n", "80", "--s", "12",
              "--max-picks", "3", "--loop-sample", "6", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the bench's --threads 1 holds for its run only
    res = json.loads(out.read_text())
    small = res["identical_picks_small_problem"]
    assert small["identical"], small
    assert small["picks_loop"] == small["picks_vectorised"] == [134, 117, 193]
    assert res["kernel"] == "torch" and res["identical"]
