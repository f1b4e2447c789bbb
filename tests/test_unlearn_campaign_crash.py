"""kill -9 of a running campaign at 10 named points, each followed by
`campaign resume`: every acknowledged request is applied exactly once and every version,
the final one included, is bitwise the one an uninterrupted run with the same seeds publishes.

Real engines: `python -m jobs.cli campaign run/resume` subprocesses, a real SQLite ledger file,
a real SIGKILL sent by the process to itself at the named point (UNLEARN_CRASH_AT)."""
from __future__ import annotations

import json
import signal
import sqlite3
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tests.unlearn_store_support import (
    METHOD, cached_model_dir, make_store, run_cli, state_of, train_ids, write_requests_csv, write_yaml,
)

MODEL = "digits"
# Privacy noise is secret (OS CSPRNG), so only a noise-free removal can be compared bitwise with
# an uninterrupted run: epsilon = inf, admitted by the budget explicitly.
DETERMINISTIC = {"name": METHOD["name"], "settings": {**METHOD["settings"], "epsilon": float("inf")}}
N_REQUESTS, PER_REQUEST, BATCH = 6, 2, 2

# One chain of processes: each is killed at its point (a different one each time), the next one
# resumes; the last one finishes. Hit counts are per process.
# After each stop: (request states, versions on disk, CURRENT, report written).
FULL = [0, 1, 2, 3]
CHAIN = [
    # mid-ingest transaction: nothing acknowledged, nothing in the ledger
    ("run", "ingest_row:3", ({}, [0], 0, False)),
    # all requests committed (acknowledged), nothing scheduled
    ("resume", "after_ingest:1", ({"accepted": 6}, [0], 0, False)),
    # batch 0 recorded, not computed
    ("resume", "after_schedule:1", ({"accepted": 4, "scheduled": 2}, [0], 0, False)),
    # batch 0 computed in memory only
    ("resume", "after_compute:1", ({"accepted": 4, "scheduled": 2}, [0], 0, False)),
    # batch 0's files in .staging, no manifest yet
    ("resume", "publish_staged:1", ({"accepted": 4, "scheduled": 2}, [0], 0, False)),
    # version 1 renamed into place, CURRENT still at 0, ledger not updated
    ("resume", "publish_renamed:1", ({"accepted": 4, "scheduled": 2}, [0, 1], 0, False)),
    # batch 0 reconciled from its manifest; version 2 published and current, ledger not updated
    ("resume", "publish_pointer:1", ({"applied": 2, "scheduled": 2, "accepted": 2}, [0, 1, 2], 2, False)),
    # batch 1 reconciled and marked applied
    ("resume", "after_ledger_applied:1", ({"applied": 4, "accepted": 2}, [0, 1, 2], 2, False)),
    # batch 2 scheduled, computed, published and applied; no report yet
    ("resume", "before_report:1", ({"applied": 6}, FULL, 3, False)),
    # report written, campaign not yet marked completed
    ("resume", "after_report:1", ({"applied": 6}, FULL, 3, True)),
    # finishes
    ("resume", None, ({"applied": 6}, FULL, 3, True)),
]


def _campaign(tmp: Path, template_model: Path) -> Path:
    store = make_store(tmp / "store", template_model, MODEL)
    ids = train_ids(N_REQUESTS * PER_REQUEST)
    write_requests_csv(tmp / "requests.csv", [ids[i : i + PER_REQUEST] for i in range(0, len(ids), PER_REQUEST)])
    return write_yaml(tmp / "campaign.yaml", {
        "name": "crash-test", "model": {"store": str(store), "name": MODEL}, "method": DETERMINISTIC,
        "batch_size": BATCH, "seed": 11, "limits": {"budget": {"epsilon": 100.0, "allow_non_private": True}}, "requests": "requests.csv",
    })


def _ledger_rows(store: Path) -> tuple[list[sqlite3.Row], list[sqlite3.Row]]:
    conn = sqlite3.connect(store / "ledger.sqlite3")
    conn.row_factory = sqlite3.Row
    try:
        return (conn.execute("SELECT * FROM requests ORDER BY seq").fetchall(),
                conn.execute("SELECT * FROM events ORDER BY id").fetchall())
    finally:
        conn.close()


def _manifests(store: Path) -> dict[int, dict]:
    folder = store / MODEL / "versions"
    return {int(p.name): json.loads((p / "manifest.json").read_text()) for p in sorted(folder.iterdir())}


