"""Deletion receipts (pipeline/store/receipts.py, `unlearn receipt`) on a real store and ledger:
a linear model trained by the `unlearn train` code path, imported as version 0, and a campaign
that applies three requests as versions 1, 2, 3 with lfoci-newton (epsilon 2: noise is added)."""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import jobs.receipt
import jobs.versions
from jobs.campaign_runner import run_campaign
from jobs.specs import CampaignSpec, load_spec
from pipeline.data.requests import DeletionRequest
from pipeline.store import receipts
from pipeline.store.ledger import Ledger
from pipeline.store.receipts import ReceiptStatus
from pipeline.store.versions import VersionStore
from tests.unlearn_store_support import METHOD_FAST, REPO, make_store, train_ids, write_requests_csv, write_yaml

IDS = train_ids(12)
GROUPS = {"c-0": IDS[0:2], "c-1": IDS[2:4], "c-2": IDS[4:7]}  # applied as versions 1, 2, 3
NO_KEY = {receipts.KEY_ENV: None, receipts.KEY_FILE_ENV: None}


@pytest.fixture(scope="module")
def world(tmp_path_factory, trained_model_dir):
    """The store (v0 imported, v1-v3 applied by a campaign), its ledger with one request each
    accepted, scheduled and failed, and a receipt key file with its public key."""
    root = tmp_path_factory.mktemp("receipts")
    store = make_store(root / "store", trained_model_dir("linear"), "m")
    write_requests_csv(root / "c.csv", list(GROUPS.values()), prefix="c-")
    spec = {"name": "c", "model": {"store": str(store), "name": "m"}, "method": METHOD_FAST, "batch_size": 1,
            "seed": 1, "requests": "c.csv", "limits": {"budget": {"epsilon": 100}}}
    result = run_campaign(load_spec(write_yaml(root / "c.yaml", spec), CampaignSpec), progress=False, echo=lambda _: None)
    assert [b.state for b in result.batches] == ["applied"] * 3
    led = Ledger(store / "ledger.sqlite3")
    led.submit("m", DeletionRequest(request_id="pending", subject="p", sample_ids=(IDS[7],)), origin="test")
    led.submit("m", DeletionRequest(request_id="sched", subject="s", sample_ids=(IDS[8],)), origin="test")
    led.schedule_batch(batch_key="test:0", model="m", origin="test", index=0, request_ids=["sched"], parent_version=3, seed=0)
    led.submit("m", DeletionRequest(request_id="broke", subject="b", sample_ids=(IDS[9],)), origin="test")
    led.schedule_batch(batch_key="test:1", model="m", origin="test", index=1, request_ids=["broke"], parent_version=3, seed=0)
    led.finish_batch("test:1", "failed", reason="the removal failed: test")
    led.close()
    key_file = root / "keys" / "receipt.pem"
    key_file.parent.mkdir()
    runner = CliRunner()
    out = runner.invoke(jobs.receipt.command, ["keygen", "--out", str(key_file)])
    assert out.exit_code == 0, out.output
    env = {receipts.KEY_ENV: None, receipts.KEY_FILE_ENV: str(key_file)}
    out = runner.invoke(jobs.receipt.command, ["public-key", "--out", str(root / "keys" / "public.pem")], env=env)
    assert out.exit_code == 0, out.output
    key = receipts.private_key_from_text(key_file.read_bytes(), "test")
    return {"root": root, "store": store, "key_file": key_file, "key": key, "env": env,
            "public": root / "keys" / "public.pem"}


def _issue(world, rid: str, store: Path | None = None) -> dict:
    vs, led = VersionStore(store or world["store"]), Ledger((store or world["store"]) / "ledger.sqlite3", create=False)
    try:
        return receipts.issue(vs, led, "m", rid, world["key"])
    finally:
        led.close()


def _cli(world, *args: str, env: dict | None = None):
    return CliRunner().invoke(jobs.receipt.command, list(args), env={**world["env"], **(env or {})})


