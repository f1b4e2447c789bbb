"""Benchmark: the stream service under load with the decision-layer fast path (issue 13, section 1).

    .venv/bin/python -m bench.stream_load                 # FMNIST, 60,000 images, N = 1000 requests
    .venv/bin/python -m bench.stream_load --kills 5       # the same, SIGKILLing the service 5 times
    .venv/bin/python -m bench.stream_load --quick         # 6,000 images, 120 requests (a few minutes)
    .venv/bin/python -m bench.stream_load --dataset r8    # MiniLM R8, 5,485 documents, N = 1000

Model: bench/forgetting.py's Fashion-MNIST setup as one network (preset ``random-conv-mlp``): the
seeded random conv trunk (frozen, trained on nothing) + the MLP head 1152 -> 128 -> 10 trained with
the same recipe on the cached trunk features (``bench.forgetting.load_data`` / ``train_head``),
imported as version 0 of a version store. Data source: ``fashion-mnist`` (all 60,000 training
images; ``--quick``: a seeded 6,000, the others marked removed in the card before the run).
``--dataset r8``: bench/forgetting.py's Reuters R8 setup: the real pre-trained all-MiniLM-L6-v2
encoder, frozen, its mean-pooled outputs computed once and cached (``bench.forgetting.load_data``,
384 features of the full training split, 5,485 stories, and the test split), and the MLP head
384 -> 256 -> 8 trained with the same recipe on them. The served model is that head (preset
``mlp``) over the cached encoder outputs, written as a Parquet data source (``parquet``, one
384-float list column ``x``; checked equal to the cache): the encoder is never run by the
service, the from-scratch removal or Retrain, so all three compare the trainable head alone, as
bench/forgetting.py does for R8 (``--quick``: 1,200 stories, 64 tokens).

Run: the real service (``python -m jobs.cli stream serve``) on 127.0.0.1 with ``fast_path``
enabled (``FAST_PATH``; method decision-layer-newton on the output layer, target minimiser, epsilon inf);
``--requests`` single-subject requests (one training sample each, distinct, seeded) from
``--clients`` concurrent HTTP clients, closed loop (each sends its next request once the last
one is applied, read from the ledger every 20 ms). Latency = acknowledged (the ledger's received_at, committed
before the 202) to applied (the ledger's updated_at when the batch was applied), read from the real
SQLite ledger. ``--kills K``: SIGKILL the service when K seeded random shares of the requests have
been acknowledged (plus a random delay), restart it, clients retry until acknowledged; the audit
then checks every acknowledged request was applied exactly once (ledger, manifests on CURRENT's
chain, the final card's removed ids).

Comparisons in the same run: one removal from scratch (``pipeline.removal.remove`` on the served
version: data load, the trunk over 60,000 images, closed-form curvature, Newton; and the method
alone on cached head inputs, like bench/forgetting.py's newton-head row without a prepared
curvature), Retrain (the head's recipe on D_r), and the fast path's own seconds per request.
Drift: the last published output layer against (a) one from-scratch lfoci-newton removal of all
removed samples from version 0 (target minimiser, converged tightly) and (b) the exact optimum of
D_r (a refreshed ``DecisionLayerStream``); the recorded drift bounds and the threshold.

Writes bench/results/stream_load[_r8][_quick][_kills].json (atomically).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
import yaml  # noqa: E402

from bench.forgetting import DATASETS, head_options, load_data, recipe_for, train_head  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
MODEL = "fmnist-cnn"
MODELS = {"fmnist": MODEL, "r8": "r8-minilm"}
DATASET_NAMES = {"fmnist": "fashion-mnist", "r8": "reuters-r8 (frozen all-MiniLM-L6-v2 features)"}
LAYER = ["3.weight", "3.bias"]
TOKEN_ENV = "UNLEARN_BENCH_TOKEN"
# the method the service runs (and the from-scratch comparison): decision-layer-newton on the output layer
METHOD = "decision-layer-newton"
METHOD_SETTINGS: dict[str, Any] = {"parameters": LAYER, "target": "minimiser", "newton_rtol": 1e-3}
# the from-scratch drift reference: lfoci-newton's converged block Newton on the same layer and target
SCRATCH_SETTINGS: dict[str, Any] = {"selection": "parameters", "parameters": LAYER, "target": "minimiser",
                                    "dense_max": 4096, "damping": 0.0, "dense_rtol": 1e-10, "newton_max_steps": 30,
                                    "newton_rtol": 1e-9, "newton_atol": 1e-12}
FAST_PATH: dict[str, Any] = {"enabled": True, "refresh_every": 100, "drift_threshold": 1e-5,
                             "drift_measure": "gradient"}
BATCHING = {"max_requests": 8, "max_wait_s": 0.02}
QUICK = {"requests": 120, "train_limit": 6000}


# ---- the model in a version store -------------------------------------------------------------
def import_as_v0(root: Path, model_dir: Path, model_name: str, net: nn.Module, preset: str,
                 options: dict[str, Any], data_ref: Any, recipe: Any, n: int, removed: list[int]) -> Path:
    """Write ``net`` as a model directory (card from the SGD ``recipe``) and import it as v0 of a
    fresh version store at ``root`` (an earlier store there is replaced)."""
    import shutil

    from pipeline.models.card import ModelCard, TrainingRecord, write_model_dir
    from pipeline.store.versions import VersionStore

    card = ModelCard(preset=preset, options=options, data=data_ref,
                     training=TrainingRecord(weight_decay=recipe.weight_decay, n=n, epochs=recipe.epochs, lr=recipe.lr,
                                             batch_size=recipe.batch_size, optimizer="sgd", seed=0,
                                             removed_ids=removed))
    if root.exists():
        shutil.rmtree(root)
    write_model_dir(model_dir, {k: v.detach() for k, v in net.state_dict().items()}, card)
    store = VersionStore(root, create=True)
    with store.lock(model_name, create=True):
        store.import_model_dir(model_name, model_dir)
    return root


def build_store(workdir: Path, quick: bool) -> dict[str, Any]:
    """Train the head on cached trunk features, assemble the one-network model, import it as v0."""
    from pipeline.data import load_source
    from pipeline.models.card import DataRef
    from pipeline.models.registry import build

    data = load_data("fmnist", quick, workdir)
    options = head_options(data, "fmnist", None)
    recipe = recipe_for("fmnist", 0, None)
    head, task, train_seconds = train_head(options, recipe, data.train)
    ex = DATASETS["fmnist"]["extractor_options"]
    net_options = {"channels": ex["channels"], "kernel": ex["kernel"], "pool": ex["pool"], "seed": ex["seed"],
                   "hidden": options["hidden"], "num_classes": options["num_classes"], "activation": "relu"}
    net, _ = build("random-conv-mlp", net_options)
    net[1].load_state_dict(head[1].state_dict())
    net[3].load_state_dict(head[3].state_dict())
    net.eval()
    images = load_source("fashion-mnist")["train"]
    kept = images.take(images.positions_of(data.train.sample_ids[:256].tolist()))
    with torch.no_grad():  # the network on images == the head on the cached features
        gap = float((net(kept.columns["x"]) - head(data.train.columns["x"][:256])).abs().max())
    assert gap < 1e-4, f"the assembled network does not reproduce the head on cached features ({gap})"
    all_ids = set(images.sample_ids.tolist())
    removed = sorted(all_ids - set(data.train.sample_ids.tolist()))  # --quick: outside the subset
    root = import_as_v0(workdir / ("store-quick" if quick else "store"), workdir / "model-v0", MODEL, net,
                        "random-conv-mlp", net_options, DataRef(source="fashion-mnist"), recipe, len(data.train),
                        removed)
    return {"root": root, "data": data, "head": head, "task": task, "recipe": recipe, "options": options,
            "train_seconds": train_seconds, "n": len(data.train), "network_gap": gap, "model": MODEL,
            "preset": "random-conv-mlp"}


def write_feature_parquet(path: Path, split: Any) -> Path:
    """Cached features of one split as Parquet: sample_id, label and x (a list of float32)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.checkpoint import atomic_write_bytes

    x = split.columns["x"].reshape(len(split), -1).to(torch.float32).numpy()
    table = pa.table({"sample_id": pa.array(split.sample_ids.numpy()), "label": pa.array(split.columns["y"].numpy()),
                      "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())
    return path


def build_store_r8(workdir: Path, quick: bool) -> dict[str, Any]:
    """bench/forgetting.py's R8 head on cached MiniLM features; the features as a Parquet source
    (checked equal to the cache); the head imported as v0 of a version store."""
    from pipeline.data import load_source
    from pipeline.models.card import DataRef

    model_name = MODELS["r8"]
    data = load_data("r8", quick, workdir)
    options = head_options(data, "r8", None)
    recipe = recipe_for("r8", 0, None)
    head, task, train_seconds = train_head(options, recipe, data.train)
    tag = "-quick" if quick else ""
    files = {"train": str(write_feature_parquet(workdir / f"r8-features-train{tag}.parquet", data.train)),
             "test": str(write_feature_parquet(workdir / f"r8-features-test{tag}.parquet", data.test))}
    source = {"path": files, "features": ["x"]}
    splits = load_source("parquet", source)
    gap = 0.0
    for name, cached in (("train", data.train), ("test", data.test)):
        got = splits[name]
        assert torch.equal(got.sample_ids, cached.sample_ids) and torch.equal(got.columns["y"], cached.columns["y"]), name
        gap = max(gap, float((got.columns["x"] - cached.columns["x"].reshape(len(cached), -1)).abs().max()))
    assert gap == 0.0, f"the Parquet features differ from the cache ({gap})"
    root = import_as_v0(workdir / f"store-r8{tag}", workdir / f"model-r8{tag}-v0", model_name, head, "mlp", options,
                        DataRef(source="parquet", options=source), recipe, len(data.train), [])
    return {"root": root, "data": data, "head": head, "task": task, "recipe": recipe, "options": options,
            "train_seconds": train_seconds, "n": len(data.train), "network_gap": gap, "model": model_name,
            "preset": "mlp", "features": data.cache}


# ---- the service ----------------------------------------------------------------------------------
class Service:
    """``python -m jobs.cli stream serve`` as a subprocess; restartable, killable."""

    def __init__(self, config: Path, port_file: Path, log: Path) -> None:
        self.config, self.port_file, self.log = config, port_file, log
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.starts: list[float] = []

    def start(self, timeout: float = 600) -> int:
        self.port_file.unlink(missing_ok=True)
        started = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(self.log, "a") as fh:
            self.proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "stream", "serve", "--config",
                                          str(self.config)], cwd=ROOT, env=env, stdout=fh, stderr=fh)
        deadline = time.monotonic() + timeout
        while not self.port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited with {self.proc.returncode}; see {self.log}")
            if time.monotonic() > deadline:
                raise TimeoutError("the service did not start")
            time.sleep(0.05)
        self.port = int(self.port_file.read_text())
        self.starts.append(time.perf_counter() - started)
        return self.port

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.port = None

    def stop(self) -> float:
        """SIGTERM; seconds until it exited."""
        assert self.proc is not None
        started = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        if self.proc.returncode != 0:
            raise RuntimeError(f"the service exited with {self.proc.returncode} on SIGTERM; see {self.log}")
        return time.perf_counter() - started


