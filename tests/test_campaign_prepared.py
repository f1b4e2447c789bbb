"""Campaigns and the stream service keep a method's prepared state between batches, and rebuild it
from the version they start from: after a resume (a new process), after a rollback (the state in
hand was built for weights and data the new parent does not have), after a stream restart. The
campaign report gives each request's cost by stage, measured where each stage ran (jobs/costs.py).

Model: an MLP on the real digits (the decision layer over a hidden layer: the prepared state holds
the hidden features of D, carried from batch to batch); method: the newton-head variant
(epsilon inf, deterministic)."""
from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
import torch

from tests.unlearn_store_support import make_store, run_cli, write_requests_csv, write_yaml

MODEL = "mlp"
METHOD = "newton-head"


@pytest.fixture(scope="module")
def mlp_dir(tmp_path_factory) -> Path:
    from tests import kit

    return kit.trained_model_dir(tmp_path_factory.mktemp("mlp"), "mlp",
                                 {"in_features": 64, "hidden": [16], "num_classes": 10}, steps=60)


def _ids(model_dir: Path, count: int) -> list[int]:
    from pipeline.models.card import read_card
    from pipeline.removal import training_set

    return training_set(read_card(model_dir)).sample_ids[:count].tolist()


def _spec(tmp: Path, store: Path, name: str, groups: list[list[int]], batch_size: int = 1) -> Path:
    write_requests_csv(tmp / f"{name}.csv", groups, prefix=f"{name}-")
    return write_yaml(tmp / f"{name}.yaml", {
        "name": name, "model": {"store": str(store), "name": MODEL}, "method": METHOD, "batch_size": batch_size,
        "seed": 0, "limits": {"budget": {"epsilon": 100.0, "allow_non_private": True}, "retain_accuracy_margin": None},
        "requests": f"{name}.csv",
    })


def _record(store: Path, version: int) -> dict:
    from pipeline.store.versions import VersionStore

    return VersionStore(store).manifest(MODEL, version)["record"]


def _weights(store: Path, version: int) -> dict[str, torch.Tensor]:
    from pipeline.store.versions import VersionStore
    from safetensors.torch import load_file

    return load_file(str(VersionStore(store).open_verified(MODEL, version).path / "model.safetensors"))


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), (k, float((a[k] - b[k]).abs().max()))


