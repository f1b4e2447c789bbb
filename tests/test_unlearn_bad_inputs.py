"""Bad input across the CLI, the campaign spec, the request files and the HTTP API: each gets a
clear error (naming the field or the fix) and a non-zero exit or a 4xx status, and leaves the
ledger rows and the version store exactly as they were (compared by checksum)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from click.testing import CliRunner

import jobs.campaign
import jobs.ledger
import jobs.stream
import jobs.submit
import jobs.versions
from jobs.campaign_runner import run_campaign
from jobs.service import UnlearnService
from jobs.specs import CampaignSpec, ServiceConfig, load_spec
from pipeline.store.ledger import Ledger
from pipeline.store.versions import VersionStore
from tests.unlearn_store_support import (
    METHOD_FAST as METHOD, cached_model_dir, http_json, make_store, train_ids, write_requests_csv, write_yaml,
)

MODEL, HTTP_MODEL, LIMITED_MODEL = "digits", "http-model", "limited-model"
TOKEN = "bad-input-token-0123456789"
IDS = train_ids(40)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Any]:
    """A store with three models; MODEL already has one applied campaign (so the ledger has rows)."""
    tmp = tmp_path_factory.mktemp("bad-inputs")
    model_dir = cached_model_dir(tmp_path_factory)
    store = make_store(tmp / "store", model_dir, MODEL)
    make_store(store, model_dir, HTTP_MODEL)
    make_store(store, model_dir, LIMITED_MODEL)
    write_requests_csv(tmp / "first.csv", [IDS[0:2]], prefix="first-")
    base = {"name": "first", "model": {"store": str(store), "name": MODEL}, "method": METHOD, "batch_size": 1,
            "seed": 3, "limits": {"budget": {"epsilon": 100.0}}, "requests": "first.csv"}
    run_campaign(load_spec(write_yaml(tmp / "first.yaml", base), CampaignSpec), progress=False, echo=lambda _: None)
    return {"tmp": tmp, "store": store, "base": base, "model_dir": model_dir}


def snapshot(store: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(every ledger file - the store's own and each one recorded in a model's LEDGERS - with the
    checksum of all its rows; every other path under the store with its content's sha256). A
    ledger's SQLite bytes (and its -wal/-shm files) change when it is merely read, so a ledger is
    compared by its rows, and by its existence."""
    from pipeline.checkpoint import sha256_of

    ledgers = {store / "ledger.sqlite3"}
    for listed in store.glob("*/LEDGERS"):
        ledgers |= {Path(p) for p in json.loads(listed.read_text())}
    rows = []
    for path in sorted(ledgers):
        if not path.is_file():
            rows.append((str(path), "absent"))
            continue
        ledger = Ledger(path, create=False)
        try:
            rows.append((str(path), ledger.fingerprint()))
        finally:
            ledger.close()
    files = [(str(p.relative_to(store)), sha256_of(p) if p.is_file() else "dir")
             for p in sorted(store.rglob("*")) if not p.name.startswith("ledger.sqlite3")]
    return rows, files


def _spec(world, tmp_path: Path, csv_text: str | None = None, **overrides: Any) -> Path:
    """A valid spec (two fresh requests) with the given fields replaced, or the given CSV text."""
    spec = {**world["base"], "name": "second", "requests": str(tmp_path / "req.csv"), **overrides}
    spec = {k: v for k, v in spec.items() if v is not None}
    if csv_text is not None:
        (tmp_path / "req.csv").write_text(csv_text)
    else:
        write_requests_csv(tmp_path / "req.csv", [IDS[10:12], IDS[12:14]])
    return write_yaml(tmp_path / "spec.yaml", spec)


def _raw_spec(tmp_path: Path, text: str) -> Path:
    (tmp_path / "spec.yaml").write_text(text)
    return tmp_path / "spec.yaml"


def _tampered_store(world, tmp_path: Path) -> Path:
    """A copy of the store whose current version's weights have one flipped byte."""
    copy = shutil.copytree(world["store"], tmp_path / "store-copy")
    vs = VersionStore(copy)
    weights = vs.version_dir(MODEL, vs.current(MODEL)) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    return copy


def _service_yaml(tmp_path: Path, world, **overrides: Any) -> Path:
    cfg = {"model": {"store": str(world["store"]), "name": HTTP_MODEL}, "port": 0,
           "auth": {"clients": [{"client": "c", "token": TOKEN}]}, **overrides}
    return write_yaml(tmp_path / "service.yaml", cfg)