def post(port: int, body: dict[str, Any], token: str) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/requests", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def run_load(service: Service, bodies: list[dict[str, Any]], clients: int, kills: int, token: str, seed: int,
             time_limit: float, ledger: Path) -> dict[str, Any]:
    """Closed loop: each client submits a request (retrying through kills until it is
    acknowledged), waits until the ledger says it is applied, then submits its next one. A
    supervisor SIGKILLs and restarts the service at seeded random acknowledgement counts."""
    rng = random.Random(seed)
    kill_at = sorted(rng.randint(len(bodies) // 10, 9 * len(bodies) // 10) for _ in range(kills))
    lock = threading.Lock()
    acknowledged: list[str] = []
    codes: dict[int, int] = {}
    kill_log: list[dict[str, Any]] = []
    deadline = time.monotonic() + time_limit
    queue = list(bodies)
    up = threading.Event()
    up.set()
    applied: set[str] = set()
    finished = threading.Event()
    errors: list[BaseException] = []

    def poller() -> None:  # the ledger, read-only, every 20 ms
        while not finished.is_set():
            if ledger.exists():
                try:
                    conn = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True, timeout=5)
                    try:
                        rows = conn.execute("SELECT request_id FROM requests WHERE state = 'applied'").fetchall()
                    finally:
                        conn.close()
                    with lock:
                        applied.update(r[0] for r in rows)
                except sqlite3.Error:
                    pass
            time.sleep(0.02)

    def client() -> None:
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    body = queue.pop(0)
                while True:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the load did not finish within --time-limit")
                    up.wait(timeout=60)
                    port = service.port
                    try:
                        code = post(port, body, token) if port else 0
                    except (OSError, urllib.error.URLError):
                        code = 0
                    if code in (200, 202):
                        with lock:
                            if body["request_id"] not in acknowledged:
                                acknowledged.append(body["request_id"])
                            codes[code] = codes.get(code, 0) + 1
                        break
                    if code not in (0, 503):
                        raise RuntimeError(f"request {body['request_id']} answered {code}")
                    time.sleep(0.1)
                while True:  # closed loop: the next request once this one is applied
                    with lock:
                        if body["request_id"] in applied:
                            break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"request {body['request_id']} not applied within --time-limit")
                    time.sleep(0.01)
        except BaseException as err:  # noqa: BLE001 - surfaced after the join
            errors.append(err)

    def supervisor() -> None:
        try:
            for target in kill_at:
                while True:
                    with lock:
                        count = len(acknowledged)
                    if count >= target or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
                time.sleep(rng.uniform(0.0, 0.5))
                up.clear()
                at = time.perf_counter()
                service.kill()
                with lock:
                    count = len(acknowledged)
                service.start()
                up.set()
                kill_log.append({"after_acknowledged": count, "restart_seconds": time.perf_counter() - at})
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
            up.set()

    started = time.perf_counter()
    watcher = threading.Thread(target=poller, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    boss = threading.Thread(target=supervisor)
    for t in [*threads, boss]:
        t.start()
    for t in [*threads, boss]:
        t.join()
    finished.set()
    if errors:
        raise errors[0]
    return {"acknowledged": acknowledged, "codes": codes, "kills": kill_log,
            "load_seconds": time.perf_counter() - started}


# ---- reading the ledger and the store ---------------------------------------------------------------
def ledger_rows(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return ([dict(r) for r in conn.execute("SELECT * FROM requests")], [dict(r) for r in conn.execute("SELECT * FROM batches")])
    finally:
        conn.close()


def wait_applied(ledger: Path, ids: set[str], timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        rows = ledger_rows(ledger)[0]
        states = {r["request_id"]: r["state"] for r in rows}
        bad = {r: states[r] for r in ids if states.get(r) in ("failed", "needs_retrain")}
        if bad:
            raise RuntimeError(f"requests ended {sorted(set(bad.values()))}: {list(bad)[:5]}")
        if all(states.get(r) == "applied" for r in ids):
            return rows
        if time.monotonic() > deadline:
            raise TimeoutError(f"{sum(states.get(r) != 'applied' for r in ids)} requests not applied in time")
        time.sleep(0.25)


def percentiles(values: list[float]) -> dict[str, float]:
    xs = sorted(values)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, max(0, int(round(p * (len(xs) - 1)))))]

    return {"p50": q(0.5), "p95": q(0.95), "p99": q(0.99), "max": xs[-1], "mean": statistics.fmean(xs), "count": len(xs)}


def audit_exactly_once(root: Path, ledger: Path, bodies: dict[str, dict[str, Any]], acknowledged: list[str],
                       n0: int, removed0: set[int], model: str = MODEL) -> dict[str, Any]:
    """Every acknowledged request applied exactly once: in the ledger, in the manifests on
    CURRENT's chain, in the final card. Raises AssertionError naming the first violation."""
    from pipeline.models.card import read_card
    from pipeline.store.versions import VersionStore

    requests, batches = ledger_rows(ledger)
    states = {r["request_id"]: r for r in requests}
    assert len(set(acknowledged)) == len(acknowledged), "a request was acknowledged twice as new"
    for rid in acknowledged:
        assert states[rid]["state"] == "applied", f"{rid}: {states[rid]['state']}"
    applied_batches = [b for b in batches if b["state"] == "applied"]
    in_batches: dict[str, int] = {}
    for b in applied_batches:
        for rid in json.loads(b["request_ids"]):
            in_batches[rid] = in_batches.get(rid, 0) + 1
    twice = [r for r, c in in_batches.items() if c != 1]
    assert not twice, f"requests in more than one applied batch: {twice[:5]}"
    vs = VersionStore(root)
    current = vs.current(model)
    chain = vs.ancestors(model, current)
    seen: dict[str, int] = {}
    samples: list[int] = []
    for v in chain:
        meta = vs.manifest(model, v).get("batch") or {}
        for rid in meta.get("request_ids", []):
            seen[rid] = seen.get(rid, 0) + 1
        samples += meta.get("sample_ids", [])
    assert sorted(seen) == sorted(acknowledged) and set(seen.values()) <= {1}, "manifests on the chain disagree"
    assert len(samples) == len(set(samples)), "a sample was removed twice"
    expected = {i for rid in acknowledged for i in bodies[rid]["sample_ids"]}
    card = read_card(vs.open_verified(model, current).path)
    assert set(card.training.removed_ids) == expected | removed0, "the final card's removed ids differ"
    assert card.training.n == n0 - len(expected)
    return {"acknowledged": len(acknowledged), "applied_exactly_once": len(acknowledged), "chain_versions": len(chain),
            "applied_batches": len(applied_batches), "other_batches": {s: sum(b["state"] == s for b in batches)
                                                                       for s in ("failed", "needs_retrain", "scheduled")}}


# ---- comparisons --------------------------------------------------------------------------------
def head_block(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([model[3].weight.detach().reshape(-1), model[3].bias.detach()]).double()


def from_scratch_runs(setup: dict[str, Any], version_dir: Path, sample_id: int) -> dict[str, Any]:
    """One request removed from scratch: the whole ``remove`` on the model directory, and the
    method alone on the cached head inputs (no prepared curvature)."""
    from pipeline.methods import RemovalProblem, get_method
    from pipeline.removal import remove

    started = time.perf_counter()
    run = remove(version_dir, [sample_id], method=METHOD, settings=METHOD_SETTINGS, batch_size=4096)
    whole = time.perf_counter() - started
    head, data = copy.deepcopy(setup["head"]), setup["data"]
    impl = get_method(METHOD)
    pos = data.train.positions_of([sample_id])
    problem = RemovalProblem(head, setup["task"], data.train, pos, setup["recipe"].weight_decay, seed=0, batch_size=4096)
    started = time.perf_counter()
    impl.run(problem, impl.Settings.model_validate(METHOD_SETTINGS))
    method_only = time.perf_counter() - started
    return {"remove_model_dir_seconds": whole, "remove_timings": run.record.get("timings"),
            "method_on_cached_inputs_seconds": method_only}


def drift_report(setup: dict[str, Any], root: Path, removed: list[int], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The last published output layer against from-scratch results for D minus every removed sample."""
    from pipeline.methods import RemovalProblem, get_method
    from pipeline.models.card import load_model_dir
    from pipeline.store.versions import VersionStore
    from pipeline.streaming import DecisionLayerStream, StreamSettings

    vs = VersionStore(root)
    served, _, _ = load_model_dir(vs.open_verified(setup["model"]).path)
    theta_served = head_block(served)
    head, data, lam = copy.deepcopy(setup["head"]), setup["data"], setup["recipe"].weight_decay
    theta0 = head_block(head)
    started = time.perf_counter()
    impl = get_method("lfoci-newton")
    tight = SCRATCH_SETTINGS
    problem = RemovalProblem(head, setup["task"], data.train, data.train.positions_of(removed), lam, seed=0,
                             batch_size=4096)
    outcome = impl.run(problem, impl.Settings.model_validate(tight))
    scratch_seconds = time.perf_counter() - started
    theta_scratch = torch.cat([outcome.new_parameters["3.weight"].reshape(-1), outcome.new_parameters["3.bias"]]).double()
    state, _ = DecisionLayerStream.from_model(copy.deepcopy(setup["head"]), setup["task"], data.train, LAYER, lam,
                                              settings=StreamSettings(refresh_every=10**9, refresh_tol=1e-11,
                                                                      refresh_max_steps=30))
    state.remove(removed, target=lambda st: torch.zeros(st.p, dtype=torch.float64))
    refreshed = state.refresh(converge=True)
    exact = state.theta
    moved = float(torch.linalg.vector_norm(exact - theta0))
    fast = [r["fast_path"] for r in records]
    return {
        "what": f"||theta|| of the output layer ({int(head_block(setup['head']).numel()):,} entries); exact = the optimum of D_r (refreshed state, "
                "converged to 1e-11); from_scratch = one lfoci-newton removal of all removed samples from version 0 "
                "(target minimiser, converged to 1e-9 relative)",
        "removal_moved_the_layer_by": moved,
        "served_to_exact": float(torch.linalg.vector_norm(theta_served - exact)),
        "served_to_from_scratch": float(torch.linalg.vector_norm(theta_served - theta_scratch)),
        "from_scratch_to_exact": float(torch.linalg.vector_norm(theta_scratch - exact)),
        "exact_refresh": {k: refreshed[k] for k in ("newton_steps", "residual_after", "converged")},
        "served_exact_gradient_residual": float(torch.linalg.vector_norm(state.exact_gradient(theta_served) - state.anchor)),
        "max_recorded_gradient_error_bound": max(f["gradient_error_bound"] for f in fast),
        # a step's drift is measured before the refresh it may trigger: the largest of those, and the
        # largest bound of a version as published (after its refresh, at the dtype-cast weights)
        "max_fast_step_distance_bound_before_refresh": max(f["distance_bound"] for f in fast),
        "max_distance_to_target_bound": max(f["distance_to_target_bound"] for f in fast),
        "threshold": {"drift_threshold": FAST_PATH["drift_threshold"],
                      "distance": FAST_PATH["drift_threshold"] / lam},
        "from_scratch_all_seconds": scratch_seconds,
    }


def retrain_seconds(setup: dict[str, Any], removed: list[int]) -> tuple[float, torch.nn.Module]:
    data = setup["data"]
    keep = data.train.without(data.train.positions_of(removed))
    model, _, seconds = train_head(setup["options"], setup["recipe"], keep)
    return seconds, model


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


# ---- the run -----------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    workdir = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    setup = (build_store_r8 if args.dataset == "r8" else build_store)(workdir, args.quick)
    model_name = setup["model"]
    root = setup["root"]
    token = os.environ.get(TOKEN_ENV) or os.urandom(16).hex()
    os.environ[TOKEN_ENV] = token
    port_file = workdir / "port"
    config = workdir / "service.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"store": str(root), "name": model_name},
        "method": {"name": METHOD, "settings": METHOD_SETTINGS}, "seed": 0,
        "limits": {"budget": {"epsilon": 1000.0, "allow_non_private": True}, "retain_accuracy_margin": 0.05},
        "host": "127.0.0.1", "port": 0, "port_file": str(port_file),
        "auth": {"clients": [{"client": "bench", "token_env": TOKEN_ENV}]},
        "batching": BATCHING, "rate_limit": {"requests_per_second": 100000, "burst": 100000},
        "fast_path": FAST_PATH,
    }, sort_keys=False))
    data = setup["data"]
    rng = random.Random(args.seed)
    ids = rng.sample(data.train.sample_ids.tolist(), args.requests)
    bodies = [{"request_id": f"r{k:05d}", "subject": f"person-{k}", "sample_ids": [int(i)]} for k, i in enumerate(ids)]
    by_id = {b["request_id"]: b for b in bodies}
    log = workdir / "service.log"
    log.unlink(missing_ok=True)
    service = Service(config, port_file, log)
    service.start()
    ledger = root / "ledger.sqlite3"
    load = run_load(service, bodies, args.clients, args.kills, token, args.seed, args.time_limit, ledger)
    rows = wait_applied(ledger, set(load["acknowledged"]), args.time_limit)
    applied_all = time.perf_counter()
    stop_seconds = service.stop()

    from pipeline.models.card import load_model_dir, read_card
    from pipeline.store.versions import VersionStore

    removed0 = set(read_card(VersionStore(root).version_dir(model_name, 0)).training.removed_ids)
    audit = audit_exactly_once(root, ledger, by_id, load["acknowledged"], setup["n"], removed0, model_name)
    latencies = [(datetime.fromisoformat(r["updated_at"]) - datetime.fromisoformat(r["received_at"])).total_seconds()
                 for r in rows if r["request_id"] in by_id]
    first = min(datetime.fromisoformat(r["received_at"]) for r in rows)
    last = max(datetime.fromisoformat(r["updated_at"]) for r in rows)
    span = (last - first).total_seconds()
    vs = VersionStore(root)
    records = [vs.manifest(model_name, v)["record"] for v in vs.ancestors(model_name, vs.current(model_name)) if v > 0]
    fast = [r["fast_path"] for r in records]
    paths = {p: sum(f["path"] == p for f in fast) for p in ("fast", "refresh")}
    fast_seconds = [f["seconds"] for f in fast if f["path"] == "fast"]
    refresh_seconds = [f["seconds"] for f in fast if f["path"] == "refresh"]
    remover_seconds = [r["wall_seconds"] for r in records]

    requested = set(ids)
    spare = next(int(i) for i in data.train.sample_ids.tolist() if int(i) not in requested)
    comparison = from_scratch_runs(setup, vs.open_verified(model_name).path, spare)
    removed = sorted({i for b in bodies for i in b["sample_ids"]})
    retrain, retrained = retrain_seconds(setup, removed)
    drift = drift_report(setup, root, removed, records)
    served, _, _ = load_model_dir(vs.open_verified(model_name).path)
    test_x, test_y = data.test.columns["x"], data.test.columns["y"]
    head_served = copy.deepcopy(setup["head"])
    head_served[3].load_state_dict(served[3].state_dict())
    lat = percentiles(latencies)
    p50_fast = lat["p50"]
    result = {
        "benchmark": "stream_load", "quick": args.quick, "dataset": DATASET_NAMES[args.dataset],
        "n_train": setup["n"], "requests": args.requests, "clients": args.clients, "kills_asked": args.kills,
        "model": {"preset": setup["preset"], "head": setup["options"], "frozen_features": setup.get("features"), "decision_layer": LAYER,
                  "head_training_seconds": setup["train_seconds"], "network_vs_cached_head_max_gap": setup["network_gap"]},
        "service": {"method_settings": METHOD_SETTINGS, "fast_path": FAST_PATH, "batching": BATCHING,
                    "start_seconds": service.starts, "sigterm_stop_seconds": stop_seconds},
        "latency_ack_to_applied_s": lat,
        "latency_note": "with kills, latencies include the restarts" if args.kills else "no kills in this run",
        "throughput": {"applied_per_second": len(latencies) / span if span > 0 else None,
                       "first_ack_to_last_applied_s": span, "load_seconds": load["load_seconds"]},
        "paths": paths, "versions_published": len(records),
        "per_request_seconds": {
            "fast_path_state_update_and_solve": percentiles(fast_seconds) if fast_seconds else None,
            "refresh": percentiles(refresh_seconds) if refresh_seconds else None,
            "remover_wall_incl_model_load": percentiles(remover_seconds),
        },
        "from_scratch_one_request": comparison,
        "retrain_seconds": retrain,
        "floor": {"fast_path_p50_latency_s": p50_fast,
                  "from_scratch_method_on_cached_inputs_s": comparison["method_on_cached_inputs_seconds"],
                  "from_scratch_remove_model_dir_s": comparison["remove_model_dir_seconds"],
                  "ratio_vs_method_on_cached_inputs": comparison["method_on_cached_inputs_seconds"] / p50_fast,
                  "ratio_vs_remove_model_dir": comparison["remove_model_dir_seconds"] / p50_fast,
                  "ratio_vs_retrain": retrain / p50_fast,
                  "required": 10.0},
        "drift": drift,
        "test_accuracy": {"original": accuracy(setup["head"], test_x, test_y), "served": accuracy(head_served, test_x, test_y),
                          "retrain": accuracy(retrained, test_x, test_y)},
        "durability": {"kills": load["kills"], "audit": audit, "codes": load["codes"]},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "threads": 1, "cpus": os.cpu_count()},
        "wall_seconds_after_applied": time.perf_counter() - applied_all,
    }
    return result


def write_json(result: dict[str, Any], path: Path) -> Path:
    from pipeline.checkpoint import atomic_write_bytes

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(result, indent=2, default=str) + "\n").encode())
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=sorted(MODELS), default="fmnist",
                        help="fmnist: the CNN on 60,000 images; r8: the MiniLM R8 head on cached encoder outputs")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK['train_limit']} images, {QUICK['requests']} requests")
    parser.add_argument("--requests", type=int, default=None, help="single-subject requests (default 1000; quick 120)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--kills", type=int, default=0, help="SIGKILL and restart the service this many times")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=1800.0, help="seconds the load may take at most")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="default runs/bench/stream_load (r8: runs/bench/stream_load_r8)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.workdir is None:
        args.workdir = ROOT / "runs" / "bench" / ("stream_load_r8" if args.dataset == "r8" else "stream_load")
    args.workdir = args.workdir.resolve()  # the service config's paths are resolved from its own folder
    if args.requests is None:
        args.requests = QUICK["requests"] if args.quick else 1000
    if args.requests < 1 or args.clients < 1 or args.kills < 0:
        parser.error("--requests and --clients must be >= 1, --kills >= 0")
    result = run(args)
    name = "stream_load" + ("_r8" if args.dataset == "r8" else "") + ("_quick" if args.quick else "") + ("_kills" if args.kills else "")
    path = write_json(result, args.out or RESULTS_DIR / f"{name}.json")
    print(json.dumps({k: result[k] for k in ("latency_ack_to_applied_s", "throughput", "paths", "floor")}, indent=1,
                     default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
