"""The stream service with ``fast_path.enabled`` (a real `stream serve` subprocess on 127.0.0.1, the
real SQLite ledger and version store): every micro-batch is applied on the warm decision-layer
state, the record says which path it took (fast / refresh, with the drift bound), a restart and
a rollback rebuild the state from the current version, and under SIGKILLs at random moments every
acknowledged request is applied exactly once (the audit of tests/test_unlearn_random_kills.py)."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch

from pipeline.models.card import load_model_dir
from pipeline.removal import training_set
from pipeline.store.versions import VersionStore
from pipeline.streaming import DecisionLayerStream, StreamSettings
from tests.test_unlearn_random_kills import TOKEN, _env, _ledger, _rng, _serve, _wait_port, audit, wait_applied
from tests.unlearn_store_support import REPO, cached_model_dir, http_json, make_store, train_ids, unlearn_argv, write_yaml

MODEL = "digits"
LAYER = ["1.weight", "1.bias"]
METHOD = {"name": "decision-layer-newton", "settings": {"parameters": LAYER, "target": "retrain"}}
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def _config(tmp_path, store, **fast):
    port_file = tmp_path / "port"
    config = write_yaml(tmp_path / "service.yaml", {
        "model": {"store": str(store), "name": MODEL}, "method": METHOD, "seed": 3, "port": 0,
        "port_file": str(port_file), "limits": {"budget": {"epsilon": 1000.0, "delta": 0.01, "composition": "basic",
                                                           "allow_non_private": True},
                                                "retain_accuracy_margin": 0.05},
        "auth": {"clients": [{"client": "t", "token_env": "UNLEARN_KILL_TOKEN"}]},
        "batching": {"max_requests": 2, "max_wait_s": 0.05},
        "rate_limit": {"requests_per_second": 10000, "burst": 10000},
        "fast_path": {"enabled": True, **fast},
    })
    return config, port_file


def _records(store) -> list[dict]:
    vs = VersionStore(store)
    return [vs.manifest(MODEL, v)["record"] for v in vs.versions(MODEL) if v > 0 and vs.manifest(MODEL, v).get("record")]


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return err


def _serve_one(config, port_file, store, request_id: str, sample: int) -> str:
    """Start the service, have one request applied, stop it; its log."""
    proc, _ = _serve(config, port_file)
    try:
        port = _wait_port(proc, port_file)
        code, _ = http_json(port, "POST", "/v1/requests", {"request_id": request_id, "subject": "x",
                                                           "sample_ids": [sample]}, HEADERS)
        assert code == 202
        wait_applied(store / "ledger.sqlite3", {request_id})
        return _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_fast_path_service_records_paths_and_rebuilds_after_restart_and_rollback(tmp_path, tmp_path_factory):
    store = make_store(tmp_path / "store", cached_model_dir(tmp_path_factory), MODEL)
    config, port_file = _config(tmp_path, store, refresh_every=3, drift_threshold=1.0)
    ids = train_ids(14)
    proc, _ = _serve(config, port_file)
    try:
        port = _wait_port(proc, port_file)
        for k in range(8):  # one at a time: one batch per request
            code, body = http_json(port, "POST", "/v1/requests", {"request_id": f"f{k}", "subject": "x",
                                                                   "sample_ids": [ids[k]]}, HEADERS)
            assert code == 202, body
            wait_applied(store / "ledger.sqlite3", {f"f{k}"})
        err = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    audit(store, store / "ledger.sqlite3", final=True)
    assert f"fast path: state built from {VersionStore(store).version_dir(MODEL, 0).name} " in err
    records = _records(store)
    assert len(records) == 8
    paths = [r["fast_path"]["path"] for r in records]
    assert paths == ["fast", "fast", "refresh", "fast", "fast", "refresh", "fast", "fast"], paths
    assert [r["fast_path"]["target_reached"] for r in records] == [p == "refresh" for p in paths]
    assert all(r["fast_path"]["built"] is None for r in records)  # warmed at start, then kept warm
    assert all(r["fast_path"]["gradient_error_bound"] >= 0 for r in records)

    # the published weights: within the recorded distance bound of the target on D_r (the model was trained
    # by L-BFGS, so Retrain's point is the minimiser: a = 0, converged exactly from version 0's state), up to
    # float32 rounding
    assert all(r["target"]["how"] == "minimiser" for r in records)
    vs = VersionStore(store)
    model0, task, card0 = load_model_dir(vs.version_dir(MODEL, 0))
    oracle, _ = DecisionLayerStream.from_model(model0, task, training_set(card0), LAYER, card0.training.weight_decay,
                                               settings=StreamSettings(refresh_every=10**6))
    oracle.remove(ids[:8], target=lambda st: torch.zeros(st.p, dtype=torch.float64))
    oracle_refresh = oracle.refresh(converge=True)
    assert oracle_refresh["converged"]
    model, _, _ = load_model_dir(vs.open_verified(MODEL).path)
    published = torch.cat([model.state_dict()[LAYER[0]].reshape(-1), model.state_dict()[LAYER[1]]]).double()
    moved = float(torch.linalg.vector_norm(oracle.theta - torch.cat([model0.state_dict()[LAYER[0]].reshape(-1),
                                                                      model0.state_dict()[LAYER[1]]]).double()))
    error = float(torch.linalg.vector_norm(oracle.theta - published))
    assert moved > 1e-3 and error <= records[-1]["fast_path"]["distance_bound"] + 1e-5 * float(published.norm())
    # the bound recorded for the weights as published (float32), with no rounding allowance: rigorous
    # by lambda-strong convexity, up to the oracle's own distance to the optimum
    lam = card0.training.weight_decay
    assert error <= records[-1]["fast_path"]["distance_to_target_bound"] + oracle_refresh["residual_after"] / lam
    assert all(r["fast_path"]["refresh_converged"] in (None, True) for r in records)
    # a fast step's published residual is its drift measure, taken at the rounded (published) weights:
    # the exact residual of exactly these weights
    assert records[-1]["fast_path"]["published_residual_from"].startswith("drift measure")
    assert records[-1]["fast_path"]["published_residual"] == pytest.approx(
        float(torch.linalg.vector_norm(oracle.exact_gradient(published) - oracle.anchor)), rel=1e-9)

    # verification from the cached layer inputs: the same accuracies as full passes of the model
    from pipeline.data import load_source
    from pipeline.evaluate.removal_metrics import accuracy_share

    last = vs.manifest(MODEL, 8)["metrics"]
    splits = load_source(card0.data.source, card0.data.options)
    forget = splits["train"].take(splits["train"].positions_of([ids[7]]))
    assert last["measured_on"] == "cached decision-layer inputs"
    assert last["retain_accuracy"] == pytest.approx(accuracy_share(model, task, training_set(load_model_dir(
        vs.version_dir(MODEL, 8))[2])), abs=1e-6)
    assert last["test_accuracy"] == pytest.approx(accuracy_share(model, task, splits["test"]), abs=1e-6)
    assert last["forget_accuracy"] == pytest.approx(accuracy_share(model, task, forget), abs=1e-6)
    model7, _, card7 = load_model_dir(vs.version_dir(MODEL, 7))  # the parent: "before" (reused predictions)
    assert last["test_accuracy_before"] == pytest.approx(accuracy_share(model7, task, splits["test"]), abs=1e-6)
    assert last["retain_accuracy_before"] == pytest.approx(accuracy_share(model7, task, training_set(load_model_dir(
        vs.version_dir(MODEL, 8))[2])), abs=1e-6)

    # restart: the state is rebuilt from the current version (8)
    err = _serve_one(config, port_file, store, "g0", ids[8])
    audit(store, store / "ledger.sqlite3", final=True)
    assert f"fast path: state built from {vs.version_dir(MODEL, 8).name} " in err
    # rollback to version 4, then a new request: rebuilt from version 4, never from the state of 9
    # (`unlearn versions rollback` in this process: the same command, one interpreter start less)
    from click.testing import CliRunner

    from jobs.versions import command as versions_command

    rolled = CliRunner().invoke(versions_command, ["rollback", "--store", str(store), "--model", MODEL, "4",
                                                   "--reason", "test"])
    assert rolled.exit_code == 0, rolled.output
    err = _serve_one(config, port_file, store, "h0", ids[9])  # (no audit: it assumes a chain without rollbacks)
    assert f"fast path: state built from {vs.version_dir(MODEL, 4).name} " in err
    current = vs.open_verified(MODEL)
    assert current.parent == 4
    card = load_model_dir(current.path)[2]
    assert sorted(card.training.removed_ids) == sorted(ids[:4] + [ids[9]])


def test_fast_path_refuses_noisy_settings_naming_the_field(tmp_path, tmp_path_factory):
    store = make_store(tmp_path / "store", cached_model_dir(tmp_path_factory), MODEL)
    config, _ = _config(tmp_path, store)
    text = config.read_text().replace("target: retrain", "target: retrain\n    epsilon: 2.0")
    config.write_text(text)
    run = subprocess.run(unlearn_argv("stream", "serve", "--config", str(config)), capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=_env())
    assert run.returncode != 0
    assert "method.settings.epsilon must be .inf" in run.stderr


def test_random_kills_of_the_fast_path_service(tmp_path, tmp_path_factory):
    """SIGKILL at random moments inside the micro-batches; each restart rebuilds the warm state;
    at the end every acknowledged request is applied exactly once."""
    rng = _rng()
    store = make_store(tmp_path / "store", cached_model_dir(tmp_path_factory), MODEL)
    config, port_file = _config(tmp_path, store, refresh_every=4)
    ledger = store / "ledger.sqlite3"
    ids = train_ids(12)
    acknowledged: set[str] = set()
    for life in range(3):
        proc, _ = _serve(config, port_file)
        port = _wait_port(proc, port_file)
        for k in range(4 * life, 4 * life + 4):
            code, body = http_json(port, "POST", "/v1/requests",
                                   {"request_id": f"k{k}", "subject": "x", "sample_ids": [ids[k]]}, HEADERS)
            assert code == 202, body
            acknowledged.add(f"k{k}")
        time.sleep(rng.uniform(0.02, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        states = audit(store, ledger, final=False)
        assert acknowledged <= set(states), "an acknowledged request was lost"
    proc, _ = _serve(config, port_file)
    try:
        _wait_port(proc, port_file)
        wait_applied(store / "ledger.sqlite3", acknowledged)
        _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    states = audit(store, ledger, final=True)
    assert states == {r: "applied" for r in acknowledged} and len(acknowledged) == 12
    assert not [b for b in _ledger(ledger)[1] if b["state"] not in ("applied",)], _ledger(ledger)[1]
    assert {r["fast_path"]["path"] for r in _records(store)} <= {"fast", "refresh"}


@pytest.mark.parametrize("field", ["refresh_every"])
def test_fast_path_config_fields_are_validated(tmp_path, tmp_path_factory, monkeypatch, field):
    """`unlearn stream check` (in this process) refuses the field, naming it."""
    from click.testing import CliRunner

    from jobs.stream import command as stream_command

    store = make_store(tmp_path / "store", cached_model_dir(tmp_path_factory), MODEL)
    config, _ = _config(tmp_path, store, **{field: 0})
    monkeypatch.setenv("UNLEARN_KILL_TOKEN", TOKEN)
    run = CliRunner().invoke(stream_command, ["check", "--config", str(config)])
    assert run.exit_code != 0 and f"fast_path.{field}" in run.output, run.output


def test_remover_rebuilds_instead_of_reusing_a_state_for_other_weights_or_data(tmp_path_factory):
    """In process: after a run that was not published, and after a failed removal, the next
    removal rebuilds the state from the directory it is given."""
    from pipeline.stream_removal import WarmStreamRemover

    model_dir = cached_model_dir(tmp_path_factory)
    remover = WarmStreamRemover("decision-layer-newton", METHOD["settings"], StreamSettings(refresh_every=100))
    ids = train_ids(4)
    first = remover.remove(model_dir, [ids[0]])
    assert remover.builds == 1 and first.record["fast_path"]["built"] is not None
    again = remover.remove(model_dir, [ids[1]])   # the first run was never published: same parent
    assert remover.builds == 2 and again.card.training.removed_ids == [ids[1]]
    with pytest.raises(ValueError, match="sample_ids: sample id 999999 is not in the training set"):
        remover.remove(model_dir, [999999])
    assert remover.state is None and remover.builds == 3  # (rebuilt for the parent, then dropped)
    remover.remove(model_dir, [ids[2]])
    assert remover.builds == 4
