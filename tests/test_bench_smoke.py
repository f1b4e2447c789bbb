"""Smoke runs of the benchmark scripts: each runs end to end at tiny sizes (``--smoke``) and
writes valid JSON (atomically; no NaN) with the keys the summary and the README rely on; then
``bench.run_all`` builds summary.md from those files. One module-scoped run of each script
(in this process, to share the interpreter start-up and torch.func's first-call cost; so the
whole module stays well under a minute on 2 cores - with one torch thread: on a shared, loaded
machine two intra-op threads made these tiny runs 5x slower); the outputs go to a temporary
folder, never to bench/results."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch


def _run(main, argv: list[str]) -> None:
    """A benchmark's main in this process; its --threads 1 holds for the run only."""
    threads = torch.get_num_threads()
    try:
        main(argv)
    finally:
        torch.set_num_threads(threads)


def _load(path: Path) -> dict:
    text = path.read_text()
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"{path.name} contains {c}"))
    assert not list(path.parent.glob(f".{path.name}.*")), "a temporary file was left behind"
    return data


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def fmnist(out_dir: Path) -> dict:
    from bench import bench_fmnist

    _run(bench_fmnist.main, ["--smoke", "--threads", "1", "--out", str(out_dir / "fmnist_smoke.json"), "--workdir", str(out_dir / "fmnist")])
    return _load(out_dir / "fmnist_smoke.json")


@pytest.fixture(scope="module")
def growth(out_dir: Path) -> dict:
    from bench import bench_growth

    _run(bench_growth.main, ["--smoke", "--threads", "1", "--out", str(out_dir / "growth_smoke.json"), "--workdir", str(out_dir / "growth")])
    return _load(out_dir / "growth_smoke.json")


@pytest.fixture(scope="module")
def huge(out_dir: Path) -> dict:
    from bench import bench_huge_layers

    _run(bench_huge_layers.main, ["--smoke", "--threads", "1", "--out", str(out_dir / "huge_layers_smoke.json")])
    return _load(out_dir / "huge_layers_smoke.json")


@pytest.fixture(scope="module")
def gpu(out_dir: Path) -> dict:
    from bench import bench_gpu_reid

    _run(bench_gpu_reid.main, ["--smoke", "--threads", "1", "--out", str(out_dir / "gpu_reid_smoke.json")])
    return _load(out_dir / "gpu_reid_smoke.json")


# the stages lfoci-newton reports (pipeline/methods/block_choice.py, lfoci_newton.py) when its
# block is chosen by L-FOCI
LFOCI_STAGES = {"probe", "selection", "gradients", "curvature_and_solve", "verify"}


def _solved(record: dict, settings: dict) -> None:
    """Every Newton system of the removal solved by CG to the stated tolerance, within the cap."""
    solvers = record["curvature"]["solvers"]
    assert solvers and len(solvers) == record["newton"]["steps"]
    for info in solvers:
        assert info["solver"] == "cg" and info["converged"], info
        assert info["relative_residual"] <= settings["cg_rtol"] == info["tolerance"], info
        assert 1 <= info["iterations"] <= settings["cg_max_iter"], info
    # the method's min_gradient_reduction (default 0.5), met by the published step
    assert record["gradient_share"]["retained_removed"] >= settings.get("min_gradient_reduction", 0.5)


def _machine(d: dict) -> None:
    assert d["machine"]["cpus"] >= 1
    assert len(d["machine"]["loadavg"]) == 3 and d["machine"]["loadavg_after"]
    assert d["wall_seconds"] > 0