def _check_invariants(store: Path) -> None:
    """At every stop: no batch published twice, no batch applied twice in the ledger."""
    published = Counter(m["batch"]["key"] for m in _manifests(store).values() if m["kind"] == "removal")
    assert all(c == 1 for c in published.values()), published
    if (store / "ledger.sqlite3").exists():
        _, events = _ledger_rows(store)
        applied = Counter(e["key"] for e in events if e["kind"] == "batch_applied")
        assert all(c == 1 for c in applied.values()), applied


def _uninterrupted(tmp: Path, template_model: Path) -> Path:
    done = run_cli("campaign", "run", str(_campaign(tmp, template_model)), "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    return tmp / "store"


def _run_chain(tmp: Path, template_model: Path, chain: list) -> Path:
    spec = _campaign(tmp, template_model)
    store = tmp / "store"
    acknowledged = False
    for verb, crash_at, (states, versions, current, reported) in chain:
        env = {"UNLEARN_CRASH_AT": crash_at} if crash_at else {}
        proc = run_cli("campaign", verb, str(spec), "--no-progress", env=env)
        if crash_at:
            assert proc.returncode == -signal.SIGKILL, f"{crash_at}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        else:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        acknowledged |= f"accepted {N_REQUESTS} requests" in proc.stdout
        _check_invariants(store)
        rows = _ledger_rows(store)[0] if (store / "ledger.sqlite3").exists() else []
        assert dict(Counter(r["state"] for r in rows)) == states, (crash_at, [dict(r) for r in rows])
        assert sorted(_manifests(store)) == versions, crash_at
        assert json.loads((store / MODEL / "CURRENT").read_text())["version"] == current, crash_at
        assert (store / MODEL / "reports" / "crash-test" / "report.json").exists() == reported, crash_at
    assert acknowledged, "the ingest was never acknowledged"
    return store


def test_kill_minus_9_at_every_point_then_resume_matches_uninterrupted_run(tmp_path, tmp_path_factory):
    template_model = cached_model_dir(tmp_path_factory)
    kills = [c.split(":")[0] for _, c, _ in CHAIN if c]
    assert len(kills) == len(set(kills)) == 10
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run goes on beside the chain
        baseline_job = pool.submit(_uninterrupted, tmp_path / "baseline", template_model)
        store = _run_chain(tmp_path / "chain", template_model, CHAIN)
        baseline = baseline_job.result()
    _matches_uninterrupted(store, baseline)


def _matches_uninterrupted(store: Path, baseline: Path) -> None:
    requests, events = _ledger_rows(store)
    assert [r["request_id"] for r in requests] == [f"r{k}" for k in range(N_REQUESTS)]
    assert all(r["state"] == "applied" for r in requests), [dict(r) for r in requests]
    applied_events = Counter(e["key"] for e in events if e["kind"] == "batch_applied")
    assert applied_events == {f"campaign:crash-test:{k}": 1 for k in range(N_REQUESTS // BATCH)}

    # Versions: the same numbers, parents, batches and bitwise weights as the uninterrupted run.
    ours, theirs = _manifests(store), _manifests(baseline)
    assert sorted(ours) == sorted(theirs) == list(range(N_REQUESTS // BATCH + 1))
    for v in ours:
        assert ours[v]["parent"] == theirs[v]["parent"]
        assert ours[v].get("batch") == theirs[v].get("batch")
        assert ours[v]["files"]["model.safetensors"] == theirs[v]["files"]["model.safetensors"], f"version {v}"
        a, b = state_of(store, MODEL, v), state_of(baseline, MODEL, v)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    version_of = {r["request_id"]: r["version"] for r in requests}
    for v, m in ours.items():
        for rid in (m.get("batch") or {}).get("request_ids", []):
            assert version_of[rid] == v
    assert json.loads((store / MODEL / "CURRENT").read_text())["version"] == N_REQUESTS // BATCH

    report = json.loads((store / MODEL / "reports" / "crash-test" / "report.json").read_text())
    assert report["requests"]["applied"] == N_REQUESTS and report["final_version"] == N_REQUESTS // BATCH
    assert (store / MODEL / "reports" / "crash-test" / "curves.png").stat().st_size > 1000
    conn = sqlite3.connect(store / "ledger.sqlite3")
    assert conn.execute("SELECT state FROM campaigns").fetchone()[0] == "completed"
    conn.close()
