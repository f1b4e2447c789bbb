"""L-FOCI parity check: the torch kernel on a device against the compiled CPU (numba) kernel.

    python bench/selection_parity_check.py --device cuda [--dtype float64] [--seed 0]
    python -m bench.selection_parity_check --device cpu        (the torch kernel on the CPU)

Cases (each ``lfoci`` with its defaults: standardised columns, picks until T <= 0):

* ``bench_300x300``: the small check of ``bench.bench_selection`` (``make_data(300, 300,
  seed + 1)``, L-CODEC jitter from a CPU generator seeded ``seed``), plus the bench's
  per-candidate loop on the same device (exact squared distances, standardised columns);
* ``ties``: integer-valued columns (values 0..3, and 0/1 columns), exact duplicate columns and
  an integer y: ties in ranks, in distances and between candidates, no jitter (the
  lowest-index rules decide);
* ``ties_lcodec``: the same data with L-CODEC (``generator``: a seeded CPU generator, so the
  noise is the same on every device).

The reference always runs on the CPU with the numba kernel (the torch kernel where numba is
missing: said in the output).  The checked run puts y and z on ``--device`` and takes the
torch kernel (``UNLEARN_SELECTION_KERNEL=torch``; CUDA has no other).  Prints one JSON line
with the picks and scores of both for each case and whether they match (same picks, scores
within 1e-12; the kernels are exact, so they are expected bit-identical), and exits 1 on a
mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.bench_selection import loop_foci, make_data  # noqa: E402
from pipeline.selection import FociResult, lcodec_jitter, lfoci  # noqa: E402
from pipeline.selection import _kernels  # noqa: E402
from pipeline.selection.foci import standardize_columns  # noqa: E402

SCORE_TOL = 1e-12


def bench_case(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The bench's 300 x 300 check, built exactly as ``bench_selection.run`` builds it."""
    y, z, _ = make_data(300, 300, seed + 1, dtype)
    g = torch.Generator().manual_seed(seed)
    return lcodec_jitter(y, g), lcodec_jitter(z, g)


def tie_case(seed: int, dtype: torch.dtype, n: int = 240, s: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer-valued columns with duplicates and an integer y that depends on three of them."""
    g = torch.Generator().manual_seed(1000 + seed)
    z = torch.randint(0, 4, (n, s), generator=g).to(dtype)
    z[:, 1::4] = (z[:, 1::4] > 1).to(dtype)  # 0/1 columns
    z[:, 5] = z[:, 0]  # exact duplicates of columns that y depends on
    z[:, 9] = z[:, 2]
    z[:, 13] = z[:, 7]
    y = (z[:, 0] + z[:, 2] * z[:, 3] + torch.randint(0, 2, (n,), generator=g).to(dtype)).to(dtype)
    return y, z


def run_lfoci(y: torch.Tensor, z: torch.Tensor, kernel: str, generator_seed: int | None) -> FociResult:
    before = os.environ.get("UNLEARN_SELECTION_KERNEL")
    os.environ["UNLEARN_SELECTION_KERNEL"] = kernel
    try:
        g = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
        return lfoci(y, z, generator=g)
    finally:
        if before is None:
            os.environ.pop("UNLEARN_SELECTION_KERNEL", None)
        else:
            os.environ["UNLEARN_SELECTION_KERNEL"] = before


def compare(name: str, y: torch.Tensor, z: torch.Tensor, device: torch.device, ref_kernel: str,
            generator_seed: int | None = None, with_loop: bool = False) -> dict:
    ref = run_lfoci(y, z, ref_kernel, generator_seed)
    got = run_lfoci(y.to(device), z.to(device), "torch", generator_seed)
    diff = max((abs(a - b) for a, b in zip(ref.scores, got.scores)), default=0.0)
    same_picks = ref.picks == got.picks
    out = {
        "case": name, "n": int(z.shape[0]), "s": int(z.shape[1]),
        "lcodec_generator_seed": generator_seed,
        "picks_" + ref_kernel + "_cpu": ref.picks, "scores_" + ref_kernel + "_cpu": ref.scores,
        "picks_torch_" + device.type: got.picks, "scores_torch_" + device.type: got.scores,
        "max_abs_score_diff": diff if same_picks else None,
        "bit_identical": same_picks and ref.scores == got.scores,
        "match": same_picks and diff <= SCORE_TOL,
    }
    if with_loop:  # the bench's per-candidate loop, on the device, on lfoci's columns
        zd = z.to(device)
        loop_picks, loop_scores = loop_foci(y.to(device), standardize_columns(zd), None)
        out["picks_loop_" + device.type] = loop_picks
        out["scores_loop_" + device.type] = loop_scores
        out["loop_match"] = loop_picks == ref.picks and all(
            abs(a - b) <= SCORE_TOL for a, b in zip(loop_scores, ref.scores))
        out["match"] = out["match"] and out["loop_match"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="device of the torch kernel (cuda, cuda:1, cpu)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="CPU torch threads (0: torch default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "CUDA is not available", "device": args.device}))
        return 2
    dtype = getattr(torch, args.dtype)
    ref_kernel = "numba" if _kernels.HAVE_NUMBA else "torch"

    cases = []
    y, z = bench_case(args.seed, dtype)
    cases.append(compare("bench_300x300", y, z, device, ref_kernel, with_loop=True))
    y, z = tie_case(args.seed, dtype)
    cases.append(compare("ties", y, z, device, ref_kernel))
    cases.append(compare("ties_lcodec", y, z, device, ref_kernel, generator_seed=args.seed + 7))
    # the standardised columns themselves: the same bits on the device as on the CPU
    zb = bench_case(args.seed, dtype)[1]
    std_same = bool(torch.equal(standardize_columns(zb), standardize_columns(zb.to(device)).cpu()))

    ok = all(c["match"] for c in cases) and std_same
    report = {
        "check": "L-FOCI torch kernel on the device vs the CPU " + ref_kernel + " kernel",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype, "seed": args.seed, "torch": torch.__version__,
        "reference_kernel": ref_kernel,
        "standardized_columns_bit_identical": std_same,
        "cases": cases,
        "match": ok,
    }
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
