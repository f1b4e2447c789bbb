"""Benchmark: a 200-request deletion campaign through `unlearn campaign run` on a benchmark model,
against one Retrain of that model measured in the same run (issue 27).

    .venv/bin/python -m bench.campaign_scale --dataset fmnist --threads 1 --kills 4   # -> campaign_scale_fmnist.json
    .venv/bin/python -m bench.campaign_scale --dataset r8 --threads 1 --kills 4       # -> campaign_scale_r8.json
    .venv/bin/python -m bench.campaign_scale --dataset fmnist --threads 1 --quick     # a 2,000-image profile, 40 requests

Model: configs/models/fmnist-head.yaml (the random conv trunk + MLP head on all 60,000 Fashion-MNIST
images, bench/forgetting.py's recipe) or configs/models/r8-head.yaml (frozen all-MiniLM-L6-v2,
mean-pooled, + MLP head 384 -> 256 -> 8 on the full R8 training split), trained with `unlearn train`
(``python -m jobs.cli train``) once into --workdir and reused while its config is unchanged.
Requests: ``--requests`` (200) distinct training samples drawn with a seeded generator, one per
request (a subject per sample), applied in batches of ``--batch-size`` (default 10: 20 batches; a
user collects requests for a while and applies them together), with the newton-head variant
(configs/methods/newton-head.yaml, as in configs/campaigns/<model>.yaml).

Measured in one run, on the same machine, one after the other:
  * Retrain, in a fresh process: the model's recipe on D minus the campaign's samples through the
    trainer (``pipeline.recipe.train``, what `unlearn train` runs: the frozen part once over the
    data, then the head), plus reading the data source (a retrain reads its data too; reported
    apart, as is the fit alone: ``ratio_retrain_fit_only_over_per_request``);
  * the campaign: a real ``python -m jobs.cli campaign run`` subprocess on a real version store
    (the model imported as version 0) and a real SQLite ledger; its wall time from the process start
    to its exit: Python start, imports, ingest, every batch (preparation, loading the parent
    version, removal, verification, publishing, ledger) and the report. Per request =
    that wall / the requests. The campaign's own report (report.json, ``jobs/costs.py``) gives
    the breakdown by stage, measured where each stage ran (the preparation amortised over the
    requests it served); what the report's batches do not cover (process start, ingest, report)
    is ``outside_batches``.
  * ``--kills K``: the same campaign again on a fresh store, SIGKILLed at K random moments (seeded)
    and resumed each time (`unlearn campaign resume`); then the audit reads the ledger and the
    store: every request applied exactly once, every sample removed in exactly one version on
    CURRENT's chain, the chain intact (every hash verifies), no batch applied twice, the final card
    removes exactly the campaign's samples, and the final weights against the uninterrupted run's.
Targets (issue 27): mean wall seconds per request <= Retrain / 20 on Fashion-MNIST, / 10 on R8.

Writes bench/results/campaign_scale_<dataset>[_quick].json (atomically) with the command.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import yaml  # noqa: E402

from bench.common import RESULTS_DIR, ROOT, machine_info, write_json  # noqa: E402

MODELS = {"fmnist": "fmnist-head", "r8": "r8-head"}
TARGET_RATIO = {"fmnist": 20, "r8": 10}   # Retrain seconds / seconds per request, at least
QUICK = {"fmnist": {"data": {"limit": 2000}, "requests": 40},
         "r8": {"data": {"limit": 300, "test_limit": 50, "max_length": 32}, "requests": 24}}
METHOD = "newton-head"
LIMITS = {"budget": {"epsilon": 50.0, "delta": 1.0e-5, "composition": "pld", "allow_non_private": True},
          "retain_accuracy_margin": 0.05}


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "UNLEARN_PROGRESS": "0"}


def _cli(args: list[str], threads: int, check: bool = True) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=_env(threads),
                          capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if check and done.returncode != 0:
        raise RuntimeError(f"`unlearn {' '.join(args)}` exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done, seconds


# ---- the model ---------------------------------------------------------------------------------
def model_config(dataset: str, quick: bool) -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "configs" / "models" / f"{MODELS[dataset]}.yaml").read_text())
    if quick:
        raw["data"]["options"] = {**raw["data"]["options"], **QUICK[dataset]["data"]}
    raw.pop("output", None)
    return raw


def card_matches(model_dir: Path, config: dict[str, Any]) -> bool:
    """The directory's card records exactly the model config's preset, options, data and recipe."""
    from pipeline.models.card import read_card
    from pipeline.recipe import recipe_of
    from pipeline.trainer import TrainConfig

    card, cfg = read_card(model_dir), TrainConfig.model_validate(config)
    return (card.preset == cfg.model.preset and card.options == cfg.model.options
            and card.data.source == cfg.data.source and card.data.options == cfg.data.options
            and card.data.split == cfg.data.split and not card.training.removed_ids
            and recipe_of(card) == cfg.recipe)


def trained_model(dataset: str, quick: bool, workdir: Path, threads: int,
                  model_dir: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """The model directory trained with `unlearn train` from the model config (reused while the
    config is the same; ``model_dir``: a directory `unlearn train` wrote from that config);
    (directory, what was done)."""
    config = model_config(dataset, quick)
    if model_dir is not None:
        if not card_matches(model_dir, config):
            raise SystemExit(f"--model-dir {model_dir} was not trained from configs/models/{MODELS[dataset]}.yaml "
                             f"{'(quick profile) ' if quick else ''}as it is now; train it with `unlearn train`")
        return model_dir, {"reused": str(model_dir)}
    out = workdir / "model"
    stamp = workdir / "model-config.json"
    if (out / "model.json").is_file() and stamp.is_file() and json.loads(stamp.read_text()) == config:
        return out, {"reused": str(out)}
    if out.exists():
        shutil.rmtree(out)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "model-config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    done, seconds = _cli(["train", str(path), "--output", str(out)], threads)
    stamp.write_text(json.dumps(config))
    return out, {"trained_seconds": seconds, "summary": json.loads(done.stdout)}


# ---- requests, store, spec -----------------------------------------------------------------------
def draw_requests(model_dir: Path, count: int, seed: int) -> list[int]:
    from pipeline.models.card import read_card
    from pipeline.removal import training_set

    ids = training_set(read_card(model_dir)).sample_ids
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))[:count]
    return sorted(int(i) for i in ids[order])  # (sorted: the file lists them in id order)


def setup_campaign(folder: Path, model_dir: Path, model: str, ids: list[int], batch_size: int, name: str,
                   threads: int) -> Path:
    """A fresh version store (the model as version 0), the request file and the campaign spec."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    _cli(["versions", "import", "--store", str(folder / "store"), "--model", model, str(model_dir)], threads)
    lines = ["request_id,subject,sample_ids"] + [f"req-{k:04d},subject-{k:04d},{i}" for k, i in enumerate(ids)]
    (folder / "requests.csv").write_text("\n".join(lines) + "\n")
    spec = {"name": name, "model": {"store": str(folder / "store"), "name": model}, "method": METHOD,
            "batch_size": batch_size, "seed": 0, "limits": LIMITS, "requests": "requests.csv"}
    path = folder / "campaign.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# ---- Retrain ------------------------------------------------------------------------------------
