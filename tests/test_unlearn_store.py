"""The ledger (real SQLite file), the version store (real files), the privacy accountant, and
the policies a campaign enforces: budget, non-private removals, retain-accuracy verification,
rollback. Plus the happy paths of `unlearn versions` and `unlearn ledger`."""
from __future__ import annotations

import json
import math
import sqlite3
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

import jobs.campaign
import jobs.ledger
import jobs.stream
import jobs.versions
from jobs.campaign_runner import run_campaign
from jobs.specs import CampaignSpec, load_spec
from pipeline.data.requests import DeletionRequest
from pipeline.privacy.accountant import Budget, Release, check_budget, compose
from pipeline.store.ledger import Ledger, LedgerConflictError, LedgerError, SampleConflictError, TransitionError
from pipeline.store.versions import ModelBusyError, TamperedVersionError, VersionStore, VersionStoreError
from tests.unlearn_store_support import METHOD_FAST as METHOD, cached_model_dir, make_store, train_ids, write_requests_csv, write_yaml

IDS = train_ids(60)


def _req(rid: str, *ids: int, subject: str = "s") -> DeletionRequest:
    return DeletionRequest(request_id=rid, subject=subject, sample_ids=ids)


# -- ledger ----------------------------------------------------------------------------------
def test_ledger_is_durable_idempotent_and_validates_transitions(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    led = Ledger(path)
    assert led._query("PRAGMA journal_mode")[0][0] == "wal"
    assert led._query("PRAGMA synchronous")[0][0] == 2  # FULL
    row, created = led.submit("m", _req("a", 1, 2), origin="test")
    assert created and row.state == "accepted" and row.sample_ids == [1, 2]
    again, created = led.submit("m", _req("a", 1, 2), origin="elsewhere")
    assert not created and again.seq == row.seq and again.origin == "test"
    with pytest.raises(LedgerConflictError, match="different content"):
        led.submit("m", _req("a", 1, 3), origin="test")
    with pytest.raises(SampleConflictError, match="request 'a'"):
        led.submit("m", _req("b", 2, 4), origin="test")
    led.submit("other-model", _req("c", 2), origin="test")  # the same sample id of another model is fine
    led.close()

    led = Ledger(path)  # a new connection sees everything that was acknowledged
    assert [r.request_id for r in led.requests()] == ["a", "c"]
    batch = led.schedule_batch(batch_key="k0", model="m", origin="o", index=0, request_ids=["a"], parent_version=0, seed=1)
    assert batch.sample_ids == [1, 2] and led.get_request("a").state == "scheduled"
    with pytest.raises(TransitionError):
        led.schedule_batch(batch_key="k1", model="m", origin="o", index=1, request_ids=["a"], parent_version=0, seed=1)
    before = led.fingerprint()
    with pytest.raises(LedgerError, match="not a request of model"):  # fails half-way: all rolled back
        led.schedule_batch(batch_key="k2", model="other-model", origin="o", index=2, request_ids=["c", "a"], parent_version=0, seed=1)
    assert led.fingerprint() == before and led.get_request("c").state == "accepted"
    led.finish_batch("k0", "applied", version=1, epsilon=0.5, metrics={"retain_accuracy": 0.9})
    with pytest.raises(TransitionError, match="already applied"):
        led.finish_batch("k0", "applied", version=2)
    row = led.get_request("a")
    assert (row.state, row.version, row.epsilon_spent, row.metrics) == ("applied", 1, 0.5, {"retain_accuracy": 0.9})
    with pytest.raises(TransitionError):
        led._move(led._conn, "a", "applied")
    led.mark_needs_retrain("m", ["a"], "rolled back")
    assert led.get_request("a").state == "needs_retrain" and led.get_request("a").error == "rolled back"
    # a sample of a request that no longer holds it may be asked for again
    led.submit("m", _req("d", 1), origin="test")

    out = tmp_path / "requests.parquet"
    assert led.export_parquet(out) == 3
    table = pq.read_table(out).to_pylist()
    assert [r["request_id"] for r in table] == ["a", "c", "d"] and table[0]["sample_ids"] == [1, 2]
    assert led.export_parquet(tmp_path / "events.parquet", "events") == 3  # scheduled, applied, needs_retrain
    led.close()


# -- version store -----------------------------------------------------------------------------
@pytest.fixture()
def store(tmp_path, tmp_path_factory) -> VersionStore:
    make_store(tmp_path / "store", cached_model_dir(tmp_path_factory), "m")
    return VersionStore(tmp_path / "store")


def _publish(vs: VersionStore, parent: int, shift: float, key: str) -> int:
    from pipeline.models.card import load_model_dir

    module, _, card = load_model_dir(vs.open_verified("m", parent).path)
    state = {k: v + shift for k, v in module.state_dict().items()}
    with vs.lock("m"):
        return vs.publish("m", state, card, parent=parent, manifest={"batch": {"key": key, "content_sha256": f"h-{key}"}}).version


def test_versions_publish_verify_tamper_and_rollback(store):
    vs = store
    assert vs.versions("m") == [0] and vs.current("m") == 0
    assert _publish(vs, 0, 1.0, "b0") == 1 and _publish(vs, 1, 1.0, "b1") == 2
    assert vs.current("m") == 2 and vs.ancestors("m", 2) == [2, 1, 0]
    assert vs.find_published("m", "h-b1", parent=1).version == 2 and vs.find_published("m", "h-b1", parent=0) is None
    with pytest.raises(VersionStoreError, match="expected parent 1"):
        with vs.lock("m"):
            vs.publish("m", {}, None, parent=1, manifest={})  # type: ignore[arg-type]
    with vs.lock("m"), pytest.raises(ModelBusyError, match="another process"):
        with VersionStore(vs.root).lock("m"):
            pass

    with vs.lock("m"):
        assert vs.rollback("m", 1, "bad batch") == (2, 1)
    assert vs.current("m") == 1 and vs.versions("m") == [0, 1, 2]  # nothing deleted
    history = vs.pointer("m")["history"]
    assert [h["kind"] for h in history] == ["import", "publish", "publish", "rollback"] and history[-1]["reason"] == "bad batch"
    assert _publish(vs, 1, 2.0, "b2") == 3 and vs.manifest("m", 3)["parent"] == 1

    weights = vs.version_dir("m", 3) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(TamperedVersionError, match="model.safetensors has sha256"):
        vs.open_verified("m")
    (vs.version_dir("m", 1) / "extra.bin").write_bytes(b"x")
    with pytest.raises(TamperedVersionError, match="unexpected"):
        vs.verify("m", 1)
    card = vs.version_dir("m", 0) / "model.json"
    card.write_text(card.read_text().replace('"weight_decay": 0.01', '"weight_decay": 0.02'))
    results = dict(vs.verify_all("m"))
    assert results[2] is None and all(results[v] for v in (0, 1, 3))  # v1 also: its parent's manifest is intact,
    result = CliRunner().invoke(jobs.versions.command, ["verify", "--store", str(vs.root), "--model", "m"])
    assert result.exit_code == 1 and "TAMPERED" in result.output and "v2: ok" in result.output


def test_prune_deletes_older_versions_files_keeps_their_manifests_and_finishes_after_a_crash(store, monkeypatch):
    from pipeline.store.versions import PRUNED_FILE, PrunedVersionError

    vs = store
    assert _publish(vs, 0, 1.0, "b0") == 1 and _publish(vs, 1, 1.0, "b1") == 2 and _publish(vs, 2, 1.0, "b2") == 3
    with vs.lock("m"), pytest.raises(VersionStoreError, match="would prune the current version 3"):
        vs.prune("m", 4, "too far")
    with vs.lock("m"), pytest.raises(VersionStoreError, match="reason"):
        vs.prune("m", 2, " ")
    calls = []

    def crash(name):  # as if killed after the first tombstone was written, before any file went
        calls.append(name)
        if name == "prune_tombstone" and len(calls) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr("pipeline.store.versions.crash_point", crash)
    with vs.lock("m"), pytest.raises(KeyboardInterrupt):
        vs.prune("m", 2, "retention")
    assert (vs.version_dir("m", 0) / PRUNED_FILE).exists() and (vs.version_dir("m", 0) / "model.safetensors").exists()
    with pytest.raises(VersionStoreError, match="interrupted"):
        vs.verify("m", 0)
    with vs.lock("m"):
        assert vs.prune("m", 2, "retention") == [0, 1]
        assert vs.prune("m", 2, "retention") == []  # nothing left to do
    for v in (0, 1):
        info = vs.verify("m", v)
        assert info.pruned and sorted(p.name for p in info.path.iterdir()) == [PRUNED_FILE, "manifest.json"]
        assert json.loads((info.path / PRUNED_FILE).read_text())["reason"] == "retention"
    assert not vs.verify("m", 2).pruned and vs.load("m", 2)[0] is not None  # the chain through pruned parents holds
    with pytest.raises(PrunedVersionError, match="pruned"):
        vs.load("m", 1)
    with vs.lock("m"), pytest.raises(PrunedVersionError, match="rollback target 1"):
        vs.rollback("m", 1, "undo")
    weights = vs.version_dir("m", 2) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b" ")  # a damaged version stops the prune, nothing deleted
    with vs.lock("m"), pytest.raises(VersionStoreError, match=r"versions \[2\] .* fail verification.*--before 2"):
        vs.prune("m", 3, "retention")
    assert weights.exists()
    with vs.lock("m"):
        assert vs.prune("m", 3, "retention", include_damaged=True) == [2]
    assert "model.safetensors has sha256" in json.loads((vs.version_dir("m", 2) / PRUNED_FILE).read_text())["verify_error"]
    assert vs.verify("m", 2).pruned
    tomb = vs.version_dir("m", 1) / PRUNED_FILE
    tomb.write_text(tomb.read_text().replace('"version": 1', '"version": 0'))
    with pytest.raises(TamperedVersionError, match="tombstone names another"):
        vs.verify("m", 1)


