"""kill -9 at random moments (not at named crash points): a real `python -m jobs.cli campaign`
subprocess over 30 one-request batches, SIGKILLed again and again and resumed each time; then
`versions rollback` and the stream service killed the same way. After every kill and at the end
an audit reads the real SQLite ledger and the real version store:

  * every acknowledged request is applied at most once (at the end: exactly once), and the
    version that applied it is on CURRENT's chain and its manifest names the request;
  * every removed sample is in exactly one manifest on CURRENT's chain;
  * the chain is intact: versions 0..k each the child of the one before, every hash verifies,
    nothing published off the chain, no batch applied twice.

The random moments come from ``random.Random(UNLEARN_KILL_SEED or 14)``; the seed is printed.
"""
from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from pathlib import Path

from tests.unlearn_store_support import (
    METHOD_FAST, REPO, cached_model_dir, http_json, make_store, train_ids, unlearn_argv, write_requests_csv,
    write_yaml,
)

MODEL = "digits"
N_BATCHES = 30
MIN_KILLS = 10
TOKEN = "random-kill-token-0123456789"
STATS = Counter()  # kills survived, audits run, request states checked (the closing note's counts)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "UNLEARN_KILL_TOKEN": TOKEN}


def _rng() -> random.Random:
    seed = int(os.environ.get("UNLEARN_KILL_SEED", "14"))
    print(f"random kill seed {seed}")
    return random.Random(seed)