def retrain_in_child(dataset: str, quick: bool, removed: list[int], threads: int) -> dict[str, Any]:
    """``retrain`` in a fresh process (nothing cached from this one: the data source is read
    anew), timed from inside it."""
    done = subprocess.run([sys.executable, "-m", "bench.campaign_scale", "--retrain-child", dataset, *(["--quick"] if quick else []),
                           "--threads", str(threads)], input=json.dumps(removed), cwd=ROOT, env=_env(threads),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the Retrain process exited {done.returncode}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def retrain(dataset: str, quick: bool, removed: list[int]) -> dict[str, Any]:
    """The model's recipe on D minus ``removed`` through the trainer, with its data load, timed."""
    from pipeline.data import load_source
    from pipeline.evaluate.classification import task_accuracy
    from pipeline.recipe import train
    from pipeline.trainer import TrainConfig

    config = TrainConfig.model_validate(model_config(dataset, quick))
    started = time.perf_counter()
    splits = load_source(config.data.source, config.data.options)
    data = splits[config.data.split]
    data = data.without(data.positions_of(removed))
    loaded = time.perf_counter() - started
    result = train(config.model.preset, config.model.options, data, config.recipe,
                   config.model.init)
    total = time.perf_counter() - started
    test = splits.get(config.data.eval_split or "test")
    return {"seconds": total, "data_load_seconds": loaded, "train_seconds": result.seconds, "n": len(data),
            "what": "pipeline.recipe.train (the trainer `unlearn train` runs: the frozen part once over D \\ U, then "
                    "the head with the model config's recipe) plus loading the data source",
            "test_accuracy": task_accuracy(result.model, result.task, test) / 100 if test is not None else None}


# ---- the campaign ---------------------------------------------------------------------------------
def run_campaign(spec: Path, threads: int) -> dict[str, Any]:
    done, seconds = _cli(["campaign", "run", str(spec), "--no-progress"], threads)
    return {"wall_seconds": seconds, "stdout_tail": done.stdout[-1500:]}


def report_of(folder: Path, model: str, name: str) -> dict[str, Any]:
    return json.loads((folder / "store" / model / "reports" / name / "report.json").read_text())


# ---- kill -9 audit --------------------------------------------------------------------------------
def _events(ledger: Path) -> int:
    if not ledger.exists():
        return 0
    try:
        conn = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute("SELECT count(*) FROM events").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error:
        return 0


def _ledger(path: Path) -> tuple[list[dict], list[dict], list[dict]]:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.row_factory = sqlite3.Row
    try:
        conn.execute("BEGIN")
        return ([dict(r) for r in conn.execute("SELECT * FROM requests ORDER BY seq")],
                [dict(r) for r in conn.execute("SELECT * FROM batches")],
                [dict(r) for r in conn.execute("SELECT * FROM events ORDER BY id")])
    finally:
        conn.close()


def audit(store_root: Path, model: str, expected: dict[str, int], *, final: bool) -> dict[str, Any]:
    """The invariants (module docstring) on a store no writer is changing; raises AssertionError."""
    from pipeline.store.versions import VersionStore

    vs = VersionStore(store_root)
    current = vs.current(model)
    chain = vs.ancestors(model, current)
    assert chain == list(range(current, -1, -1)), f"chain broken: {chain}"
    assert all(err is None for _, err in vs.verify_all(model)), vs.verify_all(model)
    manifests = {v: vs.manifest(model, v) for v in chain}
    ledger = store_root / "ledger.sqlite3"
    if not ledger.exists():
        return {"applied": 0}
    requests, batches, events = _ledger(ledger)
    scheduled = {b["batch_key"] for b in batches if b["state"] == "scheduled"}
    for v in vs.versions(model):
        if v not in chain:  # only a version renamed into place by a process killed before CURRENT moved
            m = vs.manifest(model, v)
            assert m["parent"] == current and m["batch"]["key"] in scheduled and not final, (v, current)
    applied_events = Counter(e["key"] for e in events if e["kind"] == "batch_applied")
    assert all(c == 1 for c in applied_events.values()), applied_events
    on_chain = Counter(s for v in chain if v > 0 for s in manifests[v]["batch"]["sample_ids"])
    assert all(c == 1 for c in on_chain.values()), "a sample removed twice on the chain"
    for r in requests:
        ids = json.loads(r["sample_ids"])
        assert ids == [expected[r["request_id"]]], r
        if r["state"] == "applied":
            assert r["version"] in chain and r["request_id"] in manifests[r["version"]]["batch"]["request_ids"], r
        else:
            assert r["state"] in ("accepted", "scheduled") and not final, r
    applied = {s for r in requests if r["state"] == "applied" for s in json.loads(r["sample_ids"])}
    in_flight = {s for r in requests if r["state"] == "scheduled" for s in json.loads(r["sample_ids"])}
    assert applied <= set(on_chain) and set(on_chain) - applied <= (set() if final else in_flight)
    if final:
        assert len(requests) == len(expected) and all(r["state"] == "applied" for r in requests)
        card = json.loads((vs.version_dir(model, current) / "model.json").read_text())
        assert sorted(card["training"]["removed_ids"]) == sorted(expected.values())
    return {"applied": len(applied), "versions": current}


def kill_audit(spec: Path, folder: Path, model: str, expected: dict[str, int], kills: int, seed: int,
               threads: int, reference_store: Path) -> dict[str, Any]:
    """SIGKILL `campaign resume` at ``kills`` random moments (one in four in its first seconds,
    the others 0-2 s after 1-3 more ledger events), audit after each, then let it finish."""
    rng = random.Random(seed)
    ledger = folder / "store" / "ledger.sqlite3"
    argv = [sys.executable, "-m", "jobs.cli", "campaign", "resume", str(spec), "--no-progress"]
    lives: list[dict[str, Any]] = []
    started = time.perf_counter()
    while True:
        proc = subprocess.Popen(argv, cwd=ROOT, env=_env(threads), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        t0 = time.monotonic()
        killed = False
        if len(lives) < kills:
            if rng.random() < 0.25:
                deadline = t0 + rng.uniform(0.5, 8.0)
                while proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.01)
            else:
                target, delay = _events(ledger) + rng.randint(1, 3), rng.uniform(0.0, 2.0)
                while proc.poll() is None and _events(ledger) < target:
                    time.sleep(0.02)
                deadline = time.monotonic() + delay
                while proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.01)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                killed = True
        out, err = proc.communicate()
        state = audit(folder / "store", model, expected, final=not killed)
        lives.append({"killed": killed, "after_seconds": round(time.monotonic() - t0, 2), "applied_after": state["applied"],
                      **({} if killed else {"returncode": proc.returncode})})
        if not killed:
            if proc.returncode != 0:
                raise RuntimeError(f"the last resume exited {proc.returncode}: {out[-2000:]}\n{err[-2000:]}")
            break
    from pipeline.store.versions import VersionStore
    from safetensors.torch import load_file

    ours, theirs = VersionStore(folder / "store"), VersionStore(reference_store)
    a = load_file(str(ours.open_verified(model).path / "model.safetensors"))
    b = load_file(str(theirs.open_verified(model).path / "model.safetensors"))
    gap = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    return {"kills": sum(life["killed"] for life in lives), "lives": lives, "seconds": time.perf_counter() - started,
            "audit": "passed: every request applied exactly once, each sample removed in exactly one version on "
                     "CURRENT's chain, chain intact and every hash verified, no batch applied twice, the final card "
                     "removes exactly the campaign's samples",
            "final_version": ours.current(model), "final_version_uninterrupted": theirs.current(model),
            "max_abs_weight_difference_to_uninterrupted": gap,
            "weights_note": "a resumed process prepares its state anew from the version it starts from, where the "
                            "uninterrupted run carried it (its Newton preconditioner among it): the same removals, "
                            "each solved to the method's own tolerance (newton_rtol) from another preconditioner, so "
                            "the weights agree to that tolerance, not bit for bit"}