# -- offline ------------------------------------------------------------------------------------
def test_receipt_verifies_offline_elsewhere_with_the_public_key_alone(world, tmp_path):
    out = tmp_path / "issued" / "c-1.json"
    result = _cli(world, "export", "--store", str(world["store"]), "--model", "m", "--request-id", "c-1", "--out", str(out))
    assert result.exit_code == 0, result.output
    body = json.loads(out.read_text())["body"]
    assert body["request_id"] == "c-1" and body["model"] == "m"
    assert (body["version_before"]["version"], body["version_after"]["version"]) == (1, 2)
    assert body["version_after"]["manifest_sha256"] == hashlib.sha256(
        (world["store"] / "m" / "versions" / "000002" / "manifest.json").read_bytes()).hexdigest()
    assert body["method"]["name"] == "lfoci-newton" and body["method"]["settings"]["epsilon"] == 2.0
    assert body["guarantee"]["kind"] == "heuristic" and body["guarantee"]["epsilon"] == 2.0
    assert body["checks"]["retain_accuracy"] > 0.9 and "retain_accuracy_drop" in body["checks"]
    assert body["signer"]["public_key_sha256"] == receipts.fingerprint(world["key"])
    assert len(bytes.fromhex(body["salt"])) >= 16 and body["removed_samples"]["count"] == 2
    assert "subject-1" not in out.read_text()  # the subject is personal data: only its salted hash

    elsewhere = tmp_path / "auditor"
    elsewhere.mkdir()
    shutil.copy(out, elsewhere / "receipt.json")
    shutil.copy(world["public"], elsewhere / "signer.pem")
    (elsewhere / "signer.hex").write_text(receipts.public_key_text(world["key"], "hex"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNLEARN_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "jobs.cli", "receipt", "verify", "receipt.json", "--public-key", "signer.pem"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: signature" in done.stdout and "receipt.json: ok (signature only; no --store given)" in done.stdout
    hexed = receipts.verify(json.loads((elsewhere / "receipt.json").read_text()), (elsewhere / "signer.hex").read_text())
    assert hexed.status is ReceiptStatus.OK, hexed


def _mutations(value):
    """Ways to change one value of the body (each must break the signature)."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, (int, float)):
        return [value + 1]
    if isinstance(value, str):
        return [value[:-1] + ("0" if value[-1:] != "0" else "1"), value + " "]
    if isinstance(value, list):
        return [value[:-1], value + value[:1]] if value else [["x"]]
    if isinstance(value, dict):
        key = sorted(value)[0]
        return [{k: v for k, v in value.items() if k != key}, {**value, "extra": 1},
                *({**value, key: m} for m in _mutations(value[key]))]
    return ["x"]


def test_any_change_to_the_body_or_signature_or_another_key_fails(world, tmp_path):
    receipt = _issue(world, "c-1")
    public = receipts.public_key_text(world["key"])
    assert receipts.verify(receipt, public).ok
    cases = []
    for field, value in receipt["body"].items():
        cases += [(field, m) for m in _mutations(value)]
        cases.append((f"{field} removed", None))
    assert {c[0] for c in cases} >= set(receipts.BODY_KEYS)
    for name, new in cases:
        bad = copy.deepcopy(receipt)
        field = name.removesuffix(" removed")
        if name.endswith(" removed"):
            del bad["body"][field]
        else:
            bad["body"][field] = new
        result = receipts.verify(bad, public)
        assert result.status is ReceiptStatus.INVALID and "signature does not verify" in result.reasons[0], name

    def tampered(edit) -> receipts.VerifyResult:
        bad = copy.deepcopy(receipt)
        edit(bad)
        return receipts.verify(bad, public)

    flip = lambda h: h[:5] + ("a" if h[5] != "a" else "b") + h[6:]  # noqa: E731
    edits = {
        "a sample hash": lambda r: r["body"]["removed_samples"]["salted_sha256"].__setitem__(0, flip(r["body"]["removed_samples"]["salted_sha256"][0])),
        "the version after": lambda r: r["body"]["version_after"].__setitem__("version", 3),
        "the version before": lambda r: r["body"]["version_before"].__setitem__("version", 0),
        "a manifest hash": lambda r: r["body"]["version_before"].__setitem__("manifest_sha256", flip(r["body"]["version_before"]["manifest_sha256"])),
        "a weights hash": lambda r: r["body"]["version_after"].__setitem__("weights_sha256", flip(r["body"]["version_after"]["weights_sha256"])),
        "epsilon": lambda r: r["body"]["guarantee"].__setitem__("epsilon", 0.5),
        "a setting": lambda r: r["body"]["method"]["settings"].__setitem__("epsilon", 0.5),
        "the signature": lambda r: r.__setitem__("signature", flip(r["signature"])),
        "a signature from another key": lambda r: r.__setitem__(
            "signature", receipts.Ed25519PrivateKey.generate().sign(receipts.canonical_bytes(r["body"])).hex()),
        "the signature's length": lambda r: r.__setitem__("signature", r["signature"][:-2]),
        "a non-hex signature": lambda r: r.__setitem__("signature", "zz" + r["signature"][2:]),
        "epsilon made NaN": lambda r: r["body"]["guarantee"].__setitem__("epsilon", float("nan")),
    }
    for name, edit in edits.items():
        assert tampered(edit).status is ReceiptStatus.INVALID, name
    other = receipts.Ed25519PrivateKey.generate()
    assert receipts.verify(receipt, other.public_key()).status is ReceiptStatus.INVALID
    # a receipt re-signed by another key, verified against the operator's key: invalid
    forged = receipts.sign({**receipt["body"], "signer": {"algorithm": "Ed25519",
                                                         "public_key_sha256": receipts.fingerprint(other)}}, other)
    assert receipts.verify(forged, public).status is ReceiptStatus.INVALID
    assert receipts.verify({"body": receipt["body"]}, public).status is ReceiptStatus.INVALID

    path = tmp_path / "bad.json"
    bad = copy.deepcopy(receipt)
    bad["body"]["guarantee"]["epsilon"] = 0.1
    path.write_text(json.dumps(bad))
    result = _cli(world, "verify", str(path), "--public-key", str(world["public"]))
    assert result.exit_code == jobs.receipt.EXIT_INVALID == 4 and "INVALID: the Ed25519 signature does not verify" in result.output
    path.write_text("{not json")
    assert _cli(world, "verify", str(path), "--public-key", str(world["public"])).exit_code == 4


# -- with the store -------------------------------------------------------------------------------
def test_store_checks_and_rollback_reports_rolled_back(world, tmp_path):
    store = shutil.copytree(world["store"], tmp_path / "store")
    files = {}
    for rid in GROUPS:
        files[rid] = tmp_path / f"{rid}.json"
        files[rid].write_text(receipts.dumps(_issue(world, rid, store)))

    def check(rid: str, *extra: str):
        return _cli(world, "verify", str(files[rid]), "--public-key", str(world["public"]), "--store", str(store), *extra)

    result = check("c-1")
    assert result.exit_code == 0, result.output
    assert "ok: version 2 (after): manifest sha256 matches" in result.output
    assert "ok: version 2's parent chain reaches version 1" in result.output and f"{files['c-1']}: ok" in result.output

    rolled = CliRunner().invoke(jobs.versions.command, ["rollback", "--store", str(store), "--model", "m", "1", "--reason",
                                                        "audit", "--ledger", str(store / "ledger.sqlite3")])
    assert rolled.exit_code == 0, rolled.output
    result = check("c-1")
    assert result.exit_code == jobs.receipt.EXIT_ROLLED_BACK == 3, result.output
    assert "ROLLED BACK: rolled back: version 2 is no longer in the history of CURRENT (current 1)" in result.output
    as_json = json.loads(check("c-2", "--json").output)
    assert as_json["status"] == "rolled_back" and as_json["reasons"] == [
        "rolled back: version 3 is no longer in the history of CURRENT (current 1)"]
    assert check("c-0").exit_code == 0  # version 1 is CURRENT
    assert _issue(world, "c-0", store)["body"]["version_after"]["version"] == 1
    # the rolled-back request now needs a retrain: refused by name, nothing written
    out = tmp_path / "after-rollback.json"
    refused = _cli(world, "export", "--store", str(store), "--model", "m", "--request-id", "c-1", "--out", str(out))
    assert refused.exit_code == 1 and "request 'c-1' is needs_retrain" in refused.output and not out.exists()
    # still valid offline: the signature does not depend on the store
    assert _cli(world, "verify", str(files["c-1"]), "--public-key", str(world["public"])).exit_code == 0

    manifest = store / "m" / "versions" / "000001" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"seed": 1', '"seed": 2', 1))
    result = check("c-0")
    assert result.exit_code == 4 and "version 1 (after): its manifest has sha256" in result.output
    shutil.rmtree(store / "m" / "versions" / "000003")
    result = check("c-2")
    assert result.exit_code == 4 and "version 3 (after) of 'm' is missing from the store" in result.output
    weights = store / "m" / "versions" / "000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b" ")
    result = check("c-1")
    assert result.exit_code == 4 and "model.safetensors has sha256" in result.output
    other = receipts.verify(json.loads(files["c-1"].read_text()), world["key"].public_key(), tmp_path / "nowhere")
    assert other.status is ReceiptStatus.INVALID and "does not exist" in other.reasons[0]


def test_a_data_subject_checks_their_ids(world, tmp_path):
    receipt = _issue(world, "c-2")
    body, ids = receipt["body"], GROUPS["c-2"]
    salt = bytes.fromhex(body["salt"])
    # the documented recipe, by hand: sha256(salt || decimal id)
    assert sorted(hashlib.sha256(salt + str(i).encode()).hexdigest() for i in ids) == body["removed_samples"]["salted_sha256"]
    assert hashlib.sha256(salt + b"subject:subject-2").hexdigest() == body["subject"]["salted_sha256"]
    assert receipts.covers_samples(receipt, [*ids, GROUPS["c-0"][0], 4999]) == {
        **{i: True for i in ids}, GROUPS["c-0"][0]: False, 4999: False}
    assert receipts.covers_subject(receipt, "subject-2") and not receipts.covers_subject(receipt, "subject-1")
    again = _issue(world, "c-2")  # a fresh salt each time: receipts cannot be linked by their hashes
    assert again["body"]["salt"] != body["salt"]
    assert not set(again["body"]["removed_samples"]["salted_sha256"]) & set(body["removed_samples"]["salted_sha256"])

    path = tmp_path / "mine.json"
    path.write_text(receipts.dumps(receipt))
    args = ["verify", str(path), "--public-key", str(world["public"]), "--subject", "subject-2"]
    mine = _cli(world, *args, *(f"--sample-id={i}" for i in ids))
    assert mine.exit_code == 0 and f"ok: sample id {ids[0]}: its salted hash is among the removed samples" in mine.output
    theirs = _cli(world, *args, f"--sample-id={ids[0]}", f"--sample-id={GROUPS['c-0'][0]}")
    assert theirs.exit_code == 4 and f"sample id {GROUPS['c-0'][0]} is not among the removed samples" in theirs.output


def test_no_noise_derived_value_anywhere(world, monkeypatch):
    vs = VersionStore(world["store"])
    for rid, version in (("c-0", 1), ("c-1", 2), ("c-2", 3)):
        record = vs.manifest("m", version)["record"]
        assert record["noise"]["sigma"] > 0 and "noise_norm" not in record  # noise was added (epsilon 2)
        text = receipts.dumps(_issue(world, rid))
        for key in ("noise_norm", "step_norm", "noise"):
            assert f'"{key}"' not in text
        for value in (record["noise"]["sigma"], record["step_norm"]):
            assert repr(value) not in text and f"{value:.10g}" not in text
            assert re.sub(r"\D", "", f"{value:.10e}".split("e")[0]) not in re.sub(r"[^0-9]", " ", text)
        assert set(json.loads(text)["body"]) == set(receipts.BODY_KEYS)

    # a removal record with a "preparation" entry: copied, but never its noise-derived keys
    original = VersionStore.manifest

    def with_preparation(self, model, version):
        manifest = original(self, model, version)
        if version == 2:
            manifest = {**manifest, "record": {**manifest["record"], "preparation": {
                "seconds": 0.25, "kind": "warm_curvature", "noise_norm": 123.456789, "step_norm": 9.87654321,
                "inner": {"noise_scale": 5.55555, "rows": 12}}}}
        return manifest

    monkeypatch.setattr(VersionStore, "manifest", with_preparation)
    receipt = _issue(world, "c-1")
    assert receipt["body"]["method"]["preparation"] == {"seconds": 0.25, "kind": "warm_curvature", "inner": {"rows": 12}}
    text = receipts.dumps(receipt)
    assert "123.456789" not in text and "9.87654321" not in text and "5.55555" not in text
    assert receipts.verify(receipt, world["key"].public_key()).ok


# -- refusals and keys ----------------------------------------------------------------------------
def test_requests_that_are_not_applied_are_refused_by_name(world, tmp_path):
    for rid, state in (("pending", "accepted"), ("sched", "scheduled"), ("broke", "failed")):
        out = tmp_path / f"{rid}.json"
        result = _cli(world, "export", "--store", str(world["store"]), "--model", "m", "--request-id", rid, "--out", str(out))
        assert result.exit_code == 1 and f"request '{rid}' is {state}" in result.output and "not applied" in result.output
        assert not out.exists()
    result = _cli(world, "show", "--store", str(world["store"]), "--model", "m", "--request-id", "nobody")
    assert result.exit_code == 1 and "request 'nobody' is not in the ledger" in result.output
    result = _cli(world, "show", "--store", str(world["store"]), "--model", "other", "--request-id", "c-0")
    assert result.exit_code == 1 and "request 'c-0' is a request of model 'm', not 'other'" in result.output

    shown = _cli(world, "show", "--store", str(world["store"]), "--model", "m", "--request-id", "c-0")
    assert shown.exit_code == 0 and receipts.verify(json.loads(shown.output), world["key"].public_key()).ok

    folder = tmp_path / "all"
    result = _cli(world, "export", "--store", str(world["store"]), "--model", "m", "--all", "--out", str(folder))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in folder.iterdir()) == [f"{rid}.receipt.json" for rid in GROUPS]
    for path in folder.iterdir():
        assert receipts.verify(json.loads(path.read_text()), world["key"].public_key(), world["store"]).ok
    again = _cli(world, "export", "--store", str(world["store"]), "--model", "m", "--all", "--out", str(folder))
    assert again.exit_code == 1 and "is not an empty folder" in again.output
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".all")] == []  # no staging left


def test_keys_missing_short_malformed_and_keygen(world, tmp_path):
    args = ["show", "--store", str(world["store"]), "--model", "m", "--request-id", "c-0"]
    missing = _cli(world, *args, env=NO_KEY)
    assert missing.exit_code == 1 and "UNLEARN_RECEIPT_KEY" in missing.output and "UNLEARN_RECEIPT_KEY_FILE" in missing.output
    short = _cli(world, *args, env={**NO_KEY, "UNLEARN_RECEIPT_KEY": "ab" * 16})
    assert short.exit_code == 1 and "UNLEARN_RECEIPT_KEY must be the 32-byte Ed25519 private seed as 64 hex" in short.output
    assert "it has 32 characters" in short.output and "abab" not in short.output
    not_hex = _cli(world, *args, env={**NO_KEY, "UNLEARN_RECEIPT_KEY": "g" * 64})
    assert not_hex.exit_code == 1 and "UNLEARN_RECEIPT_KEY must be" in not_hex.output
    junk = tmp_path / "junk.pem"
    junk.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    bad_file = _cli(world, *args, env={**NO_KEY, "UNLEARN_RECEIPT_KEY_FILE": str(junk)})
    assert bad_file.exit_code == 1 and "UNLEARN_RECEIPT_KEY_FILE" in bad_file.output
    gone = _cli(world, *args, env={**NO_KEY, "UNLEARN_RECEIPT_KEY_FILE": str(tmp_path / "none.pem")})
    assert gone.exit_code == 1 and "UNLEARN_RECEIPT_KEY_FILE names" in gone.output

    # the hex seed in the environment signs like the same key in a file
    seed = world["key"].private_bytes(receipts.serialization.Encoding.Raw, receipts.serialization.PrivateFormat.Raw,
                                      receipts.serialization.NoEncryption()).hex()
    by_seed = _cli(world, *args, env={**NO_KEY, "UNLEARN_RECEIPT_KEY": seed})
    assert by_seed.exit_code == 0 and json.loads(by_seed.output)["public_key"] == receipts.public_key_text(world["key"], "hex").strip()
    seed_file = tmp_path / "seed.hex"
    seed_file.write_text(seed + "\n")
    hexed = _cli(world, "public-key", "--format", "hex", env={**NO_KEY, "UNLEARN_RECEIPT_KEY_FILE": str(seed_file)})
    assert hexed.exit_code == 0 and hexed.output == receipts.public_key_text(world["key"], "hex")

    key = tmp_path / "k.pem"
    made = _cli(world, "keygen", "--out", str(key))
    assert made.exit_code == 0 and stat.S_IMODE(key.stat().st_mode) == 0o600
    before = key.read_bytes()
    again = _cli(world, "keygen", "--out", str(key))
    assert again.exit_code == 1 and "already exists" in again.output and key.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.pem", "k.pem", "seed.hex"]  # no temporary left
    pem = _cli(world, "public-key", "--key-file", str(key))
    assert pem.exit_code == 0 and pem.output.startswith("-----BEGIN PUBLIC KEY-----")


def test_receipts_still_verify_after_the_versions_before_them_are_pruned(world, tmp_path):
    """Pruning deletes the older versions' weights (they hold what later versions removed) and keeps their
    manifests: the chain and every receipt still verify; a pruned version is neither loaded nor exported again."""
    store = shutil.copytree(world["store"], tmp_path / "store")
    files = {rid: tmp_path / f"{rid}.json" for rid in GROUPS}
    for rid, path in files.items():
        path.write_text(receipts.dumps(_issue(world, rid, store)))
    runner = CliRunner()
    args = ["prune", "--store", str(store), "--model", "m", "--before", "3", "--reason", "retention"]
    dry = runner.invoke(jobs.versions.command, args)
    assert dry.exit_code == 0 and "would prune [0, 1, 2]" in dry.output
    assert (store / "m" / "versions" / "000000" / "model.safetensors").exists()  # nothing deleted without --yes
    done = runner.invoke(jobs.versions.command, [*args, "--yes"])
    assert done.exit_code == 0 and "pruned [0, 1, 2]" in done.output, done.output
    for v in (0, 1, 2):
        assert sorted(p.name for p in (store / "m" / "versions" / f"{v:06d}").iterdir()) == ["PRUNED", "manifest.json"]
    for rid, path in files.items():
        result = _cli(world, "verify", str(path), "--public-key", str(world["public"]), "--store", str(store))
        assert result.exit_code == 0, result.output
    assert "its files were pruned" in result.output
    listing = runner.invoke(jobs.versions.command, ["verify", "--store", str(store), "--model", "m"])
    assert listing.exit_code == 0 and "v0: ok (pruned" in listing.output and "v3: ok\n" in listing.output
    exported = _cli(world, "export", "--store", str(store), "--model", "m", "--request-id", "c-1", "--out",
                    str(tmp_path / "again.json"))
    assert exported.exit_code == 0, exported.output  # a receipt needs the manifests only
    again = runner.invoke(jobs.versions.command, [*args, "--yes"])
    assert again.exit_code == 0 and "pruned nothing" in again.output