def test_prune_on_a_sealed_store_needs_its_key_and_a_copied_manifest_is_no_tombstone(tmp_path, tmp_path_factory):
    import shutil

    from pipeline.models.card import load_model_dir
    from pipeline.store.versions import PRUNED_FILE

    key = b"k" * 32
    vs = VersionStore(tmp_path / "sealed", create=True, hmac_key=key)
    with vs.lock("m", create=True):
        vs.import_model_dir("m", cached_model_dir(tmp_path_factory))
    module, _, card = load_model_dir(vs.open_verified("m", 0).path)
    with vs.lock("m"):
        vs.publish("m", {k: v + 1.0 for k, v in module.state_dict().items()}, card, parent=0,
                   manifest={"batch": {"key": "b", "content_sha256": "h"}})
    keyless = VersionStore(vs.root, hmac_key=None)
    with keyless.lock("m"), pytest.raises(VersionStoreError, match="sealed but no store key"):
        keyless.prune("m", 1, "retention")
    assert (vs.version_dir("m", 0) / "model.safetensors").exists()  # nothing deleted
    forged = tmp_path / "forged"  # without the key: the files deleted, the sealed manifest passed off as a tombstone
    shutil.copytree(vs.root, forged)
    folder = forged / "m" / "versions" / "000000"
    shutil.copy(folder / "manifest.json", folder / PRUNED_FILE)
    for name in ("model.safetensors", "model.json"):
        (folder / name).unlink()
    with pytest.raises(TamperedVersionError, match="not a pruning tombstone"):
        VersionStore(forged, hmac_key=key).verify("m", 0)
    with vs.lock("m"):
        assert vs.prune("m", 1, "retention") == [0]
    assert vs.verify("m", 0).pruned and vs.verify("m", 1) is not None
    with pytest.raises(TamperedVersionError, match="seal"):  # the tombstone is sealed like the manifests
        tomb = vs.version_dir("m", 0) / PRUNED_FILE
        tomb.write_text(tomb.read_text().replace('"retention"', '"other"'))
        vs.verify("m", 0)


