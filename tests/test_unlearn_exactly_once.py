"""The exactly-once state machine (jobs/exactly_once.py) against the ways issue 14 broke it:
rolled-back versions re-published by a resume, published batches recognised by their name,
poison batches, a forget set that removes everything, rollbacks not atomic with the ledger,
store hardening, certified/heuristic releases counted apart. Real SQLite ledgers, real version
stores, real `python -m jobs.cli` subprocesses where a kill is needed."""
from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import jobs.campaign
import jobs.ledger
import jobs.versions
from jobs.campaign_runner import run_campaign
from jobs.exactly_once import ExactlyOnce, guarantee_counts, is_not_served, release_of_record
from jobs.specs import CampaignSpec, Limits, load_spec
from pipeline.errors import RemovalNotServed
from pipeline.privacy.release import Guarantee, PrivacyRelease
from pipeline.store.ledger import Ledger
from pipeline.store.versions import TamperedVersionError, VersionStore, VersionStoreError
from tests.unlearn_store_support import (
    METHOD, METHOD_FAST, cached_model_dir, make_store, run_cli, train_ids, write_requests_csv, write_yaml,
)

IDS = train_ids(80)
MODEL = "m"


@pytest.fixture()
def root(tmp_path, tmp_path_factory) -> Path:
    return make_store(tmp_path / "store", cached_model_dir(tmp_path_factory), MODEL)


def _spec(tmp: Path, root: Path, name: str, groups: list[list[int]], *, prefix: str | None = None, **over: Any) -> Path:
    write_requests_csv(tmp / f"{name}.csv", groups, prefix=prefix or f"{name}-")
    spec = {"name": name, "model": {"store": str(root), "name": MODEL}, "method": METHOD_FAST, "batch_size": 1,
            "seed": 1, "limits": {"budget": {"epsilon": 100.0}}, "requests": f"{name}.csv", **over}
    return write_yaml(tmp / f"{name}.yaml", spec)


def _run(spec: Path):
    return run_campaign(load_spec(spec, CampaignSpec), resume=True, progress=False, echo=lambda _: None)


def _rows(ledger: Path, table: str = "requests") -> list[dict]:
    conn = sqlite3.connect(ledger)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute(f"SELECT * FROM {table} ORDER BY rowid")]
    finally:
        conn.close()


def _current(root: Path) -> int:
    return json.loads((root / MODEL / "CURRENT").read_text())["version"]