HEADER = "request_id,subject,sample_ids\n"
# (name, group, args builder, expected fragment of the message)
CLI_CASES: list[tuple[str, Any, Callable[[Any, Path], list[str]], str]] = [
    ("malformed YAML", jobs.campaign.command, lambda w, t: ["run", str(_raw_spec(t, "name: [oops\nbatch_size: 2\n"))], "not valid YAML"),
    ("YAML not a mapping", jobs.campaign.command, lambda w, t: ["run", str(_raw_spec(t, "- a\n- b\n"))], "must be a YAML mapping"),
    ("unknown spec field", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, colour="red"))], "colour: unknown field; remove it"),
    ("negative batch size", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, batch_size=-2))], "batch_size: Input should be greater than 0"),
    ("wrong type", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, batch_size="two"))], "batch_size: Input should be a valid integer"),
    ("missing field", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, batch_size=None))], "batch_size"),
    ("unknown method", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, method={"name": "magic"}))], "method 'magic' is unknown"),
    ("bad method settings", jobs.campaign.command,
     lambda w, t: ["run", str(_spec(w, t, method={"name": "lfoci-newton", "settings": {"epsilon": -1}}))], "settings.epsilon"),
    ("bad composition rule", jobs.campaign.command,
     lambda w, t: ["run", str(_spec(w, t, limits={"budget": {"composition": "fancy"}}))], "limits.budget.composition"),
    ("unknown model", jobs.campaign.command,
     lambda w, t: ["run", str(_spec(w, t, model={"store": str(w["store"]), "name": "ghost"}))], "model 'ghost' is not in the version store"),
    ("path-like model name", jobs.campaign.command,
     lambda w, t: ["run", str(_spec(w, t, model={"store": str(w["store"]), "name": "../digits"}))], "model.name"),
    ("missing store", jobs.campaign.command,
     lambda w, t: ["run", str(_spec(w, t, model={"store": str(t / "nowhere"), "name": MODEL}))], "does not exist"),
    ("missing request file", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, requests=str(t / "none.csv")))], "does not exist"),
    ("malformed CSV", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, HEADER + 'a,b,"1;2\n'))], "malformed CSV"),
    ("CSV extra cells", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, HEADER + "a,b,1,2\n"))], "more cells than columns"),
    ("CSV missing column", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, "request_id,sample_ids\na,1\n"))], "lacks columns ['subject']"),
    ("malformed JSONL", jobs.campaign.command, lambda w, t: ["run", str(_jsonl(w, t, '{"request_id": "a",\n'))], "not valid JSON"),
    ("JSONL wrong type", jobs.campaign.command,
     lambda w, t: ["run", str(_jsonl(w, t, json.dumps({"request_id": "a", "subject": "s", "sample_ids": "x"}) + "\n"))], "sample_ids"),
    ("malformed parquet", jobs.campaign.command, lambda w, t: ["run", str(_parquet(w, t))], "not a readable parquet file"),
    ("unknown file type", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, requests=str(_touch(t / "r.txt"))))], "unknown request file type"),
    ("unknown sample ids", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, HEADER + "a,s,99999\n"))], "not in the training set"),
    ("test-split sample id", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, HEADER + "a,s,5\n"))], "not in the training set"),
    ("already removed sample", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, HEADER + f"a,s,{IDS[0]}\n"))], "not in the training set"),
    ("duplicate request ids", jobs.campaign.command,
     lambda w, t: ["run", str(_spec(w, t, HEADER + f"a,s,{IDS[20]}\na,s,{IDS[21]}\n"))], "request_id 'a' already used"),
    ("duplicate sample ids", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, HEADER + f"a,s,{IDS[20]};{IDS[20]}\n"))], "duplicate sample ids"),
    ("sample in two requests", jobs.campaign.command,
     lambda w, t: ["run", str(_spec(w, t, HEADER + f"a,s,{IDS[20]}\nb,s,{IDS[20]};{IDS[21]}\n"))], "already claimed"),
    ("non-integer ids", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, HEADER + "a,s,1;two\n"))], "not an integer"),
    ("negative id", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, HEADER + "a,s,-4\n"))], "must be >= 0"),
    ("empty request list", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, HEADER))], "holds no requests"),
    ("empty sample list", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, HEADER + "a,s,\n"))], "sample_ids"),
    ("request id reused from the ledger", jobs.campaign.command,
     lambda w, t: ["run", str(_spec(w, t, HEADER + f"first-0,s,{IDS[20]}\n"))], "already submitted with different content"),
    ("existing campaign name", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, name="first"))], "already exists"),
    ("resume with another spec", jobs.campaign.command, lambda w, t: ["resume", str(_spec(w, t, name="first"))], "differs"),
    ("tampered checkpoint", jobs.campaign.command,
     lambda w, t: ["run", str(_spec(w, t, model={"store": str(_tampered_store(w, t)), "name": MODEL}))], "sha256"),
    ("check with unknown ids", jobs.campaign.command, lambda w, t: ["check", str(_spec(w, t, HEADER + "a,s,123456\n"))], "not in the training set"),
    ("rollback to a missing version", jobs.versions.command,
     lambda w, t: ["rollback", "--store", str(w["store"]), "--model", MODEL, "7", "--reason", "x"], "has no version 7"),
    ("rollback to current", jobs.versions.command,
     lambda w, t: ["rollback", "--store", str(w["store"]), "--model", MODEL, "1", "--reason", "x"], "not older than the current"),
    ("import over an existing model", jobs.versions.command,
     lambda w, t: ["import", "--store", str(w["store"]), "--model", MODEL, str(w["model_dir"])], "already has versions"),
    ("import a non-model folder", jobs.versions.command,
     lambda w, t: ["import", "--store", str(w["store"]), "--model", "newbie", str(t)], "model.json"),
    ("verify unknown model", jobs.versions.command, lambda w, t: ["verify", "--store", str(w["store"]), "--model", "ghost"], "not in the version store"),
    ("ledger show without ledger", jobs.ledger.command, lambda w, t: ["show", "--store", str(t)], "no ledger at"),
    ("ledger show unknown request", jobs.ledger.command, lambda w, t: ["show", "--store", str(w["store"]), "--request", "nope"], "not in the ledger"),
    ("service without auth", jobs.stream.command,
     lambda w, t: ["check", "--config", str(write_yaml(t / "s.yaml", {"model": {"store": str(w["store"]), "name": HTTP_MODEL}}))], "auth: required field is missing"),
    ("service token too short", jobs.stream.command,
     lambda w, t: ["check", "--config", str(_service_yaml(t, w, auth={"clients": [{"client": "c", "token": "short"}]}))], "at least 16 characters"),
    ("service token env unset", jobs.stream.command,
     lambda w, t: ["check", "--config", str(_service_yaml(t, w, auth={"clients": [{"client": "c", "token_env": "UNLEARN_NO_SUCH_VAR"}]}))], "UNLEARN_NO_SUCH_VAR is unset"),
    ("service bad port", jobs.stream.command, lambda w, t: ["check", "--config", str(_service_yaml(t, w, port=70000))], "port"),
    # issue 14.3: settings that used to pass validation and poison every batch
    ("selection names an unknown parameter", jobs.campaign.command,
     lambda w, t: ["run", str(_spec(w, t, method=_fast(selection="parameters", parameters=["nope"])))], "method.settings.parameters: ['nope']"),
    ("epsilon too large for pld", jobs.campaign.command,
     lambda w, t: ["run", str(_spec(w, t, method=_fast(epsilon=10000.0)))], "method.settings.epsilon = 10000"),
    ("epsilon NaN", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, method=_fast(epsilon=float("nan"))))], "settings.epsilon"),
    ("seed above 2^63 - 1", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, seed=2**63))], "seed: batches would use seeds"),
    ("seed + batches above 2^63 - 1", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, seed=2**63 - 1))], "outside [0, 2^63 - 1"),
    ("check with an unknown parameter", jobs.campaign.command,
     lambda w, t: ["check", str(_spec(w, t, method=_fast(selection="parameters", parameters=["nope"])))], "method.settings.parameters"),
    ("service with an unknown parameter", jobs.stream.command,
     lambda w, t: ["check", "--config", str(_service_yaml(t, w, method=_fast(selection="parameters", parameters=["0.nope"])))], "method.settings.parameters"),
    ("service seed above 2^63 - 1", jobs.stream.command, lambda w, t: ["check", "--config", str(_service_yaml(t, w, seed=2**63 - 5))], "seed"),
    ("cancel an applied batch", jobs.campaign.command,
     lambda w, t: ["cancel-batch", str(_spec(w, t, name="first", requests=str(w["tmp"] / "first.csv"))), "0", "--reason", "x"], "already applied"),
    ("cancel a batch of an unknown campaign", jobs.campaign.command,
     lambda w, t: ["cancel-batch", str(_spec(w, t, name="never")), "0", "--reason", "x"], "campaign 'never' is not in the ledger"),
    # issue 14.7: input that used to give a traceback
    ("deeply nested YAML spec", jobs.campaign.command,
     lambda w, t: ["run", str(_raw_spec(t, "name: " + "[" * 5000 + "]" * 5000 + "\n"))], "nests too deeply"),
    ("deeply nested JSONL row", jobs.campaign.command, lambda w, t: ["run", str(_jsonl(w, t, "[" * 100_000 + "]" * 100_000 + "\n"))], "too deeply"),
    ("deeply nested JSON list in a CSV cell", jobs.campaign.command,
     lambda w, t: ["run", str(_spec(w, t, HEADER + 'a,s,"' + "[" * 5000 + "]" * 5000 + '"\n'))], "sample_ids"),
    ("integer of 5000 digits in JSONL", jobs.campaign.command,
     lambda w, t: ["run", str(_jsonl(w, t, '{"request_id": "a", "subject": "s", "sample_ids": [' + "7" * 5000 + "]}\n"))], "not valid JSON"),
    ("integer of 5000 digits in CSV", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, HEADER + "a,s," + "7" * 5000 + "\n"))], "not an integer"),
    ("sample id above 2^63 - 1", jobs.campaign.command, lambda w, t: ["run", str(_spec(w, t, HEADER + "a,s," + "9" * 100 + "\n"))], "sample ids must be <= 2^63 - 1"),
    ("short token", jobs.stream.command,
     lambda w, t: ["check", "--config", str(_service_yaml(t, w, auth={"clients": [{"client": "c", "token": "hunter2"}]}))], "auth.clients.0.token"),
    # issue 14.5 / 14.6: rollback and store names
    ("rollback with a missing ledger", jobs.versions.command,
     lambda w, t: ["rollback", "--store", str(w["store"]), "--model", MODEL, "0", "--reason", "x", "--ledger", str(t / "no.sqlite3")], "does not exist"),
    ("rollback with a text file as ledger", jobs.versions.command,
     lambda w, t: ["rollback", "--store", str(w["store"]), "--model", MODEL, "0", "--reason", "x", "--ledger", str(_touch(t / "l.sqlite3"))], "not a usable SQLite"),
    ("rollback with a foreign SQLite file", jobs.versions.command,
     lambda w, t: ["rollback", "--store", str(w["store"]), "--model", MODEL, "0", "--reason", "x", "--ledger", str(_foreign_sqlite(t))], "not a ledger"),
    ("rollback of an unknown model", jobs.versions.command,
     lambda w, t: ["rollback", "--store", str(w["store"]), "--model", "ghost", "0", "--reason", "x"], "model 'ghost' is not in the version store"),
    ("import under a name with a newline", jobs.versions.command,
     lambda w, t: ["import", "--store", str(w["store"]), "--model", "newbie\n", str(w["model_dir"])], "is invalid"),
    ("import under a name with a tab", jobs.versions.command,
     lambda w, t: ["import", "--store", str(w["store"]), "--model", "new\tbie", str(w["model_dir"])], "is invalid"),
    # issue 14.8: a Ray job that would not find its files
    ("submit a forget config with a relative model path", jobs.submit.command,
     lambda w, t: ["run", "--working-dir", str(REPO), "--", "forget", "--config", str(_forget_yaml(t, "runs/models/linear-digits"))],
     "model = 'runs/models/linear-digits' is not uploaded"),
    ("submit a campaign with a relative store", jobs.submit.command,
     lambda w, t: ["run", "--working-dir", str(REPO), "--", "campaign", "run", str(_spec(w, t, model={"store": "runs/store", "name": MODEL}))],
     "model.store = 'runs/store' is relative"),
]