# -- privacy ---------------------------------------------------------------------------------
def test_accountant_rules_and_refusals():
    z_release = Release(sigma=1.0, sensitivity=0.25, epsilon=1.0, delta=1e-6)  # noise multiplier 4
    assert z_release.noise_multiplier == 4.0
    basic = compose([z_release] * 5, "basic", 1e-5)
    assert basic.epsilon == pytest.approx(5.0) and basic.delta == pytest.approx(5e-6)
    pld, rdp = compose([z_release] * 5, "pld", 1e-5), compose([z_release] * 5, "rdp", 1e-5)
    assert 0 < pld.epsilon <= rdp.epsilon * 1.01 and pld.delta == 1e-5
    single = compose([z_release], "pld", 1e-5).epsilon
    assert single < pld.epsilon < 5 * single  # composition grows sub-linearly

    no_noise = Release.from_record({"noise": {"epsilon": None, "delta": 1e-5, "gamma": 0.0, "sigma": 0.0}})
    assert not no_noise.private and math.isinf(compose([no_noise], "pld", 1e-5).epsilon)
    refused = check_budget([], no_noise, Budget(epsilon=10))
    assert not refused.allowed and "allow_non_private" in refused.reason
    assert check_budget([], no_noise, Budget(epsilon=10, allow_non_private=True)).allowed
    assert check_budget([], no_noise, Budget()).allowed  # no budget: recorded, not limited
    over = check_budget([z_release] * 3, z_release, Budget(epsilon=3.5, composition="basic"))
    assert not over.allowed and "privacy budget exceeded" in over.reason and over.before.epsilon == pytest.approx(3.0)
    from_lfoci = Release.from_record({"noise": {"epsilon": 2.0, "delta": 1e-5, "gamma": 0.5, "sigma": 1.2}})
    assert from_lfoci.private and from_lfoci.noise_multiplier == pytest.approx(2.4)