# -- 14.1 --------------------------------------------------------------------------------------
def test_resume_never_republishes_a_version_the_operator_rolled_back(tmp_path, root):
    spec = _spec(tmp_path, root, "c", [IDS[0:2], IDS[2:4]])
    killed = run_cli("campaign", "run", str(spec), "--no-progress", env={"UNLEARN_CRASH_AT": "publish_pointer:1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert _current(root) == 1 and {r["state"] for r in _rows(root / "ledger.sqlite3")} == {"scheduled", "accepted"}
    # the rollback itself is killed after CURRENT moved, before the ledger followed ...
    rolled = run_cli("versions", "rollback", "--store", str(root), "--model", MODEL, "0", "--reason", "complaint",
                     env={"UNLEARN_CRASH_AT": "rollback_moved:1"})
    assert rolled.returncode == -signal.SIGKILL and _current(root) == 0
    # ... and the resume follows it: batch 0 ends needs_retrain, version 1 is never current again
    resumed = run_cli("campaign", "resume", str(spec), "--no-progress")
    assert resumed.returncode == 3, resumed.stdout + resumed.stderr
    vs = VersionStore(root)
    assert 1 not in vs.ancestors(MODEL, vs.current(MODEL)) and vs.current(MODEL) == 2
    states = {r["request_id"]: (r["state"], r["version"]) for r in _rows(root / "ledger.sqlite3")}
    assert states == {"c-0": ("needs_retrain", None), "c-1": ("applied", 2)}
    assert "rolled back" in next(r["error"] for r in _rows(root / "ledger.sqlite3") if r["request_id"] == "c-0")
    assert vs.manifest(MODEL, 2)["parent"] == 0


def test_interrupted_rollback_is_finished_by_naming_the_same_version(tmp_path, root):
    _run(_spec(tmp_path, root, "c", [IDS[0:2]]))
    rolled = run_cli("versions", "rollback", "--store", str(root), "--model", MODEL, "0", "--reason", "x",
                     env={"UNLEARN_CRASH_AT": "rollback_moved:1"})
    assert rolled.returncode == -signal.SIGKILL and _current(root) == 0
    assert _rows(root / "ledger.sqlite3")[0]["state"] == "applied"  # the ledger lags behind CURRENT
    again = CliRunner().invoke(jobs.versions.command, ["rollback", "--store", str(root), "--model", MODEL, "0", "--reason", "x"])
    assert again.exit_code == 0, again.output
    assert _rows(root / "ledger.sqlite3")[0]["state"] == "needs_retrain"
    rollbacks = [json.loads(e["detail"]) for e in _rows(root / "ledger.sqlite3", "events") if e["kind"] == "rollback"]
    assert rollbacks == [{"from": 1, "to": 0, "reason": "x", "finished_after_kill": True}]


def test_rollback_killed_after_its_event_is_finished_without_a_second_event(tmp_path, root):
    """Killed after recording the rollback, before the ledger followed it: the rerun follows it and
    the ledger holds the one event of that pointer move."""
    _run(_spec(tmp_path, root, "c", [IDS[0:2]]))
    rolled = run_cli("versions", "rollback", "--store", str(root), "--model", MODEL, "0", "--reason", "x",
                     env={"UNLEARN_CRASH_AT": "rollback_recorded:1"})
    assert rolled.returncode == -signal.SIGKILL and _current(root) == 0
    assert _rows(root / "ledger.sqlite3")[0]["state"] == "applied"
    again = CliRunner().invoke(jobs.versions.command, ["rollback", "--store", str(root), "--model", MODEL, "0", "--reason", "x"])
    assert again.exit_code == 0, again.output
    assert _rows(root / "ledger.sqlite3")[0]["state"] == "needs_retrain"
    rollbacks = [json.loads(e["detail"]) for e in _rows(root / "ledger.sqlite3", "events") if e["kind"] == "rollback"]
    assert rollbacks == [{"from": 1, "to": 0, "reason": "x"}]


# -- 14.2 --------------------------------------------------------------------------------------
def test_a_published_batch_is_recognised_by_its_content_never_by_its_key(tmp_path, root):
    _run(_spec(tmp_path, root, "c", [[IDS[0]]], prefix="first-"))
    assert CliRunner().invoke(jobs.versions.command, ["rollback", "--store", str(root), "--model", MODEL, "0",
                                                      "--reason", "x"]).exit_code == 0
    # a fresh ledger (as the error message suggests), the same campaign name: key campaign:c:0 on parent 0 again
    fresh = tmp_path / "fresh.sqlite3"
    spec = _spec(tmp_path, root, "c", [[IDS[7]]], prefix="second-", ledger=str(fresh))
    result = _run(spec)
    assert result.batches[0].state == "applied"
    row = _rows(fresh)[0]
    manifest = VersionStore(root).manifest(MODEL, row["version"])
    assert row["version"] != 1 and manifest["batch"]["sample_ids"] == [IDS[7]]
    assert manifest["batch"]["request_ids"] == ["second-0"] and len(manifest["batch"]["content_sha256"]) == 64


# -- 14.3 --------------------------------------------------------------------------------------
def test_an_error_inside_the_removal_closes_the_batch_with_the_reason(tmp_path, root):
    vs, ledger = VersionStore(root), Ledger(tmp_path / "l.sqlite3")
    from pipeline.data.requests import DeletionRequest

    for i in range(3):
        ledger.submit(MODEL, DeletionRequest(request_id=f"r{i}", subject="s", sample_ids=(IDS[i],)), origin="stream:t")

    class StepNotServed(RemovalNotServed):
        pass

    def remover(model_dir, batch):  # the real removal, with one poisoned sample that raises inside it
        from pipeline.removal import remove

        if IDS[1] in batch.sample_ids:
            raise StepNotServed("the Newton solve did not converge for this request")
        if IDS[2] in batch.sample_ids:
            raise KeyError("nope")
        return remove(model_dir, batch.sample_ids, method=METHOD_FAST["name"], settings=METHOD_FAST["settings"], seed=batch.seed)

    with vs.lock(MODEL):
        machine = ExactlyOnce(vs, ledger, MODEL, method=METHOD_FAST["name"], settings=METHOD_FAST["settings"],
                              limits=Limits.model_validate({"budget": {"epsilon": 100}}), remover=remover)
        results = machine.apply_isolating("stream:m", ["r0", "r1", "r2"], lambda k: 10 + k)
    # one micro-batch of three, split after the failure: the good request is applied alone
    assert [r.state for r in results] == ["applied", "needs_retrain", "failed"]
    states = {r.request_id: (r.state, r.error) for r in ledger.requests()}
    assert states["r0"][0] == "applied" and "StepNotServed" in states["r1"][1] and "KeyError" in states["r2"][1]
    batches = ledger.batches()
    assert batches[0].state == "failed" and "split into single requests" in batches[0].reason
    assert not [b for b in batches if b.state == "scheduled"]
    assert is_not_served(StepNotServed("x")) and not is_not_served(KeyError("x"))
    ledger.close()


def test_a_memory_budget_error_leaves_the_batch_scheduled_for_a_resume(tmp_path, root):
    """A stage that cannot fit the memory budget on this machine says nothing about the batch: the
    run stops with the error, nothing is published or closed, and the same batch is applied once the
    removal fits (a larger budget, another machine)."""
    from pipeline.data.requests import DeletionRequest
    from pipeline.memory import MemoryBudgetError

    vs, ledger = VersionStore(root), Ledger(tmp_path / "l.sqlite3")
    ledger.submit(MODEL, DeletionRequest(request_id="m0", subject="s", sample_ids=(IDS[70],)), origin="stream:t")
    fits = {"now": False}

    def remover(model_dir, batch):
        from pipeline.removal import remove

        if not fits["now"]:
            raise MemoryBudgetError("memory_budget 1 MiB cannot hold one Hessian column of this model")
        return remove(model_dir, batch.sample_ids, method=METHOD_FAST["name"], settings=METHOD_FAST["settings"], seed=batch.seed)

    with vs.lock(MODEL):
        machine = ExactlyOnce(vs, ledger, MODEL, method=METHOD_FAST["name"], settings=METHOD_FAST["settings"],
                              limits=Limits.model_validate({"budget": {"epsilon": 100}}), remover=remover)
        batch = machine.schedule("stream:m", 0, ["m0"], 7)
        with pytest.raises(MemoryBudgetError, match="memory_budget"):
            machine.apply(batch)
        assert ledger.get_batch(batch.batch_key).state == "scheduled" and vs.versions(MODEL) == [0]
        assert {r.request_id: r.state for r in ledger.requests()}["m0"] not in ("failed", "needs_retrain", "applied")
        fits["now"] = True
        result = machine.apply(ledger.get_batch(batch.batch_key))
    assert result.state == "applied" and vs.versions(MODEL) == [0, 1]
    ledger.close()


def test_a_stuck_batch_can_be_cancelled_and_the_campaign_goes_on(tmp_path, root):
    spec = _spec(tmp_path, root, "c", [IDS[0:2], IDS[2:4]])
    killed = run_cli("campaign", "run", str(spec), "--no-progress", env={"UNLEARN_CRASH_AT": "after_schedule:1"})
    assert killed.returncode == -signal.SIGKILL
    out = CliRunner().invoke(jobs.campaign.command, ["cancel-batch", str(spec), "0", "--reason", "poison"])
    assert out.exit_code == 0, out.output
    assert "cancelled by the operator: poison" in out.output
    again = CliRunner().invoke(jobs.campaign.command, ["cancel-batch", str(spec), "0", "--reason", "poison"])
    assert again.exit_code == 1 and "already failed" in again.output
    assert _run(spec).batches[1].state == "applied"
    states = {r["request_id"]: r["state"] for r in _rows(root / "ledger.sqlite3")}
    assert states == {"c-0": "failed", "c-1": "applied"}
    # the cancelled request's samples are free to be requested again
    assert _run(_spec(tmp_path, root, "d", [IDS[0:2]])).batches[0].state == "applied"


# -- 14.4 --------------------------------------------------------------------------------------
def test_a_forget_set_that_removes_everything_needs_retrain(tmp_path, root):
    from pipeline.models.card import read_card

    n = read_card(VersionStore(root).open_verified(MODEL).path).training.n
    everything = train_ids(n)
    assert len(everything) == n
    result = _run(_spec(tmp_path, root, "all", [everything]))
    assert result.batches[0].state == "needs_retrain", result.batches[0]
    assert f"every one of the {n} training samples" in result.batches[0].reason
    assert VersionStore(root).versions(MODEL) == [0]


# -- 14.5 --------------------------------------------------------------------------------------
def test_rollback_without_ledger_finds_the_campaigns_custom_ledger(tmp_path, root):
    custom = tmp_path / "elsewhere" / "custom.sqlite3"
    _run(_spec(tmp_path, root, "c", [IDS[0:2]], ledger=str(custom)))
    out = CliRunner().invoke(jobs.versions.command, ["rollback", "--store", str(root), "--model", MODEL, "0", "--reason", "x"])
    assert out.exit_code == 0, out.output
    assert _rows(custom)[0]["state"] == "needs_retrain"
    assert not (root / "ledger.sqlite3").exists()  # no stray default ledger was created


@pytest.mark.parametrize("bad", ["missing", "directory", "text"])
def test_rollback_with_a_bad_ledger_moves_nothing(tmp_path, root, bad):
    _run(_spec(tmp_path, root, "c", [IDS[0:2]]))
    path = {"missing": tmp_path / "nope.sqlite3", "directory": tmp_path, "text": tmp_path / "c.csv"}[bad]
    before = (root / MODEL / "CURRENT").read_bytes()
    proc = run_cli("versions", "rollback", "--store", str(root), "--model", MODEL, "0", "--reason", "x", "--ledger", str(path))
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr  # 2: click's usage error
    assert "ledger" in proc.stderr
    assert (root / MODEL / "CURRENT").read_bytes() == before and not (tmp_path / "nope.sqlite3").exists()


# -- 14.6 --------------------------------------------------------------------------------------
def test_a_staging_symlink_never_makes_lock_delete_elsewhere(tmp_path, root):
    victim = tmp_path / "victim"
    (victim / "precious").mkdir(parents=True)
    (victim / "precious" / "data.txt").write_text("keep me")
    staging = root / MODEL / ".staging"
    if staging.exists():
        staging.rmdir()
    staging.symlink_to(victim, target_is_directory=True)
    with pytest.raises(VersionStoreError, match="symbolic link"):
        with VersionStore(root).lock(MODEL):
            pass
    assert (victim / "precious" / "data.txt").read_text() == "keep me"


def test_model_names_with_a_newline_or_control_characters_are_refused(tmp_path, root, tmp_path_factory):
    vs = VersionStore(root)
    for name in ["digits\n", "a\tb", "x\x00", "a\r"]:
        with pytest.raises(VersionStoreError, match="invalid"):
            vs.model_dir(name)
    proc = run_cli("versions", "import", "--store", str(root), "--model", "digits\n", str(cached_model_dir(tmp_path_factory)))
    assert proc.returncode == 1 and "invalid" in proc.stderr
    assert sorted(p.name for p in root.iterdir()) == [MODEL]


def test_a_failed_commit_is_rolled_back(tmp_path):
    from pipeline.data.requests import DeletionRequest

    ledger = Ledger(tmp_path / "l.sqlite3")
    with pytest.raises(sqlite3.IntegrityError):
        with ledger._tx() as conn:  # a deferred foreign key: only COMMIT finds the violation
            conn.execute("PRAGMA defer_foreign_keys = ON")
            conn.execute("INSERT INTO request_samples (model, sample_id, request_id) VALUES ('m', 1, 'nobody')")
    assert not ledger._conn.in_transaction
    ledger.submit("m", DeletionRequest(request_id="a", subject="s", sample_ids=(1,)), origin="t")  # the next write works
    assert _rows(tmp_path / "l.sqlite3", "request_samples") == [{"model": "m", "sample_id": 1, "request_id": "a"}]


def test_rollback_of_an_unknown_model_leaves_nothing_behind(tmp_path, root):
    proc = run_cli("versions", "rollback", "--store", str(root), "--model", "ghost", "0", "--reason", "x")
    assert proc.returncode == 1 and "not in the version store" in proc.stderr
    assert not (root / "ghost").exists()


def test_a_new_ledger_is_not_created_before_the_request_file_is_validated(tmp_path, root):
    spec = _spec(tmp_path, root, "c", [IDS[0:2]], ledger=str(tmp_path / "new" / "ledger.sqlite3"))
    (tmp_path / "c.csv").write_text("request_id,subject,sample_ids\na,s,99999\n")
    proc = run_cli("campaign", "run", str(spec))
    assert proc.returncode == 1 and "not in the training set" in proc.stderr
    assert not (tmp_path / "new").exists()


def test_the_hmac_key_detects_a_consistent_rewrite_of_weights_manifest_and_current(tmp_path, root, monkeypatch):
    from pipeline.checkpoint import sha256_of

    key = "k" * 32
    monkeypatch.setenv("UNLEARN_STORE_HMAC_KEY", key)
    sealed = make_store(tmp_path / "sealed", root / MODEL / "versions" / "000000", MODEL)
    monkeypatch.setenv("UNLEARN_STORE_HMAC_KEY", key)
    _run(_spec(tmp_path, sealed, "c", [IDS[0:2]]))
    vs = VersionStore(sealed)
    assert vs.verify(MODEL, 1).manifest["hmac"]

    def rewrite(folder: Path) -> None:
        """What an attacker without the key can do: new weights, a manifest and CURRENT that agree."""
        version = folder / MODEL / "versions" / "000001"
        weights = version / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-3] ^= 0xFF
        weights.write_bytes(bytes(data))
        manifest = json.loads((version / "manifest.json").read_text())
        manifest["files"]["model.safetensors"] = sha256_of(weights)
        (version / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        pointer = json.loads((folder / MODEL / "CURRENT").read_text())
        pointer["manifest_sha256"] = sha256_of(version / "manifest.json")
        (folder / MODEL / "CURRENT").write_text(json.dumps(pointer, indent=2, sort_keys=True))

    rewrite(sealed)
    with pytest.raises(TamperedVersionError, match="HMAC"):
        VersionStore(sealed).verify(MODEL, 1)
    proc = run_cli("versions", "verify", "--store", str(sealed), "--model", MODEL, env={"UNLEARN_STORE_HMAC_KEY": key})
    assert proc.returncode == 1 and "HMAC" in proc.stdout + proc.stderr
    # without a key the same rewrite passes the unkeyed hash chain: that is what the key is for
    monkeypatch.delenv("UNLEARN_STORE_HMAC_KEY")
    VersionStore(sealed).verify(MODEL, 1)


# -- 11.10: certified and heuristic releases apart ---------------------------------------------
def test_releases_are_read_typed_and_counted_apart():
    certified = PrivacyRelease(mechanism="gaussian", sigma=1.0, sensitivity=0.5, epsilon=1.0, delta=1e-5,
                               calibration="classical", guarantee=Guarantee.CERTIFIED)
    assert release_of_record({"release": certified.model_dump(mode="json")}) == certified
    assert release_of_record({"noise_sigma": 3.0, "epsilon": 1.0}).guarantee is Guarantee.NONE  # no alias guessing
    legacy = release_of_record({"noise": {"sigma": 1.2, "epsilon": 2.0, "delta": 1e-5, "gamma": 0.5}})
    assert legacy.guarantee is Guarantee.HEURISTIC and legacy.epsilon == 2.0 and legacy.reasons
    assert guarantee_counts([certified, legacy, legacy, PrivacyRelease.non_private()]) == \
        {"certified": 1, "heuristic": 2, "none": 1}


def test_a_budget_that_requires_certified_releases_refuses_heuristic_ones(tmp_path, root):
    spec = _spec(tmp_path, root, "strict", [IDS[0:2]], method=METHOD,
                 limits={"budget": {"epsilon": 100.0, "require_certified": True}})
    result = _run(spec)
    assert result.batches[0].state == "needs_retrain"
    assert "requires certified releases but this one is heuristic" in result.batches[0].reason
    assert VersionStore(root).versions(MODEL) == [0]
    # the same removal under a budget that accepts heuristic releases: applied, counted as heuristic
    loose = _run(_spec(tmp_path, root, "loose", [IDS[2:4]], method=METHOD, limits={"budget": {"epsilon": 100.0}}))
    assert loose.batches[0].state == "applied"
    report = json.loads((loose.report_dir / "report.json").read_text())
    assert report["releases"] == {"certified": 0, "heuristic": 1, "none": 0}
    assert "1 heuristic" in (loose.report_dir / "report.md").read_text()
    manifest = VersionStore(root).manifest(MODEL, 1)
    assert manifest["privacy"]["guarantee"] == "heuristic" and manifest["privacy"]["releases"]["heuristic"] == 1
    shown = CliRunner().invoke(jobs.ledger.command, ["show", "--store", str(root)])
    assert "release=heuristic" in shown.output and "releases: 0 certified, 1 heuristic, 0 none" in shown.output


def test_seeds_up_to_2_63_minus_1_apply_and_the_ledger_records_them(tmp_path, root):
    """Seeds above 1.8e13 used to fail every batch; the whole range [0, 2^63 - 1] now applies
    (one past it is refused at ingest: tests/test_unlearn_bad_inputs.py)."""
    top = 2**63 - 2
    result = _run(_spec(tmp_path, root, "big", [IDS[0:1], IDS[1:2]], seed=top))
    assert [b.state for b in result.batches] == ["applied", "applied"], result.batches
    assert [b["seed"] for b in _rows(root / "ledger.sqlite3", "batches")] == [top, top + 1]
