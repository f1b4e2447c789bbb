"""The example configs of the two benchmark models run as written, on a small profile.

For Fashion-MNIST (configs/models/fmnist-head.yaml) and Reuters R8 (configs/models/r8-head.yaml):
the model config is trained with `unlearn train`'s code on a small profile (``PROFILES``: a data
limit the example request files were drawn within; for R8 also 32 tokens and 50 test stories),
imported into a version store; then, read as written, with only their store (and the service's
port and token) pointed here:
  * configs/campaigns/<model>.yaml and its request file: every batch applied, the report with each
    request's cost by stage;
  * configs/stream/<model>.yaml: the service on its fast path applies requests;
  * `unlearn forget --method newton-head` gives, bit for bit, the weights of the benchmark's
    newton-head row (bench/forgetting.py's run_removal: the same preparation and removal).
The R8 model also reproduces the benchmark's head at its initialisation (the same seeded draws)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.store.versions import VersionStore
from tests.unlearn_store_support import make_store

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PROFILES = {
    "fmnist-head": {"data": {"limit": 2000}},
    "r8-head": {"data": {"limit": 300, "test_limit": 50, "max_length": 32}},
}


@pytest.fixture(scope="module", params=sorted(PROFILES))
def trained(request, tmp_path_factory) -> tuple[str, Path]:
    """(name, model directory): the model config trained on its small profile."""
    from pipeline.config import load_config
    from pipeline.trainer import TrainConfig, run_training

    name = request.param
    config = load_config(TrainConfig, CONFIGS / "models" / f"{name}.yaml", "train config")
    data = config.data.model_copy(update={"options": {**config.data.options, **PROFILES[name]["data"]}})
    out = tmp_path_factory.mktemp(name) / "model"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = run_training(config.model_copy(update={"data": data}), out)
    finally:
        torch.set_num_threads(threads)  # the tests that follow, in any order, keep the session's threads
    assert summary["n"] == PROFILES[name]["data"]["limit"]
    return name, out


def test_the_campaign_example_runs_as_written(trained, tmp_path):
    from jobs.campaign_runner import run_campaign
    from jobs.specs import CampaignSpec, load_spec
    from pipeline.data.requests import read_requests

    name, model_dir = trained
    spec = load_spec(CONFIGS / "campaigns" / f"{name}.yaml", CampaignSpec)
    store = make_store(tmp_path / "store", model_dir, spec.model.name)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"store": store})})
    requests = read_requests(spec.requests)
    result = run_campaign(spec, progress=False, echo=lambda _: None)
    assert [b.state for b in result.batches] == ["applied"] * -(-len(requests) // spec.batch_size), \
        [(b.state, b.reason) for b in result.batches]
    report = json.loads((spec.report_path() / "report.json").read_text())
    assert report["requests"]["applied"] == len(requests)
    costs = report["costs"]
    assert costs["requests_recorded"] == len(requests) and costs["mean_per_request"]["sum"] > 0
    assert (spec.report_path() / "costs.png").is_file()
    versions = VersionStore(store)
    first = versions.manifest(spec.model.name, 1)["record"]
    assert first["variant"] == "newton-head" and first["preparation"]["frozen_prefix"] is not None
    last = versions.manifest(spec.model.name, len(result.batches))["record"]
    assert not last["preparation"]["built_for_this_request"]  # carried from batch to batch


def test_the_stream_example_runs_as_written(trained, tmp_path, monkeypatch):
    from jobs.service import UnlearnService
    from jobs.specs import ServiceConfig, load_spec
    from pipeline.data.requests import read_requests

    name, model_dir = trained
    config = load_spec(CONFIGS / "stream" / f"{name}.yaml", ServiceConfig)
    assert config.fast_path.enabled and config.method.name == "newton-head"
    store = make_store(tmp_path / "store", model_dir, config.model.name)
    config = config.model_copy(update={"model": config.model.model_copy(update={"store": store}), "port": 0})
    monkeypatch.setenv(config.auth.clients[0].token_env, "example-token-0123456789abcdef")
    requests = read_requests(CONFIGS / "campaigns" / f"{name}-requests.csv")[:5]
    service = UnlearnService(config, log=lambda _msg: None)
    service.start()
    try:
        for r in requests:
            code, _ = service.submit(config.auth.clients[0].client, r.model_dump(mode="json"))
            assert code == 202
        deadline = time.monotonic() + 300
        while any(service.ledger.get_request(r.request_id).state != "applied" for r in requests):
            states = {service.ledger.get_request(r.request_id).state for r in requests}
            assert not states & {"failed", "needs_retrain"} and time.monotonic() < deadline, states
            time.sleep(0.1)
    finally:
        service.stop()
    record = VersionStore(store).manifest(config.model.name, 1)["record"]
    assert record["fast_path"]["path"] in ("fast", "refresh")  # on the warm decision-layer state (built at start)


def test_forget_newton_head_runs_the_benchmarks_prepared_path(trained, tmp_path):
    """`unlearn forget --method newton-head` on the benchmark model and bench/forgetting.py's
    newton-head row: the same preparation and removal, the same weights bit for bit."""
    from click.testing import CliRunner

    from bench.forgetting import EVAL_BATCH, resolved_settings, run_removal
    from jobs.forget import command as forget_command
    from pipeline.checkpoint import read_state_dict
    from pipeline.removal import load_trained

    name, model_dir = trained
    loaded = load_trained(model_dir)
    ids = loaded.train.sample_ids[:5].tolist()
    config = tmp_path / "forget.yaml"
    config.write_text(yaml.safe_dump({"model": str(model_dir), "forget": {"sample_ids": ids},
                                      "output": str(tmp_path / "out"), "batch_size": EVAL_BATCH}))
    result = CliRunner().invoke(forget_command, ["--config", str(config), "--method", "newton-head"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "out" / "removal.json").read_text())
    assert record["variant"] == "newton-head" and record["preparation"]["built_for_this_request"]
    assert record["preparation"]["frozen_prefix"]["suffix_start_module"] == 3  # the decision layer over the hidden features
    cli = read_state_dict(tmp_path / "out" / "model.safetensors")
    settings = resolved_settings("newton-head", len(loaded.train) - len(ids), quick=False)
    bench_model, _, _ = run_removal("newton-head", settings, loaded.model, loaded.task, loaded.train,
                                    loaded.train.positions_of(ids), loaded.weight_decay, 0, loaded.card)
    for key, value in bench_model.state_dict().items():
        assert torch.equal(value, cli[key]), key


def test_the_r8_model_starts_from_the_benchmarks_head():
    """text-mean-mlp draws its head as the benchmark's mlp preset does (same seed, same weights), and
    its pooled encoder output is the benchmark's cached minilm-mean feature."""
    from bench.forgetting import DATASETS
    from pipeline.data import load_source
    from pipeline.features import minilm_mean_features
    from pipeline.recipe import initial_model

    config = yaml.safe_load((CONFIGS / "models" / "r8-head.yaml").read_text())
    model, task, _ = initial_model("text-mean-mlp", config["model"]["options"], seed=0)
    head, _, _ = initial_model("mlp", {"in_features": 384, "hidden": [DATASETS["r8"]["hidden"]], "num_classes": 8,
                                       "activation": "relu"}, seed=0)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["1.weight", "1.bias", "3.weight", "3.bias"]
    for key in ("1.weight", "1.bias", "3.weight", "3.bias"):
        assert torch.equal(model.state_dict()[key], head.state_dict()[key])
    data = load_source("reuters-r8", {**config["data"]["options"], "limit": 20, "test_limit": 1})["train"]
    model.eval()
    with torch.no_grad():
        pooled = model[0](data.columns["input_ids"], data.columns["attention_mask"])
    reference = minilm_mean_features(data, DATASETS["r8"]["extractor_options"])
    assert torch.allclose(pooled, reference, atol=1e-5)