# -- campaign policies -------------------------------------------------------------------------
def _campaign(tmp: Path, store: Path, name: str, groups: list[list[int]], **overrides) -> CampaignSpec:
    write_requests_csv(tmp / f"{name}.csv", groups, prefix=f"{name}-")
    spec = {"name": name, "model": {"store": str(store), "name": "m"}, "method": METHOD, "batch_size": 1,
            "seed": 1, "requests": f"{name}.csv", **overrides}
    return load_spec(write_yaml(tmp / f"{name}.yaml", spec), CampaignSpec)


def _rows(store: Path, prefix: str):
    led = Ledger(store / "ledger.sqlite3")
    try:
        return [r for r in led.requests() if r.request_id.startswith(prefix)]
    finally:
        led.close()


def test_budget_non_private_and_verification_go_to_needs_retrain_never_skipped(tmp_path, store):
    root = store.root
    # 1. budget too small for even one removal: needs_retrain with the reason, no version
    spec = _campaign(tmp_path, root, "tight", [IDS[0:2]], limits={"budget": {"epsilon": 0.5}})
    result = CliRunner().invoke(jobs.campaign.command, ["run", str(tmp_path / "tight.yaml")])
    assert result.exit_code == 3, result.output
    assert "privacy budget exceeded" in result.output and store.versions("m") == [0]
    [row] = _rows(root, "tight-")
    assert row.state == "needs_retrain" and "privacy budget exceeded" in row.error and row.version is None
    report = json.loads((spec.report_path() / "report.json").read_text())
    assert report["requests"]["needs_retrain"] == 1 and "privacy budget exceeded" in report["batches"][0]["reason"]

    # 2. no noise (epsilon = inf) against a finite budget: refused unless explicitly allowed
    no_noise = {"name": "lfoci-newton", "settings": {**METHOD["settings"], "epsilon": math.inf}}
    run_campaign(_campaign(tmp_path, root, "plain", [IDS[2:4]], method=no_noise, limits={"budget": {"epsilon": 10}}),
                 progress=False, echo=lambda _: None)
    [row] = _rows(root, "plain-")
    assert row.state == "needs_retrain" and "allow_non_private" in row.error and store.versions("m") == [0]
    allowed = _campaign(tmp_path, root, "allowed", [IDS[4:6]], method=no_noise,
                        limits={"budget": {"epsilon": 10, "allow_non_private": True}})
    run_campaign(allowed, progress=False, echo=lambda _: None)
    [row] = _rows(root, "allowed-")
    assert row.state == "applied" and row.version == 1 and math.isinf(row.epsilon_spent)

    # 3. a removal that wrecks the retain accuracy (huge calibrated noise) fails verification
    noisy = {"name": "lfoci-newton", "settings": {**METHOD["settings"], "epsilon": 0.001, "strong_convexity": None}}
    run_campaign(_campaign(tmp_path, root, "noisy", [IDS[6:8]], method=noisy, limits={"retain_accuracy_margin": 0.05}),
                 progress=False, echo=lambda _: None)
    [row] = _rows(root, "noisy-")
    assert row.state == "needs_retrain" and "verification failed: retain accuracy fell" in row.error
    assert row.metrics["retain_accuracy_drop"] > 0.05 and store.versions("m") == [0, 1]