# ---- main ----------------------------------------------------------------------------------------
def run(dataset: str, *, quick: bool, requests: int | None, batch_size: int, kills: int, seed: int, threads: int,
        workdir: Path, model_dir: Path | None = None) -> dict[str, Any]:
    model = MODELS[dataset]
    count = requests or (QUICK[dataset]["requests"] if quick else 200)
    started = time.perf_counter()
    model_dir, model_note = trained_model(dataset, quick, workdir, threads, model_dir)
    ids = draw_requests(model_dir, count, seed)
    expected = {f"req-{k:04d}": i for k, i in enumerate(ids)}
    spec = setup_campaign(workdir / "campaign", model_dir, model, ids, batch_size, "scale", threads)
    retrained = retrain_in_child(dataset, quick, ids, threads)
    campaign = run_campaign(spec, threads)
    report = report_of(workdir / "campaign", model, "scale")
    costs = report["costs"]
    per_request = campaign["wall_seconds"] / count
    batches_wall = costs["total_seconds"]
    breakdown = {**costs["mean_per_request"],
                 "outside_batches": (campaign["wall_seconds"] - batches_wall) / count}
    result: dict[str, Any] = {
        "benchmark": "campaign_scale", "dataset": dataset, "quick": quick, "model": model,
        "command": f"{Path(sys.executable).name} -m bench.campaign_scale --dataset {dataset} --threads {threads}"
                   + (" --quick" if quick else "") + (f" --kills {kills}" if kills else "")
                   + (f" --requests {requests}" if requests else "") + f" --batch-size {batch_size}",
        "model_config": f"configs/models/{model}.yaml", "model_build": model_note,
        "n_train": retrained["n"] + count, "requests": count, "samples_per_request": 1, "batch_size": batch_size,
        "batches": -(-count // batch_size), "method": METHOD,
        "campaign": {"wall_seconds": campaign["wall_seconds"], "states": report["requests"],
                     "final_version": report["final_version"], "stdout_tail": campaign["stdout_tail"]},
        "per_request_seconds": per_request,
        "per_request_breakdown": breakdown,
        "per_request_breakdown_what": costs["what"] + "; outside_batches: the process's start, imports, ingest and "
                                      "report, per request; the stages and outside_batches sum to per_request_seconds",
        "per_batch": [{"index": b["index"], "state": b["state"], "version": b["version"],
                       **{k: b["costs"].get(k) for k in ("wall_seconds", "per_request", "preparation_built",
                                                          "preparation_updated")}} for b in report["batches"]],
        "retrain": retrained,
        "ratio_retrain_over_per_request": retrained["seconds"] / per_request,
        "ratio_retrain_fit_only_over_per_request": retrained["train_seconds"] / per_request,
        "target_ratio": TARGET_RATIO[dataset],
        "target_met": retrained["seconds"] / per_request >= TARGET_RATIO[dataset],
        "final_accuracy": {k: (report["batches"][-1]["metrics"] or {}).get(k) for k in
                           ("retain_accuracy", "test_accuracy", "cumulative_forget_accuracy")},
        "environment": machine_info(),
    }
    if kills:
        folder = workdir / "kills"
        spec_k = setup_campaign(folder, model_dir, model, ids, batch_size, "scale", threads)
        result["kill_audit"] = kill_audit(spec_k, folder, model, expected, kills, seed + 1, threads,
                                          workdir / "campaign" / "store")
    result["wall_seconds"] = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", choices=sorted(MODELS), default="fmnist")
    parser.add_argument("--quick", action="store_true", help="the small profile of tests/test_benchmark_model_examples.py")
    parser.add_argument("--requests", type=int, default=None, help="requests (one sample each); default 200 (quick: 40 / 24)")
    parser.add_argument("--batch-size", type=int, default=10, help="requests per batch (default 10)")
    parser.add_argument("--kills", type=int, default=0, help="also run the kill -9 audit with this many kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads here and in every subprocess")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="reuse this model directory (trained by `unlearn train` from the model config)")
    parser.add_argument("--retrain-child", choices=sorted(MODELS), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.retrain_child:  # (internal) one Retrain in this fresh process; removed ids on stdin, JSON on stdout
        print(json.dumps(retrain(args.retrain_child, args.quick, json.loads(sys.stdin.read()))))
        return 0
    workdir = args.workdir or ROOT / "runs" / "bench" / "campaign_scale" / (args.dataset + ("-quick" if args.quick else ""))
    result = run(args.dataset, quick=args.quick, requests=args.requests, batch_size=args.batch_size, kills=args.kills,
                 seed=args.seed, threads=args.threads, workdir=workdir, model_dir=args.model_dir)
    out = args.out or RESULTS_DIR / f"campaign_scale_{args.dataset}{'_quick' if args.quick else ''}.json"
    write_json(out, result)
    b = result["per_request_breakdown"]
    print(f"{args.dataset}: {result['requests']} requests in {result['batches']} batches, "
          f"{result['per_request_seconds']:.3f} s per request everything included "
          f"({', '.join(f'{k} {v:.3f}' for k, v in b.items() if isinstance(v, float))}); "
          f"Retrain {result['retrain']['seconds']:.1f} s: ratio {result['ratio_retrain_over_per_request']:.1f} "
          f"(target {result['target_ratio']}: {'met' if result['target_met'] else 'MISSED'})"
          + (f"; kill audit: {result['kill_audit']['kills']} kills, passed" if "kill_audit" in result else ""))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