def test_fmnist_smoke(fmnist: dict) -> None:
    from bench.bench_fmnist import LINEAR_HEAD_ONLY
    from pipeline.methods import METHODS

    assert fmnist["benchmark"] == "fmnist" and fmnist["mode"] == "smoke"
    assert set(fmnist["scenarios"]) == {"random_1pct", "class_1"}
    for name, sc in fmnist["scenarios"].items():
        rows = sc["rows"]
        assert {"original", "retrain", "finetune"} <= set(rows)
        assert not sc["errors"], (name, sc["errors"])  # a method that raised fails the smoke run
        for method, why in sc["needs_retrain"].items():  # the method's own refusal (RemovalNotServed), with its reason
            assert method == "lfoci-newton" and method not in rows and (
                "retained gradient" in why or "trust region" in why), (name, why)
        for method in METHODS:  # every registered method that applies ran and has its row (or its refusal)
            if method in LINEAR_HEAD_ONLY:
                continue
            if method == "mixed-linear":
                assert "mixed_linear" in sc, name
            else:
                assert method in rows or method in sc["needs_retrain"], (name, method)
        for row in rows.values():
            for key in ("UA", "RA", "TA", "MIA", "AvgGap", "seconds"):
                assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (name, key)
        assert rows["retrain"]["AvgGap"] == 0.0 and rows["retrain"]["seconds"] > 0
        if "lfoci-newton" in rows:
            assert sc["ratio_retrain_over_removal"]["lfoci-newton"]["wall"] > 0
            # + prefix_cache when the block starts after the first module (pipeline/frozen_prefix.py)
            # 5,658 > dense_max entries: L-FOCI; the block is a part of a CNN trained end to end, so the retrain
            # target takes its one-window form on the Gauss-Newton path (trust-region step, then its refit)
            record = sc["method_records"]["lfoci-newton"]
            assert record["target"]["how"] == "budget_damped" and record["curvature"]["how"] == "gauss-newton"
            # + emptied_classes where the request empties a class (class_1: every sample of it) and the model's
            # recorded trajectory lets the decision-layer row be replayed (pipeline/methods/emptied_rows.py)
            emptied = record["emptied_classes"]
            assert emptied["applied"] == ("emptied_classes" in sc["stage_timings"]["lfoci-newton"]), (name, emptied)
            assert set(sc["stage_timings"]["lfoci-newton"]) - {"prefix_cache", "refit", "emptied_classes"} == LFOCI_STAGES
            # served: the trust region accepted the step, its actual decrease of the one-window objective at least
            # min_ratio (0.25) of the Gauss-Newton model's prediction
            trust = record["trust_region"]
            assert trust["accepted"] and any(t["accepted"] and t["ratio"] >= 0.25 for t in trust["trials"])
        if "mixed_linear" in sc:
            assert sc["mixed_linear"]["relative_distance_to_exact_retrain"] < 1e-2  # exact up to the CG tolerance
    # one whole class (m = 12) is served by the Gauss-Newton trust-region step; a single
    # random sample of this small SGD-trained CNN may be refused (see bench_fmnist's notes)
    assert "lfoci-newton" in fmnist["scenarios"]["class_1"]["rows"]
    assert set(fmnist["headline"]) == {"random_1pct", "class_1"}
    assert fmnist["scenarios"]["class_1"]["m"] > fmnist["scenarios"]["random_1pct"]["m"]
    _machine(fmnist)


def test_growth_smoke(growth: dict, out_dir: Path) -> None:
    assert growth["benchmark"] == "growth"
    assert set(growth["results"]) == {"slices", "perturbations", "removed", "width"}
    points = [p for pts in growth["results"].values() for p in pts]
    for p in points:
        assert "error" not in p, p.get("error")
        assert p["seconds"] > 0 and p["peak_rss_gib"] > 0 and p["block_numel"] >= 1
        assert set(p["stages"]) - {"prefix_cache"} == LFOCI_STAGES
    assert not points[0]["in_process"], "the first point must run in a fresh process"
    assert (out_dir / "growth_smoke.png").stat().st_size > 1000
    _machine(growth)


def test_huge_layers_smoke(huge: dict) -> None:
    assert huge["benchmark"] == "huge_layers"
    fc6 = huge["model"]["fc6"]
    assert fc6["row_parameters"] == fc6["weight_shape"][1] + 1
    record = huge["method_record"]
    selection = huge["selection"]
    assert selection["strategy_used"] == "lfoci" and selection["selected"], selection  # 528k entries > dense_max
    # the block: L-FOCI's picks + the output layer (+ slices by forget-gradient norm); fc6 rows only where picked
    assert huge["block"]["numel"] == record["block"]["numel"] >= huge["model"]["output_layer_numel"]
    rows = huge["block"]["fc6_rows"]
    picked = {s["unit"] for s in selection["selected"] + selection.get("added_by_forget_gradient", [])
              if s["weight"] == "classifier.0.weight"}
    assert rows == sorted(picked)
    assert sum(p["numel"] for p in huge["block"]["fc6_parts"]) == len(rows) * fc6["row_parameters"]
    _solved(record, huge["settings"])
    assert huge["solver"]["solver"] == "cg" and huge["solver"]["converged"]
    assert set(huge["stage_seconds"]) == set(record["timings"]) and set(record["timings"]) - {"prefix_cache"} == LFOCI_STAGES
    assert all(v > 0 for v in huge["stage_seconds"].values())
    assert huge["peak_rss_gib"] > 0 and huge["within_memory"]["ok"]
    _machine(huge)