def test_rollback_cli_moves_requests_to_needs_retrain_and_later_batches_build_on_it(tmp_path, store):
    root = store.root
    run_campaign(_campaign(tmp_path, root, "one", [IDS[10:12], IDS[12:14]], limits={"budget": {"epsilon": 100}}),
                 progress=False, echo=lambda _: None)
    assert store.versions("m") == [0, 1, 2]
    runner = CliRunner()
    result = runner.invoke(jobs.versions.command, ["rollback", "--store", str(root), "--model", "m", "1", "--reason", "complaint"])
    assert result.exit_code == 0, result.output
    states = {r.request_id: r.state for r in _rows(root, "one-")}
    assert states == {"one-0": "applied", "one-1": "needs_retrain"}
    # the freed samples can be requested again; the new version's parent is the rollback target
    run_campaign(_campaign(tmp_path, root, "two", [IDS[12:14]], limits={"budget": {"epsilon": 100}}),
                 progress=False, echo=lambda _: None)
    assert store.current("m") == 3 and store.manifest("m", 3)["parent"] == 1

    listing = runner.invoke(jobs.versions.command, ["list", "--store", str(root), "--model", "m", "--json"])
    rows = json.loads(listing.output)
    assert [r["version"] for r in rows] == [0, 1, 2, 3] and [r["current"] for r in rows] == [False, False, False, True]
    shown = json.loads(runner.invoke(jobs.versions.command, ["show", "--store", str(root), "--model", "m", "2"]).output)
    assert shown["batch"]["request_ids"] == ["one-1"] and shown["privacy"]["release"]["guarantee"] in ("certified", "heuristic")
    assert runner.invoke(jobs.versions.command, ["verify", "--store", str(root), "--model", "m"]).exit_code == 0
    out = tmp_path / "ledger.parquet"
    assert runner.invoke(jobs.ledger.command, ["export", "--store", str(root), "--out", str(out)]).exit_code == 0
    assert {r["request_id"] for r in pq.read_table(out).to_pylist()} == {"one-0", "one-1", "two-0"}
    shown = runner.invoke(jobs.ledger.command, ["show", "--store", str(root), "--state", "needs_retrain"])
    assert "one-1" in shown.output and "rolled back" in shown.output
    conn = sqlite3.connect(root / "ledger.sqlite3")
    kinds = [k for (k,) in conn.execute("SELECT kind FROM events ORDER BY id")]
    conn.close()
    assert "rollback" in kinds and "needs_retrain" in kinds
    weights_1 = VersionStore(root).load("m", 1)[0].state_dict()
    assert all(torch.isfinite(v).all() for v in weights_1.values())


