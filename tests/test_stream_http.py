"""The stream service's serving stack (jobs/http_api.py: FastAPI on uvicorn), on real servers on
127.0.0.1: slow clients that trickle header bytes neither block authenticated requests nor keep
SIGTERM from stopping a `stream serve` subprocess; the header deadline drops them; per-client
ownership of requests; plain HTTP refused beyond loopback; TLS; health, readiness, OpenAPI."""
from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest

from jobs.service import UnlearnService
from jobs.specs import ServiceConfig, load_spec
from pipeline.config import ConfigError
from tests.unlearn_store_support import (
    METHOD_FAST, REPO, cached_model_dir, http_json, make_store, train_ids, unlearn_argv, write_yaml,
)

MODEL = "faces"
TOKEN_A = "token-a-0123456789abcdef"
TOKEN_B = "token-b-0123456789abcdef"
IDS = train_ids(40)


def _config(tmp: Path, store: Path, **overrides) -> Path:
    cfg = {
        "model": {"store": str(store), "name": MODEL}, "method": METHOD_FAST, "seed": 1,
        "limits": {"budget": {"epsilon": 1000.0}},
        "host": "127.0.0.1", "port": 0, "port_file": str(tmp / "port"),
        "auth": {"clients": [{"client": "alpha", "token": TOKEN_A}, {"client": "beta", "token": TOKEN_B}]},
        "batching": {"max_requests": 1000, "max_wait_s": 3600},  # the worker stays idle in these tests
        "rate_limit": {"requests_per_second": 10000, "burst": 10000},
    }
    cfg.update(overrides)
    return write_yaml(tmp / "service.yaml", cfg)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return make_store(tmp_path_factory.mktemp("store") / "store", cached_model_dir(tmp_path_factory), MODEL)


def _call(port: int, method: str, path: str, body: dict | None = None, token: str | None = TOKEN_A):
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return http_json(port, method, path, body, headers)


@pytest.fixture()
def service(tmp_path, store):
    svc = UnlearnService(load_spec(_config(tmp_path, store, http={"header_timeout_s": 1.0}), ServiceConfig),
                         log=lambda _: None)
    _, port = svc.start()
    yield svc, port
    svc.stop()


# ----------------------------------------------------------------------------------------------
def test_health_readiness_and_openapi(service):
    svc, port = service
    assert http_json(port, "GET", "/healthz")[0] == 200  # public: probes carry no token
    code, ready = http_json(port, "GET", "/readyz")
    assert code == 200 and ready["ready"] is True
    code, schema = http_json(port, "GET", "/openapi.json")
    assert code == 200 and schema["openapi"].startswith("3.")
    paths = schema["paths"]
    assert {"/v1/requests", "/v1/requests/{request_id}", "/v1/versions", "/healthz", "/readyz"} <= set(paths)
    body = paths["/v1/requests"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"request_id", "subject", "sample_ids"} <= set(body["properties"])
    assert http_json(port, "GET", "/docs")[0] == 401  # everything else needs a token (no CDN pages)
    svc.stop()
    assert svc.readiness() == (False, "starting or stopping")
    with pytest.raises(OSError):  # the listener is closed
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_requests_belong_to_their_client(service):
    _, port = service
    mine = {"request_id": "alpha-1", "subject": "s1", "sample_ids": [IDS[0], IDS[1]]}
    assert _call(port, "POST", "/v1/requests", mine)[0] == 202
    assert _call(port, "POST", "/v1/requests", mine)[0] == 200  # the owner's resubmission: idempotent
    code, own = _call(port, "GET", "/v1/requests/alpha-1")
    assert code == 200 and own["request_id"] == "alpha-1" and own["sample_ids"] == [IDS[0], IDS[1]]

    # another client: the request does not exist for it (same answer as for an unknown id)
    code, theirs = _call(port, "GET", "/v1/requests/alpha-1", token=TOKEN_B)
    code_none, none = _call(port, "GET", "/v1/requests/no-such-id", token=TOKEN_B)
    assert code == code_none == 404
    assert theirs["error"]["message"] == none["error"]["message"].replace("no-such-id", "alpha-1")
    # reusing the id, even with identical content, is a conflict that shows nothing of alpha's request
    code, clash = _call(port, "POST", "/v1/requests", mine, token=TOKEN_B)
    assert code == 409 and "already in use" in clash["error"]["message"]
    assert "state" not in clash and "s1" not in clash["error"]["message"]
    # claiming alpha's sample: 409 naming the sample (beta's own input), never alpha's request id
    code, claimed = _call(port, "POST", "/v1/requests",
                          {"request_id": "beta-1", "subject": "s2", "sample_ids": [IDS[1], IDS[2]]}, token=TOKEN_B)
    assert code == 409 and "already claimed" in claimed["error"]["message"]
    assert str(IDS[1]) in claimed["error"]["message"] and "alpha-1" not in str(claimed)
    # beta's own request is beta's
    assert _call(port, "POST", "/v1/requests", {"request_id": "beta-2", "subject": "s3", "sample_ids": [IDS[3]]},
                 token=TOKEN_B)[0] == 202
    assert _call(port, "GET", "/v1/requests/beta-2", token=TOKEN_B)[0] == 200
    assert _call(port, "GET", "/v1/requests/beta-2")[0] == 404