def test_campaign_carries_the_state_and_reports_each_requests_cost(tmp_path, mlp_dir):
    from jobs.campaign_runner import run_campaign
    from jobs.specs import CampaignSpec, load_spec

    store = make_store(tmp_path / "store", mlp_dir, MODEL)
    ids = _ids(mlp_dir, 5)
    spec = _spec(tmp_path, store, "carry", [[ids[0]], [ids[1], ids[2]], [ids[3]], [ids[4]]], batch_size=2)
    result = run_campaign(load_spec(spec, CampaignSpec), progress=False, echo=lambda _: None)
    assert [b.state for b in result.batches] == ["applied", "applied"]
    first, second = _record(store, 1)["preparation"], _record(store, 2)["preparation"]
    assert first["built_for_this_request"] and first["why"] == "no prepared state was given"
    assert not second["built_for_this_request"] and "updated_from_removal" in second  # carried, not rebuilt
    # each batch's costs, measured by the machine and recorded in the ledger
    for b in result.batches:
        c = b.costs
        assert c["requests"] == 2 and set(c["seconds"]) == {"preparation", "load", "removal", "verification",
                                                            "publish", "ledger", "other"}
        assert all(v >= 0 for v in c["seconds"].values())
        assert sum(c["seconds"].values()) == pytest.approx(c["wall_seconds"], rel=1e-6)
    assert result.batches[0].costs["preparation"]["built"] > 0 and result.batches[0].costs["preparation"]["updated"] == 0
    assert result.batches[1].costs["preparation"]["built"] == 0 and result.batches[1].costs["preparation"]["updated"] > 0
    assert result.batches[0].costs["preparation"]["lineage"] == result.batches[1].costs["preparation"]["lineage"]
    assert result.batches[0].costs["seconds"]["removal"] == pytest.approx(_record(store, 1)["removal_seconds"])
    report_dir = store / MODEL / "reports" / "carry"
    report = json.loads((report_dir / "report.json").read_text())
    costs = report["costs"]
    assert costs["requests_recorded"] == 4 and not costs["batches_not_recorded"]
    assert [r["request_id"] for r in costs["per_request"]] == [f"carry-{k}" for k in range(4)]
    # the cold build is shared by the 4 requests its lineage served; each batch's update by its own 2
    built = result.batches[0].costs["preparation"]["built"]
    for k, r in enumerate(costs["per_request"]):
        paid = result.batches[k // 2].costs["seconds"]["preparation"] - (built if k < 2 else 0.0)
        assert r["seconds"]["preparation"] == pytest.approx(built / 4 + paid / 2)
        assert r["sum"] == pytest.approx(sum(r["seconds"].values()))
    total = sum(b.costs["wall_seconds"] for b in result.batches)
    assert costs["mean_per_request"]["sum"] == pytest.approx(total / 4)
    assert costs["total_seconds"] == pytest.approx(total)
    assert (report_dir / "costs.png").stat().st_size > 1000
    assert "## Cost per request" in (report_dir / "report.md").read_text()


def test_resume_rebuilds_the_state_from_the_version_it_starts_from(tmp_path, mlp_dir):
    """A campaign killed after its second batch: the resumed process has no state; it builds one for
    the version it starts from (never one of another version) and gives the weights an uninterrupted
    run gives (the uninterrupted reference runs in this process: one interpreter start less)."""
    from jobs.campaign_runner import run_campaign
    from jobs.specs import CampaignSpec, load_spec

    ids = _ids(mlp_dir, 4)
    groups = [[i] for i in ids]
    whole = make_store(tmp_path / "whole" / "store", mlp_dir, MODEL)
    done = run_campaign(load_spec(_spec(tmp_path / "whole", whole, "c", groups), CampaignSpec), progress=False,
                        echo=lambda _: None)
    assert [b.state for b in done.batches] == ["applied"] * 4, [(b.state, b.reason) for b in done.batches]
    store = make_store(tmp_path / "killed" / "store", mlp_dir, MODEL)
    spec = _spec(tmp_path / "killed", store, "c", groups)
    killed = run_cli("campaign", "run", str(spec), "--no-progress", env={"UNLEARN_CRASH_AT": "after_ledger_applied:2"})
    assert killed.returncode == -9, killed.stdout + killed.stderr
    resumed = run_cli("campaign", "resume", str(spec), "--no-progress")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert not _record(store, 2)["preparation"]["built_for_this_request"]  # (first life: carried)
    third = _record(store, 3)["preparation"]
    assert third["built_for_this_request"] and third["why"] == "no prepared state was given"
    assert not _record(store, 4)["preparation"]["built_for_this_request"]
    for v in range(1, 5):
        _close(_weights(store, v), _weights(whole, v))
    report = json.loads((store / MODEL / "reports" / "c" / "report.json").read_text())
    # the costs of both lives are in the report, but for the batch whose process was killed before it
    # recorded them; a cold build in each life (two lineages)
    assert report["costs"]["batches_not_recorded"] == ["campaign:c:1"] and report["costs"]["requests_recorded"] == 3
    built = [b["costs"].get("preparation_built") for b in report["batches"]]
    assert built[0] > 0 and built[1] is None and built[2] > 0 and built[3] == 0


def test_rollback_between_batches_rebuilds_the_state_for_the_rolled_back_version(tmp_path, mlp_dir):
    """The machine holds the state of version 2 (updated from the batch that made it); the operator
    rolls back to version 1; the next batch runs on version 1 with a state built there, never with
    the one of version 2 (other weights, other training set): the same weights as a removal from
    version 1 with a fresh preparation."""
    from jobs.exactly_once import ExactlyOnce, rollback
    from pipeline.removal import remove
    from pipeline.store.ledger import Ledger
    from pipeline.store.versions import VersionStore

    root = make_store(tmp_path / "store", mlp_dir, MODEL)
    ids = _ids(mlp_dir, 3)
    store = VersionStore(root)
    ledger = Ledger(root / "ledger.sqlite3")
    from pipeline.data.requests import DeletionRequest

    for k, i in enumerate(ids):
        ledger.submit(MODEL, DeletionRequest(request_id=f"r{k}", subject="s", sample_ids=[i]), origin="test")
    with store.lock(MODEL):
        machine = ExactlyOnce(store, ledger, MODEL, method=METHOD)
        for k in range(2):
            assert machine.apply(machine.schedule("test", k, [f"r{k}"], k)).state == "applied"
    assert store.current(MODEL) == 2
    with store.lock(MODEL):
        rollback(store, MODEL, 1, "audit", [ledger.path])
        result = machine.apply(machine.schedule("test", 2, ["r2"], 2))
    assert result.state == "applied" and result.version == 3 and store.manifest(MODEL, 3)["parent"] == 1
    prep = _record(root, 3)["preparation"]
    assert prep["built_for_this_request"]
    assert "weights or buffers" in prep["why"] and "training set" in prep["why"]
    assert result.costs["preparation"]["built"] > 0 and result.costs["preparation"]["updated"] > 0  # (wasted update)
    card = json.loads((store.open_verified(MODEL, 3).path / "model.json").read_text())
    assert sorted(card["training"]["removed_ids"]) == sorted([ids[0], ids[2]])
    fresh = remove(store.open_verified(MODEL, 1).path, [ids[2]], method=METHOD, seed=2)
    _close(_weights(root, 3), fresh.new_state)
    ledger.close()


def test_stream_service_keeps_the_state_and_rebuilds_it_after_a_restart_and_a_rollback(tmp_path, mlp_dir):
    """The stream service without the fast path, through ExactlyOnce: micro-batches carry the state;
    a restart after a rollback builds it for the version it starts from."""
    from jobs.exactly_once import rollback
    from jobs.service import UnlearnService
    from jobs.specs import ServiceConfig
    from pipeline.store.ledger import Ledger
    from pipeline.store.versions import VersionStore

    root = make_store(tmp_path / "store", mlp_dir, MODEL)
    ids = _ids(mlp_dir, 3)
    config = ServiceConfig.model_validate({
        "model": {"store": str(root), "name": MODEL}, "method": METHOD, "port": 0,
        "limits": {"budget": {"epsilon": 100.0, "allow_non_private": True}, "retain_accuracy_margin": None},
        "auth": {"clients": [{"client": "t", "token": "stream-test-token-0123456789"}]},
        "batching": {"max_requests": 1, "max_wait_s": 0.01},
    })

    def serve(requests: list[tuple[str, int]]) -> None:
        service = UnlearnService(config, log=lambda _msg: None)
        service.start()
        try:
            for rid, sample in requests:
                service.submit("t", {"request_id": rid, "subject": "s", "sample_ids": [sample]})
            deadline = time.monotonic() + 120
            while any(service.ledger.get_request(rid).state != "applied" for rid, _ in requests):
                assert time.monotonic() < deadline, "requests not applied"
                time.sleep(0.05)
        finally:
            service.stop()

    serve([("a", ids[0]), ("b", ids[1])])
    store = VersionStore(root)
    assert store.current(MODEL) == 2
    assert _record(root, 1)["preparation"]["built_for_this_request"]
    assert not _record(root, 2)["preparation"]["built_for_this_request"]
    with store.lock(MODEL):
        rollback(store, MODEL, 1, "audit", [root / "ledger.sqlite3"])
    serve([("c", ids[2])])
    assert store.manifest(MODEL, 3)["parent"] == 1
    assert _record(root, 3)["preparation"]["built_for_this_request"]
    conn = sqlite3.connect(root / "ledger.sqlite3")
    kinds = [k for (k,) in conn.execute("SELECT kind FROM events WHERE kind = 'batch_costs'")]
    conn.close()
    assert len(kinds) == 3  # the stream's batches record their costs too
    led = Ledger(root / "ledger.sqlite3", create=False)
    assert led.get_request("b").state == "needs_retrain" and led.get_request("c").version == 3
    led.close()


def test_a_carried_preconditioner_gives_the_weights_of_a_rebuilt_one(tmp_path, mlp_dir, monkeypatch):
    """Between versions the decision layer's state keeps the previous H_P(D)^-1 as the matrix-free
    Newton's preconditioner (pipeline.decision_layer.PRECONDITIONER_MAX_AGE) instead of rebuilding the
    dense matrix: the Newton iteration stops on its own tolerance, so every version's weights are those
    of a campaign that rebuilt it each time; the record says how old the preconditioner was, and it is
    rebuilt when it reaches the limit."""
    from jobs.campaign_runner import run_campaign
    from jobs.specs import CampaignSpec, load_spec
    from pipeline import decision_layer

    ids = _ids(mlp_dir, 5)
    groups = [[i] for i in ids]
    monkeypatch.setattr(decision_layer, "PRECONDITIONER_MAX_AGE", 3)
    carried = make_store(tmp_path / "carried", mlp_dir, MODEL)
    result = run_campaign(load_spec(_spec(tmp_path, carried, "carried", groups), CampaignSpec), progress=False,
                          echo=lambda _: None)
    assert [b.state for b in result.batches] == ["applied"] * 5
    ages = [_record(carried, v)["preparation"].get("preconditioner_age") for v in range(1, 6)]
    assert ages == [0, 1, 2, 0, 1], ages  # built, carried twice, rebuilt at the limit, carried
    monkeypatch.setattr(decision_layer, "PRECONDITIONER_MAX_AGE", 1)  # rebuilt at every version
    rebuilt = make_store(tmp_path / "rebuilt", mlp_dir, MODEL)
    run_campaign(load_spec(_spec(tmp_path, rebuilt, "rebuilt", groups), CampaignSpec), progress=False,
                 echo=lambda _: None)
    assert [_record(rebuilt, v)["preparation"].get("preconditioner_age") for v in range(1, 6)] == [0] * 5
    for version in range(1, 6):
        _close(_weights(carried, version), _weights(rebuilt, version))