def test_every_command_has_help():
    runner = CliRunner()
    for group in (jobs.campaign.command, jobs.versions.command, jobs.ledger.command):
        assert runner.invoke(group, ["--help"]).exit_code == 0
        for name in group.commands:
            result = runner.invoke(group, [name, "--help"])
            assert result.exit_code == 0 and "Usage" in result.output, name
    assert runner.invoke(jobs.stream.command, ["serve", "--help"]).exit_code == 0


def test_resume_after_a_rollback_that_orphaned_a_published_batch(tmp_path, store, monkeypatch):
    """Stopped right after batch 1's version was renamed into place, then rolled back to v0 before
    the resume: batch 0's request needs a retrain, batch 1 is recomputed on v0, nothing twice."""
    class Stop(BaseException):
        pass

    hits: Counter[str] = Counter()

    def stop_at_second_rename(name: str) -> None:
        hits[name] += 1
        if name == "publish_renamed" and hits[name] == 2:
            raise Stop

    root = store.root
    spec = _campaign(tmp_path, root, "orphan", [IDS[20:22], IDS[22:24]], limits={"budget": {"epsilon": 100}})
    monkeypatch.setattr("pipeline.store.versions.crash_point", stop_at_second_rename)
    with pytest.raises(Stop):
        run_campaign(spec, progress=False, echo=lambda _: None)
    monkeypatch.undo()
    assert store.versions("m") == [0, 1, 2] and store.current("m") == 1
    result = CliRunner().invoke(jobs.versions.command, ["rollback", "--store", str(root), "--model", "m", "0", "--reason", "audit"])
    assert result.exit_code == 0, result.output
    run_campaign(spec, resume=True, progress=False, echo=lambda _: None)
    rows = {r.request_id: (r.state, r.version) for r in _rows(root, "orphan-")}
    assert rows == {"orphan-0": ("needs_retrain", 1), "orphan-1": ("applied", 3)}
    assert store.current("m") == 3 and store.manifest("m", 3)["parent"] == 0
    assert store.manifest("m", 2)["batch"]["key"] == store.manifest("m", 3)["batch"]["key"]  # v2 orphaned, kept


def test_ray_address_submits_the_campaign_as_a_ray_job(tmp_path, store, monkeypatch):
    """`campaign run --ray-address` validates locally, then hands `unlearn campaign run SPEC` to
    the Ray Jobs client (a stand-in here; `unlearn submit` owns the real client)."""
    import jobs.submit

    submitted: dict = {}

    class FakeClient:
        def submit_job(self, *, entrypoint: str, runtime_env: dict) -> str:
            submitted.update(entrypoint=entrypoint, runtime_env=runtime_env)
            return "raysubmit_123"

    monkeypatch.setattr(jobs.submit, "client", lambda address: FakeClient())
    _campaign(tmp_path, store.root, "remote", [IDS[40:42]])
    result = CliRunner().invoke(jobs.campaign.command, ["run", str(tmp_path / "remote.yaml"), "--ray-address", "http://127.0.0.1:8265"])
    assert result.exit_code == 0, result.output
    assert "raysubmit_123" in result.output
    assert submitted["entrypoint"].endswith(f"-m jobs.cli campaign run {tmp_path / 'remote.yaml'} --no-progress")
    assert not (store.root / "ledger.sqlite3").exists()  # nothing ran here