def _trickler(port: int, count: int, stop: threading.Event, every_s: float) -> tuple[list[socket.socket], threading.Thread]:
    """``count`` connections that send a request line and then one header byte every ``every_s``."""
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /v1/versions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(s)

    def trickle() -> None:
        while not stop.wait(every_s):
            for s in socks:
                try:
                    s.send(b"a")
                except OSError:
                    pass

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    return socks, t


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError:  # reset
        return True


def test_header_deadline_drops_trickling_clients(service):
    """Bytes trickled every 0.2 s do not extend the 1 s header deadline."""
    _, port = service
    stop = threading.Event()
    socks, t = _trickler(port, 5, stop, 0.2)
    try:
        start = time.monotonic()
        assert all(_closed_by_server(s, 5.0) for s in socks)
        assert time.monotonic() - start < 4.0
        assert _call(port, "GET", "/v1/versions")[0] == 200
    finally:
        stop.set()
        t.join()
        for s in socks:
            s.close()


def test_slow_clients_do_not_block_requests_and_sigterm_stops_the_service(tmp_path, store):
    port_file = tmp_path / "port"
    config = _config(tmp_path, store, http={"header_timeout_s": 30.0, "shutdown_timeout_s": 2.0})
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(unlearn_argv("stream", "serve", "--config", str(config)), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop = threading.Event()
    socks: list[socket.socket] = []
    t = None
    try:
        deadline = time.monotonic() + 90
        while not port_file.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.1)
        port = int(port_file.read_text())
        socks, t = _trickler(port, 200, stop, 0.5)
        time.sleep(1.0)  # the slow clients are connected and trickling
        for k in range(10):
            t0 = time.monotonic()
            code, _ = _call(port, "GET", "/v1/versions", token=TOKEN_A if k % 2 else TOKEN_B)
            assert code == 200 and time.monotonic() - t0 < 5.0
        code, _ = _call(port, "POST", "/v1/requests", {"request_id": "slow-1", "subject": "s", "sample_ids": [IDS[20]]})
        assert code == 202
        assert not any(_closed_by_server(s, 0.01) for s in socks[:20])  # still connected
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
        assert proc.returncode == 0, out + err
        assert took < 10.0, f"SIGTERM took {took:.1f} s with 200 slow clients connected"
        assert "received SIGTERM" in err and "stopped" in err
    finally:
        stop.set()
        if t is not None:
            t.join()
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# ----------------------------------------------------------------------------------------------
def test_plain_http_beyond_loopback_is_refused(tmp_path, store):
    with pytest.raises(ConfigError, match=r"host '0\.0\.0\.0'.*tls.*allow_insecure_remote"):
        load_spec(_config(tmp_path, store, host="0.0.0.0"), ServiceConfig)
    with pytest.raises(ConfigError, match="not a loopback address"):
        load_spec(_config(tmp_path, store, host="example.org"), ServiceConfig)
    ok = load_spec(_config(tmp_path, store, host="0.0.0.0", allow_insecure_remote=True), ServiceConfig)
    assert ok.allow_insecure_remote
    assert load_spec(_config(tmp_path, store, host="::1"), ServiceConfig).host == "::1"
    # the CLI says why and exits non-zero, binding nothing
    proc = subprocess.run(unlearn_argv("stream", "serve", "--config", str(_config(tmp_path, store, host="0.0.0.0"))),
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "allow_insecure_remote" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "port").exists()


def test_tls(tmp_path, store):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    svc = UnlearnService(load_spec(_config(tmp_path, store, tls={"certfile": str(cert), "keyfile": str(key)}),
                                   ServiceConfig), log=lambda _: None)
    _, port = svc.start()
    try:
        import http.client
        import json

        ctx = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
        conn.request("GET", "/v1/versions", headers={"Authorization": f"Bearer {TOKEN_A}"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["model"] == MODEL
        conn.close()
        with pytest.raises(Exception):  # plain HTTP on the TLS port gets no answer
            http_json(port, "GET", "/v1/versions", None, {"Authorization": f"Bearer {TOKEN_A}"})
    finally:
        svc.stop()
