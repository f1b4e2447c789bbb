"""The stream service as a real server on 127.0.0.1 (a `stream serve` subprocess): 200 requests
from concurrent clients are all recorded and applied once, in arrival order, in a handful of
published versions; every unauthenticated request is refused; SIGTERM drains the batch in flight
and a restart applies what was still pending."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.unlearn_store_support import (
    METHOD_FAST, REPO, cached_model_dir, http_json, make_store, train_ids, unlearn_argv, write_yaml,
)

MODEL = "faces"
TOKEN = "test-token-0123456789abcdef"
N = 200


def _http(port: int, method: str, path: str, body: dict | None = None, token: str | None = TOKEN,
          auth_header: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if auth_header is not None:
        headers["Authorization"] = auth_header
    elif token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return http_json(port, method, path, body, headers)


def _start(config: Path, port_file: Path) -> tuple[subprocess.Popen, int]:
    port_file.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "UNLEARN_TEST_TOKEN": TOKEN}
    proc = subprocess.Popen(unlearn_argv("stream", "serve", "--config", str(config)), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not port_file.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the service exited: {proc.communicate()}")
        assert time.monotonic() < deadline, "the service did not start"
        time.sleep(0.1)
    return proc, int(port_file.read_text())


def _states(ledger: Path) -> dict[str, tuple[str, int | None, int]]:
    conn = sqlite3.connect(ledger)
    try:
        return {r[0]: (r[1], r[2], r[3]) for r in conn.execute("SELECT request_id, state, version, seq FROM requests")}
    finally:
        conn.close()


def _wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    return err


@pytest.fixture()
def service_config(tmp_path, tmp_path_factory) -> tuple[Path, Path, Path]:
    store = make_store(tmp_path / "store", cached_model_dir(tmp_path_factory), MODEL)
    port_file = tmp_path / "port"
    config = write_yaml(tmp_path / "service.yaml", {
        # the plumbing under test (HTTP, auth, batching, order, SIGTERM) does not depend on the block
        # selection: the removal on a fixed block (METHOD_FAST), not 40 perturbations per batch
        "model": {"store": str(store), "name": MODEL}, "method": METHOD_FAST, "seed": 5,
        "limits": {"budget": {"epsilon": 1000.0}},
        "host": "127.0.0.1", "port": 0, "port_file": str(port_file),
        "auth": {"clients": [{"client": "intake", "token_env": "UNLEARN_TEST_TOKEN"}]},
        "batching": {"max_requests": 50, "max_wait_s": 0.5},
        "rate_limit": {"requests_per_second": 10000, "burst": 10000},
    })
    return config, port_file, store


def test_stream_service_applies_concurrent_requests_once_in_order(service_config):
    config, port_file, store = service_config
    ledger = store / "ledger.sqlite3"
    ids = train_ids(N)
    bodies = [{"request_id": f"req-{k:03d}", "subject": f"person-{k}", "sample_ids": [ids[k]]} for k in range(N)]

    proc, port = _start(config, port_file)
    try:
        # 1. unauthenticated requests: every one refused, nothing recorded
        refused = [{}, {"Authorization": ""}, {"Authorization": "Bearer"}, {"Authorization": "Bearer wrong-token-000000000000"},
                   {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": f"Bearer {TOKEN[:-1]}"},
                   {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": TOKEN}]
        calls = [(m, p, b) for m, p, b in (("POST", "/v1/requests", bodies[0]), ("GET", "/v1/versions", None),
                                           ("GET", "/v1/requests/req-000", None), ("GET", "/v1/nothing", None))]
        attempts = [(call, h) for call in calls for h in refused] * 3
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda a: http_json(port, a[0][0], a[0][1], a[0][2], a[1])[0], attempts))
        assert codes == [401] * len(codes)
        assert not ledger.exists() or _states(ledger) == {}

        # 2. 200 requests from 8 concurrent clients: all acknowledged (202) once committed
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda b: _http(port, "POST", "/v1/requests", b), bodies))
        assert [code for code, _ in results] == [202] * N, Counter(code for code, _ in results)
        assert all(payload["state"] in ("accepted", "scheduled", "applied") for _, payload in results)
        # 3. SIGTERM once a batch is in flight: the batch is finished, nothing is left half-done
        _wait_until(lambda: any(s != "accepted" for s, _, _ in _states(ledger).values()), 60, "a first batch")
        log = _stop(proc)
        assert "received SIGTERM; finishing the batch in flight" in log and "stopped" in log
    finally:
        if proc.poll() is None:
            proc.kill()
    after_stop = _states(ledger)
    assert len(after_stop) == N
    assert "scheduled" not in {s for s, _, _ in after_stop.values()}, Counter(s for s, _, _ in after_stop.values())
    assert {s for s, _, _ in after_stop.values()} <= {"applied", "accepted"}

    # 4. restart: the pending requests are applied; versions are published in order
    proc, port = _start(config, port_file)
    try:
        _wait_until(lambda: all(s == "applied" for s, _, _ in _states(ledger).values()), 180, "all requests applied")
        code, again = _http(port, "POST", "/v1/requests", bodies[7])  # identical resubmission: idempotent
        assert code == 200 and again["state"] == "applied"
        code, conflict = _http(port, "POST", "/v1/requests", {**bodies[7], "subject": "someone else"})
        assert code == 409
        code, one = _http(port, "GET", "/v1/requests/req-123")
        assert code == 200 and one["state"] == "applied" and one["version"] >= 1
        code, listing = _http(port, "GET", "/v1/versions")
        assert code == 200
        _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()

    final = _states(ledger)
    assert len(final) == N and all(s == "applied" for s, _, _ in final.values())
    versions = [v["version"] for v in listing["versions"]]
    assert versions == list(range(len(versions))) and listing["current"] == versions[-1]
    assert 2 <= len(versions) - 1 <= 20, "micro-batches of up to 50 requests / 0.5 s"
    manifests = [json.loads((store / MODEL / "versions" / f"{v:06d}" / "manifest.json").read_text()) for v in versions[1:]]
    assert [m["parent"] for m in manifests] == versions[:-1]
    batched = [rid for m in manifests for rid in m["batch"]["request_ids"]]
    assert sorted(batched) == sorted(b["request_id"] for b in bodies) and len(batched) == len(set(batched)) == N
    seqs = [[final[rid][2] for rid in m["batch"]["request_ids"]] for m in manifests]
    assert all(s == sorted(s) for s in seqs) and all(max(a) < min(b) for a, b in zip(seqs, seqs[1:])), "arrival order"
    for m, v in zip(manifests, versions[1:]):
        assert all(final[rid][1] == v for rid in m["batch"]["request_ids"])
        assert len(m["batch"]["request_ids"]) <= 50