def test_example_configs_validate():
    from jobs.specs import ServiceConfig
    from pipeline.data.requests import read_requests

    configs = Path(__file__).resolve().parents[1] / "configs"
    spec = load_spec(configs / "campaigns" / "linear-digits.yaml", CampaignSpec)
    assert len(read_requests(spec.requests)) == 6
    assert load_spec(configs / "stream" / "linear-digits.yaml", ServiceConfig).host == "127.0.0.1"


def test_a_removal_that_fails_is_recorded_as_failed_not_skipped(tmp_path, store, monkeypatch):
    """A method whose result is not finite: the batch and its requests end as failed with the
    error; the next batch still runs; nothing is published for the failed one. The method is
    registered for this test only (a benchmark that runs every registered method must not see it)."""
    from pipeline.methods.base import METHODS, MethodSettings, RemovalMethod, RemovalOutcome

    class NanMethod(RemovalMethod):
        name = "test-nan"
        Settings = MethodSettings

        def remove(self, problem, settings, prepared):
            first = next(iter(problem.forget.sample_ids.tolist()))
            bias = dict(problem.model.named_parameters())["1.bias"].detach().clone()
            if first == IDS[50]:
                bias[0] = float("nan")
            return RemovalOutcome({"1.bias": bias}, {"note": "test"})

    monkeypatch.setitem(METHODS, "test-nan", NanMethod)

    spec = _campaign(tmp_path, store.root, "nan", [IDS[50:52], IDS[52:54]], method={"name": "test-nan"})
    result = run_campaign(spec, progress=False, echo=lambda _: None)
    assert [b.state for b in result.batches] == ["failed", "applied"]
    assert "non-finite" in result.batches[0].reason
    rows = {r.request_id: (r.state, r.version) for r in _rows(store.root, "nan-")}
    assert rows == {"nan-0": ("failed", None), "nan-1": ("applied", 1)}
    assert store.versions("m") == [0, 1] and store.manifest("m", 1)["batch"]["request_ids"] == ["nan-1"]


def test_campaign_memory_budget_is_checked_up_front_and_may_change_on_resume(tmp_path, store):
    """``memory_budget`` in a campaign spec: a malformed one is refused when the spec loads; one too
    small for a single sample's passes is refused before anything is written (no campaign, no
    version); a resume may present another budget (it changes chunking, not results)."""
    from jobs.campaign_runner import CampaignError
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="memory_budget"):
        _campaign(tmp_path, store.root, "bad", [IDS[56:57]], memory_budget="a lot")
    tight = _campaign(tmp_path, store.root, "mem", [IDS[54:55], IDS[55:56]], memory_budget="64B")
    with pytest.raises(CampaignError, match="memory_budget: memory_budget 64 B cannot hold one sample"):
        run_campaign(tight, progress=False, echo=lambda _: None)
    assert store.versions("m") == [0] and _rows(store.root, "mem-") == []
    roomy = _campaign(tmp_path, store.root, "mem", [IDS[54:55], IDS[55:56]], memory_budget="2GiB")
    result = run_campaign(roomy, progress=False, echo=lambda _: None)
    assert [b.state for b in result.batches] == ["applied", "applied"] and store.versions("m") == [0, 1, 2]
    assert store.manifest("m", 1)["record"]["memory_budget"] == "2 GiB (setting)"  # the removal ran under it
    other = _campaign(tmp_path, store.root, "mem", [IDS[54:55], IDS[55:56]], memory_budget="auto")
    resumed = run_campaign(other, resume=True, progress=False, echo=lambda _: None)  # not "the spec differs"
    assert [b.state for b in resumed.batches] == ["applied", "applied"] and store.versions("m") == [0, 1, 2]
    # a resume is checked like a new campaign: a budget too small for one sample is refused, nothing moves
    with pytest.raises(CampaignError, match="memory_budget: memory_budget 64 B"):
        run_campaign(tight, resume=True, progress=False, echo=lambda _: None)
    assert store.versions("m") == [0, 1, 2]