def test_gpu_reid_smoke_falls_back(gpu: dict) -> None:
    assert gpu["benchmark"] == "gpu_reid"
    assert gpu["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    record = gpu["method_record"]
    assert set(gpu["stage_summary"]) == set(record["timings"]) | {"metrics"} and set(record["timings"]) - {"prefix_cache"} == LFOCI_STAGES
    assert all(v >= 0 for v in gpu["stage_summary"].values())
    assert gpu["m"] >= 1 and gpu["model"]["options"]["num_classes"] == 751
    _solved(record, gpu["settings"])
    assert gpu["removal_seconds"] > 0
    _machine(gpu)


def test_summary_from_smoke_results(fmnist: dict, growth: dict, huge: dict, gpu: dict, out_dir: Path) -> None:
    from bench.run_all import BENCHMARKS, write_summary

    assert {"selection", "scaling", "text_r8", "fmnist", "growth", "huge_layers", "gpu_reid"} <= set(BENCHMARKS)
    (out_dir / "broken.json").write_text("{not json")
    path = write_summary(out_dir, out_dir / "summary.md", include_smoke=True)
    text = path.read_text()
    for section in ("## fmnist_smoke", "## growth_smoke", "## huge_layers_smoke", "## gpu_reid_smoke", "## broken"):
        assert section in text
    assert "| lfoci-newton |" in text and "could not" not in text.split("## broken")[0]
    assert "unreadable" in text


def test_gpu_reid_refusal_is_recorded_as_needs_retrain(out_dir: Path) -> None:
    """One SGD step leaves the smoke model where the Newton step removes too little of the
    retained gradient: the benchmark records the refusal (reason, numbers, stage times, time to
    the refusal) as needs_retrain instead of crashing."""
    from bench import bench_gpu_reid

    path = out_dir / "gpu_reid_smoke_refused.json"
    _run(bench_gpu_reid.main, ["--smoke", "--threads", "1", "--train-steps", "1", "--out", str(path)])
    d = _load(path)
    assert d["outcome"] == "needs_retrain" and "partial" not in d
    assert "retained gradient" in d["needs_retrain"]["reason"]
    assert d["needs_retrain"]["diagnostics"]["block_numel"] == d["block"]["numel"] > 0
    assert d["removal_seconds"] > 0 and {"probe", "selection", "curvature_and_solve"} <= set(d["stage_summary"])
    assert d["training"]["steps"] == 1 and d["training"]["stopped_by"] == "train_steps"
    assert d["verify_losses"]["before"] == d["verify_losses"]["after"]  # nothing published


def test_gpu_reid_other_method_through_unlearn_forget_entry(gpu: dict, out_dir: Path) -> None:
    """``--method block-gauss-newton``: the removal runs through pipeline.removal.remove (the entry
    point of unlearn forget --method), the variant's settings with tau from the bench's training;
    the record's scope, trust-region trials, refit and stage timings are kept, preparation seconds
    apart from removal seconds, and the forgotten identity's embedding metrics before and after."""
    from bench import bench_gpu_reid

    path = out_dir / "gpu_reid_smoke_bgn.json"
    _run(bench_gpu_reid.main, ["--smoke", "--threads", "1", "--method", "block-gauss-newton", "--out", str(path)])
    d = _load(path)
    assert d["method"] == d["variant"] == "block-gauss-newton" and d["entry_point"].startswith("pipeline.removal.remove")
    assert gpu["method"] == "lfoci-newton" and gpu["entry_point"] == d["entry_point"]
    assert d["outcome"] == "served"
    ms = d["method_summary"]
    assert ms["scope"]["numel"] == d["block"]["numel"] > 0 and ms["trust_region"]["accepted"]
    assert ms["trust_region"]["trials"][-1]["accepted"] and ms["refit"]["steps"] >= 1
    assert ms["filter"]["tau"] == pytest.approx(d["training"]["steps"] * 0.01 / 0.1)
    assert set(d["stage_summary"]) == {"gradients", "step", "refit", "metrics"} == set(ms["timings"]) | {"metrics"}
    assert d["preparation_seconds"] > 0 and d["removal_seconds"] > 0
    assert d["serve_seconds"] == pytest.approx(d["preparation_seconds"] + d["removal_seconds"])
    assert ms["preparation"]["built_for_this_request"] is False and "prefix_seconds" in ms["preparation"]
    for when in ("before", "after"):
        e = d["embedding"][when]
        assert e["retrieval"]["queries"] == d["m"] and "TAR" in e["verification"] and math.isfinite(e["membership_gap"])
    assert d["verify_losses"]["before"] != d["verify_losses"]["after"]  # the published weights were loaded