REPO = Path(__file__).resolve().parents[1]


def _fast(**settings: Any) -> dict[str, Any]:
    return {"name": METHOD["name"], "settings": {**METHOD["settings"], **settings}}


def _foreign_sqlite(tmp_path: Path) -> Path:
    import sqlite3

    path = tmp_path / "foreign.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE things (x)")
    conn.commit()
    conn.close()
    return path


def _forget_yaml(tmp_path: Path, model: str) -> Path:
    return write_yaml(tmp_path / "forget.yaml", {"model": model, "forget": {"sample_ids": [1]}, "output": "/tmp/out"})


def _jsonl(world, tmp_path: Path, text: str) -> Path:
    (tmp_path / "req.jsonl").write_text(text)
    return _spec(world, tmp_path, requests=str(tmp_path / "req.jsonl"))


def _parquet(world, tmp_path: Path) -> Path:
    (tmp_path / "req.parquet").write_bytes(b"PAR1 this is not parquet")
    return _spec(world, tmp_path, requests=str(tmp_path / "req.parquet"))


def _touch(path: Path) -> Path:
    path.write_text("whatever\n")
    return path


@pytest.mark.parametrize("name,group,make_args,expected", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_refused_and_changes_nothing(world, tmp_path, name, group, make_args, expected):
    args = make_args(world, tmp_path)
    before = snapshot(world["store"])
    result = CliRunner().invoke(group, args)
    assert result.exit_code == 1, result.output  # a user error (ClickException), never a crash
    assert isinstance(result.exception, SystemExit), f"unhandled {result.exception!r}"  # a clean exit, no traceback
    assert "Traceback" not in result.output
    assert expected in result.output, result.output
    assert "hunter2" not in result.output  # a token is never echoed back
    assert snapshot(world["store"]) == before
    assert not (world["store"] / "ghost").exists() and not (tmp_path / "no.sqlite3").exists()


def test_cli_user_error_in_a_real_process_has_no_traceback(world, tmp_path):
    from tests.unlearn_store_support import run_cli

    before = snapshot(world["store"])
    proc = run_cli("campaign", "run", str(_spec(world, tmp_path, batch_size=0)))
    assert proc.returncode == 1
    assert "batch_size" in proc.stderr and "Traceback" not in proc.stderr
    assert snapshot(world["store"]) == before


# -- HTTP ------------------------------------------------------------------------------------
def _post(port: int, body: bytes | dict | None, *, token: str | None = TOKEN, ctype: str = "application/json",
          path: str = "/v1/requests", method: str = "POST") -> tuple[int, dict]:
    headers = {"Content-Type": ctype, **({"Authorization": f"Bearer {token}"} if token is not None else {})}
    return http_json(port, method, path, body, headers)


@pytest.fixture(scope="module")
def http_service(world, tmp_path_factory):
    """The service in-process on 127.0.0.1 (ephemeral port); the worker never fires during the tests."""
    tmp = tmp_path_factory.mktemp("http")
    config = load_spec(_service_yaml(tmp, world, batching={"max_requests": 1000, "max_wait_s": 3600},
                                     rate_limit={"requests_per_second": 1000, "burst": 1000}), ServiceConfig)
    service = UnlearnService(config, log=lambda _: None)
    _, port = service.start()
    code, _ = _post(port, {"request_id": "claimed", "subject": "s", "sample_ids": [IDS[30]]})
    assert code == 202
    yield port
    service.stop()


GOOD = {"request_id": "fresh-1", "subject": "s", "sample_ids": [IDS[31]]}
HTTP_CASES: list[tuple[str, dict[str, Any], int, str]] = [
    ("missing token", {"body": GOOD, "token": None}, 401, "missing bearer token"),
    ("bad token", {"body": GOOD, "token": "x" * 30}, 401, "invalid bearer token"),
    ("oversize body", {"body": {**GOOD, "subject": "x" * 70_000}}, 413, "exceeds the limit"),
    ("malformed JSON", {"body": b'{"request_id": '}, 400, "not valid JSON"),
    ("JSON not an object", {"body": b"[1, 2]"}, 422, "JSON object"),
    ("wrong types", {"body": {**GOOD, "sample_ids": "abc"}}, 422, "sample_ids"),
    ("ids as strings", {"body": {**GOOD, "sample_ids": [str(IDS[31])]}}, 422, "valid integer"),
    ("extra field", {"body": {**GOOD, "model": "other"}}, 422, "model"),
    ("missing field", {"body": {"request_id": "x1", "sample_ids": [IDS[31]]}}, 422, "subject"),
    ("bad request id", {"body": {**GOOD, "request_id": "../etc"}}, 422, "request_id"),
    ("unknown sample ids", {"body": {**GOOD, "sample_ids": [99999]}}, 422, "not in the training set"),
    ("empty sample ids", {"body": {**GOOD, "sample_ids": []}}, 422, "sample_ids"),
    ("duplicate sample ids", {"body": {**GOOD, "sample_ids": [IDS[31], IDS[31]]}}, 422, "duplicate"),
    ("conflicting resubmission", {"body": {"request_id": "claimed", "subject": "other", "sample_ids": [IDS[30]]}}, 409, "different content"),
    ("sample already claimed", {"body": {**GOOD, "sample_ids": [IDS[30]]}}, 409, "already claimed"),
    ("wrong content type", {"body": json.dumps(GOOD).encode(), "ctype": "text/plain"}, 415, "application/json"),
    ("unknown request", {"body": None, "path": "/v1/requests/nope", "method": "GET"}, 404, "no request 'nope'"),
    ("unknown path", {"body": None, "path": "/v2/things", "method": "GET"}, 404, "no endpoint"),
    ("wrong method", {"body": None, "path": "/v1/versions", "method": "DELETE"}, 405, "use GET"),
    ("deeply nested body", {"body": b"[" * 5000 + b"]" * 5000}, 400, "nests deeper than"),
    ("deeply nested field", {"body": b'{"request_id": "n1", "subject": "s", "sample_ids": ' + b"[" * 3000 + b"]" * 3000 + b"}"}, 400, "nests deeper than"),
    ("integer of 5000 digits", {"body": b'{"request_id": "d1", "subject": "s", "sample_ids": [' + b"7" * 5000 + b"]}"}, 400, "not valid JSON"),
    ("sample id above 2^63 - 1", {"body": {**GOOD, "sample_ids": [2**70]}}, 422, "2^63 - 1"),
]


@pytest.mark.parametrize("name,kwargs,status,expected", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input_is_refused_and_changes_nothing(world, http_service, name, kwargs, status, expected):
    before = snapshot(world["store"])
    code, payload = _post(http_service, **kwargs)
    assert code == status, payload
    assert expected in payload["error"]["message"]
    assert snapshot(world["store"]) == before


def test_http_rate_limit_per_client(world, tmp_path):
    config = load_spec(_service_yaml(tmp_path, world, model={"store": str(world["store"]), "name": LIMITED_MODEL},
                                     rate_limit={"requests_per_second": 0.01, "burst": 2}), ServiceConfig)
    service = UnlearnService(config, log=lambda _: None)
    _, port = service.start()
    try:
        codes = [_post(port, None, path="/v1/versions", method="GET")[0] for _ in range(2)]
        before = snapshot(world["store"])
        code, payload = _post(port, {"request_id": "limited-1", "subject": "s", "sample_ids": [IDS[35]]})
        assert codes == [200, 200] and code == 429 and "rate limit" in payload["error"]["message"]
        assert snapshot(world["store"]) == before
    finally:
        service.stop()


def test_http_rate_limit_of_1e_320_per_second_gives_a_finite_retry_after(world, tmp_path):
    """requests_per_second: 1e-320 makes (1 - tokens) / rate infinite: a 429 with a bounded
    Retry-After, never int(inf) and a 500."""
    import urllib.error
    import urllib.request

    config = load_spec(_service_yaml(tmp_path, world, model={"store": str(world["store"]), "name": LIMITED_MODEL},
                                     rate_limit={"requests_per_second": 1e-320, "burst": 1}), ServiceConfig)
    service = UnlearnService(config, log=lambda _: None)
    _, port = service.start()
    try:
        assert _post(port, None, path="/v1/versions", method="GET")[0] == 200
        before = snapshot(world["store"])
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/versions", headers={"Authorization": f"Bearer {TOKEN}"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req, timeout=30)
        assert caught.value.code == 429
        assert 1 <= int(caught.value.headers["Retry-After"]) <= 86_400
        assert "rate limit" in json.loads(caught.value.read())["error"]["message"]
        assert snapshot(world["store"]) == before
    finally:
        service.stop()


def test_a_campaign_with_a_new_ledger_path_creates_nothing_when_its_requests_are_bad(world, tmp_path):
    new_ledger = tmp_path / "fresh" / "ledger.sqlite3"
    before = snapshot(world["store"])
    result = CliRunner().invoke(jobs.campaign.command, ["run", str(_spec(world, tmp_path, HEADER + "a,s,99999\n", ledger=str(new_ledger)))])
    assert result.exit_code == 1 and "not in the training set" in result.output
    assert not new_ledger.parent.exists() and snapshot(world["store"]) == before


def test_every_listed_bad_input_is_covered():
    """The closing note's count: bad inputs tried by this module."""
    assert len(CLI_CASES) >= 70 and len(HTTP_CASES) >= 23