def _run_and_maybe_kill(argv: list[str], delay: float) -> tuple[bool, subprocess.CompletedProcess | None]:
    """Start ``argv``; SIGKILL it after ``delay`` seconds. (killed while running, result if it ended first)."""
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=delay)
        return False, subprocess.CompletedProcess(argv, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        return True, None


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


def _run_and_kill_in_work(argv: list[str], ledger: Path, rng: random.Random) -> tuple[bool, subprocess.CompletedProcess | None]:
    """Start ``argv`` and SIGKILL it at a random moment: one life in four anywhere in its first
    seconds (imports, ingest), the others 0-0.3 s after 1-2 more ledger events (inside the
    batches: compute, staging, rename, pointer, ledger, report - wherever the clock falls), but
    never past the next event: where a batch takes tens of milliseconds a fixed delay would
    let one life run through most of the campaign, which then ends after too few kills."""
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = time.monotonic()
    if rng.random() < 0.25:  # early: 0.5-4 s from the start, but before its first batch's second event
        deadline, cap = start + rng.uniform(0.5, 4.0), _events(ledger) + 2
        while proc.poll() is None and time.monotonic() < deadline and _events(ledger) < cap:
            time.sleep(0.005)
        return _kill_or_result(proc, argv)
    # a random moment counted in the ledger's own progress (1-2 new events, then 0-0.3 s capped at
    # the next event), not in seconds alone: on a fast machine a whole campaign takes seconds
    delay, target = rng.uniform(0.0, 0.3), _events(ledger) + rng.randint(1, 2)
    while proc.poll() is None and _events(ledger) < target and time.monotonic() - start < 120:
        time.sleep(0.02)
    deadline, cap = time.monotonic() + delay, _events(ledger) + 1
    while proc.poll() is None and time.monotonic() < deadline and _events(ledger) < cap:
        time.sleep(0.005)
    return _kill_or_result(proc, argv)


def _run_and_kill_after_pointer_move(argv: list[str], pointer: Path, delay: float
                                     ) -> tuple[bool, subprocess.CompletedProcess | None]:
    """Start ``argv`` and SIGKILL it ``delay`` seconds after the version pointer file changes (a
    writer moved CURRENT), or let it end if it never moves it."""
    before = pointer.read_bytes()
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = time.monotonic()
    while proc.poll() is None and pointer.read_bytes() == before and time.monotonic() - start < 120:
        time.sleep(0.001)
    deadline = time.monotonic() + delay
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return _kill_or_result(proc, argv)


def _kill_or_result(proc: subprocess.Popen, argv: list[str]) -> tuple[bool, subprocess.CompletedProcess | None]:
    """SIGKILL ``proc`` if it still runs: (True, None); else (False, its result)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        return True, None
    out, err = proc.communicate()
    return False, subprocess.CompletedProcess(argv, proc.returncode, out, err)


# -- the audit ------------------------------------------------------------------------------
def _ledger(path: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """(requests, batches, events), read in one transaction: one snapshot of the three tables."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.row_factory = sqlite3.Row
    try:
        conn.execute("BEGIN")
        return ([dict(r) for r in conn.execute("SELECT * FROM requests ORDER BY seq")],
                [dict(r) for r in conn.execute("SELECT * FROM batches")],
                [dict(r) for r in conn.execute("SELECT * FROM events ORDER BY id")])
    finally:
        conn.close()


def wait_applied(ledger_path: Path, ids: set[str], timeout: float = 120) -> dict[str, str]:
    """Poll the ledger of a live service until ``ids`` are applied; request id -> state. The store is
    audited only once the service stopped: CURRENT and the ledger, read while a batch lands (CURRENT
    moved, the ledger marked at the new version), disagree for a moment."""
    deadline = time.monotonic() + timeout
    while True:
        states = {r["request_id"]: r["state"] for r in _ledger(ledger_path)[0]} if ledger_path.exists() else {}
        if all(states.get(r) == "applied" for r in ids):
            return states
        assert not {states.get(r) for r in ids} & {"needs_retrain", "failed"}, states
        assert time.monotonic() < deadline, states
        time.sleep(0.1)


def audit(store_root: Path, ledger_path: Path, *, final: bool) -> dict[str, str]:
    """The invariants above, on a store no writer is changing (after a kill or a stop); returns
    request id -> state."""
    from pipeline.store.versions import VersionStore

    vs = VersionStore(store_root)
    current = vs.current(MODEL)
    chain = vs.ancestors(MODEL, current)
    assert chain == list(range(current, -1, -1)), f"chain broken: {chain}"
    assert all(err is None for _, err in vs.verify_all(MODEL)), vs.verify_all(MODEL)
    manifests = {v: vs.manifest(MODEL, v) for v in chain}
    off_chain = [v for v in vs.versions(MODEL) if v not in chain]
    if not ledger_path.exists():
        assert current == 0 and not off_chain
        return {}
    requests, batches, events = _ledger(ledger_path)
    scheduled = {b["batch_key"] for b in batches if b["state"] == "scheduled"}
    for v in off_chain:
        # off the chain: rolled back by an operator (it was current once), or - between kills only -
        # renamed into place by a writer killed before it moved CURRENT: on CURRENT, its batch pending
        pending = vs.manifest(MODEL, v)["parent"] == current and vs.manifest(MODEL, v)["batch"]["key"] in scheduled
        assert vs.was_current(MODEL, v) or (pending and not final), (v, current)
        STATS["published but not yet current, seen after a kill"] += int(pending and not vs.was_current(MODEL, v))
    applied_events = Counter(e["key"] for e in events if e["kind"] == "batch_applied")
    assert all(c == 1 for c in applied_events.values()), applied_events
    samples_on_chain = Counter(s for v in chain if v > 0 for s in manifests[v]["batch"]["sample_ids"])
    assert all(c == 1 for c in samples_on_chain.values()), "a sample removed twice on the chain"
    # between kills only: a rollback killed after it moved CURRENT and before its ledger followed
    # (the rerun finishes it): requests still "applied" at a version the last pointer move rolled back
    last_move = vs.pointer(MODEL)["history"][-1]
    unfollowed = {r["request_id"] for r in requests if r["state"] == "applied" and r["version"] not in chain}
    if unfollowed:
        assert not final and last_move["kind"] == "rollback", (sorted(unfollowed), last_move)
        assert all(vs.was_current(MODEL, r["version"]) and r["version"] > current
                   for r in requests if r["request_id"] in unfollowed), sorted(unfollowed)
        STATS["rollback moved CURRENT, ledger not yet followed, seen after a kill"] += 1
    requests = [r for r in requests if r["request_id"] not in unfollowed]
    by_request: dict[str, str] = {r: "applied (rolled back, not yet followed)" for r in unfollowed}
    for r in requests:
        STATS["request states checked"] += 1
        by_request[r["request_id"]] = r["state"]
        ids = json.loads(r["sample_ids"])
        if r["state"] == "applied":
            assert r["version"] in chain, r
            batch = manifests[r["version"]]["batch"]
            assert r["request_id"] in batch["request_ids"] and set(ids) <= set(batch["sample_ids"]), r
        else:  # not applied: none of its samples is removed on the chain (unless re-requested)
            assert r["version"] is None or r["state"] == "needs_retrain", r
    applied_samples = Counter(s for r in requests if r["state"] == "applied" for s in json.loads(r["sample_ids"]))
    assert all(c == 1 for c in applied_samples.values()) and set(applied_samples) <= set(samples_on_chain)
    # on the chain but not yet marked applied: only a batch killed between its publication and the ledger
    in_flight = {s for r in requests if r["state"] == "scheduled" for s in json.loads(r["sample_ids"])}
    assert set(samples_on_chain) - set(applied_samples) <= (set() if final else in_flight)
    if final:
        assert not [b for b in batches if b["state"] == "scheduled"]
        assert not [r for r in requests if r["state"] in ("accepted", "scheduled")]
    STATS["audits"] += 1
    return by_request


# -- campaign ---------------------------------------------------------------------------------
def test_random_kills_of_a_campaign_then_of_a_rollback(tmp_path, tmp_path_factory):
    rng = _rng()
    started = time.monotonic()
    store = make_store(tmp_path / "store", cached_model_dir(tmp_path_factory), MODEL)
    ids = train_ids(N_BATCHES)
    write_requests_csv(tmp_path / "requests.csv", [[i] for i in ids])
    spec = write_yaml(tmp_path / "campaign.yaml", {
        "name": "random-kills", "model": {"store": str(store), "name": MODEL}, "method": METHOD_FAST,
        "batch_size": 1, "seed": 3, "limits": {"budget": {"epsilon": 1000.0, "delta": 0.01, "composition": "basic"},
                                               "retain_accuracy_margin": None},
        "requests": "requests.csv",
    })
    ledger = store / "ledger.sqlite3"
    argv = unlearn_argv("campaign", "resume", str(spec), "--no-progress")
    kills, progress, done = 0, [], None
    for attempt in range(60):
        if kills < MIN_KILLS:
            killed, done = _run_and_kill_in_work(argv, ledger, rng)
        else:
            killed, done = _run_and_maybe_kill(argv, 600)
        states = audit(store, ledger, final=False)
        progress.append(sum(s == "applied" for s in states.values()))
        if not killed:
            break
        kills += 1
    assert done is not None and done.returncode == 0, (done.stdout + done.stderr) if done else "never finished"
    states = audit(store, ledger, final=True)
    assert states == {f"r{k}": "applied" for k in range(N_BATCHES)}
    assert kills >= MIN_KILLS, (kills, progress)
    # the kills fell while batches were being applied, not only before the first one
    assert len({p for p in progress[:-1]}) >= 4, progress
    from pipeline.store.versions import VersionStore

    assert VersionStore(store).current(MODEL) == N_BATCHES
    STATS["campaign kills survived"] += kills
    print(f"campaign: {kills} kills survived, applied after each life: {progress}")

    # -- versions rollback, killed at random moments until it completes ---------------------------
    target = 15
    roll = unlearn_argv("versions", "rollback", "--store", str(store), "--model", MODEL, str(target), "--reason", "audit")
    rollback_kills = 0
    for attempt in range(30):
        if rollback_kills == 0:  # 0-30 ms after it moved CURRENT: in or just past the window before the ledger follows
            killed, result = _run_and_kill_after_pointer_move(roll, store / MODEL / "CURRENT", rng.uniform(0.0, 0.03))
        else:
            killed, result = _run_and_maybe_kill(roll, rng.uniform(0.8, 3.5) if rollback_kills < 2 else 600)
        audit(store, ledger, final=False)
        if not killed:
            assert result.returncode == 0 or "not older than the current version" in result.stderr, result.stderr
            break
        rollback_kills += 1
    states = audit(store, ledger, final=True)
    vs = VersionStore(store)
    assert vs.current(MODEL) == target
    version_of = {r["request_id"]: r["version"] for r in _ledger(ledger)[0]}
    assert all((states[f"r{k}"] == "applied") == (k < target) for k in range(N_BATCHES)), states
    assert all(states[f"r{k}"] == "needs_retrain" for k in range(target, N_BATCHES))
    assert all(version_of[f"r{k}"] == k + 1 for k in range(target))
    STATS["rollback kills survived"] += rollback_kills
    print(f"rollback: {rollback_kills} kills survived; total {time.monotonic() - started:.0f} s; {dict(STATS)}")


# -- stream service ---------------------------------------------------------------------------
def _serve(config: Path, port_file: Path) -> tuple[subprocess.Popen, int | None]:
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen(unlearn_argv("stream", "serve", "--config", str(config)), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, None


def _wait_port(proc: subprocess.Popen, port_file: Path, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the service did not start"
        time.sleep(0.05)
    return int(port_file.read_text())


def test_random_kills_of_the_stream_service_during_its_batches(tmp_path, tmp_path_factory):
    rng = _rng()
    store = make_store(tmp_path / "store", cached_model_dir(tmp_path_factory), MODEL)
    port_file = tmp_path / "port"
    config = write_yaml(tmp_path / "service.yaml", {
        "model": {"store": str(store), "name": MODEL}, "method": METHOD_FAST, "seed": 9, "port": 0,
        "port_file": str(port_file), "limits": {"budget": {"epsilon": 1000.0, "delta": 0.01, "composition": "basic"},
                                                "retain_accuracy_margin": None},
        "auth": {"clients": [{"client": "t", "token_env": "UNLEARN_KILL_TOKEN"}]},
        "batching": {"max_requests": 2, "max_wait_s": 0.1},
    })
    ledger = store / "ledger.sqlite3"
    ids = train_ids(9)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    acknowledged: set[str] = set()
    kills = 0
    for life in range(3):
        proc, _ = _serve(config, port_file)
        port = _wait_port(proc, port_file)
        for k in range(3 * life, 3 * life + 3):  # three new requests per life, each acknowledged (202)
            code, body = http_json(port, "POST", "/v1/requests",
                                   {"request_id": f"s{k}", "subject": "x", "sample_ids": [ids[k]]}, headers)
            assert code == 202, body
            acknowledged.add(f"s{k}")
        time.sleep(rng.uniform(0.05, 1.5))  # somewhere inside the micro-batches
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        kills += 1
        states = audit(store, ledger, final=False)
        assert acknowledged <= set(states), "an acknowledged request was lost"
        STATS["stream kills inside a batch"] += any(b["state"] == "scheduled" for b in _ledger(ledger)[1])
    proc, _ = _serve(config, port_file)
    _wait_port(proc, port_file)
    wait_applied(ledger, acknowledged)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    states = audit(store, ledger, final=True)
    assert states == {r: "applied" for r in acknowledged} and len(acknowledged) == 9
    STATS["stream kills survived"] += kills
    print(f"stream: {kills} kills survived; {dict(STATS)}")
