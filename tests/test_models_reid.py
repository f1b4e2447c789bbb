"""reid-resnet50 preset: the real ResNet-50 layout, torchreid / strong-baseline / torchvision
checkpoints, refusal with key lists, retrieval features, and a removal end to end."""
from __future__ import annotations

import pytest
import torch

from pipeline.checkpoint import CheckpointMismatchError
from pipeline.models import build, load_checkpoint
from pipeline.models.reid_resnet50 import count_backbone_parameters
from tests.kit import assert_removal_end_to_end, trained_model_dir as train_model_dir

TINY = {"num_classes": 3, "image_size": 16, "width": 4, "layers": [1, 1, 1, 1]}


def tiny(**extra):
    torch.manual_seed(2)
    model = build("reid-resnet50", {**TINY, **extra})[0]
    return model.eval()


def test_default_is_resnet50_with_bnneck_and_751_identities():
    model, task = build("reid-resnet50")
    assert count_backbone_parameters(model) == 23_508_032  # torchvision resnet50 without fc
    assert model.classifier.weight.shape == (751, 2048) and model.classifier.bias is None
    assert not model.bottleneck.bias.requires_grad  # BNNeck: shift frozen
    assert [n for n, _ in model.named_parameters()][:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert "layer4.2.conv3.weight" in model.state_dict() and "layer1.0.downsample.0.weight" in model.state_dict()
    assert task.loss == "cross_entropy" and task.loss_options == {"label_smoothing": 0.1}


def test_features_and_logits_shapes():
    model = tiny()
    x = torch.randn(4, 3, 16, 8)
    assert model.features(x).shape == (4, 4 * 8 * 4)
    assert model(x).shape == (4, 3)


def test_loads_torchreid_checkpoint_with_state_dict_entry_and_module_prefix(tmp_path):
    source = tiny(neck="none", classifier_bias=True)  # torchreid's plain resnet50 head
    payload = {"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()},
               "epoch": 60, "rank1": 0.87, "optimizer": {"state": {}, "param_groups": []}}
    torch.save(payload, tmp_path / "model.pth.tar")
    target = tiny(neck="none", classifier_bias=True)
    report = load_checkpoint(target, "reid-resnet50", tmp_path / "model.pth.tar")
    assert report.layout in {"native", "torchreid"}
    x = torch.randn(2, 3, 16, 8)
    assert torch.allclose(source(x), target(x))


def test_loads_strong_baseline_layout():
    source = tiny()
    state = {(k if k.startswith(("bottleneck.", "classifier.")) else f"base.{k}"): v
             for k, v in source.state_dict().items()}
    target = tiny()
    assert load_checkpoint(target, "reid-resnet50", state).layout == "strong-baseline"
    assert torch.allclose(source.features(torch.ones(1, 3, 16, 8)), target.features(torch.ones(1, 3, 16, 8)))


def test_torchvision_imagenet_backbone_with_backbone_scope():
    source = tiny()
    state = {k: v for k, v in source.state_dict().items() if not k.startswith(("bottleneck.", "classifier."))}
    state["fc.weight"], state["fc.bias"] = torch.zeros(1000, 128), torch.zeros(1000)
    target = tiny()
    with pytest.raises(CheckpointMismatchError, match="bottleneck.weight"):
        load_checkpoint(tiny(), "reid-resnet50", state)  # full scope: the neck is missing
    report = load_checkpoint(target, "reid-resnet50", state, scope="backbone")
    assert report.layout == "torchvision" and "classifier.weight" in report.dropped_from_checkpoint
    assert torch.equal(target.layer3[0].conv2.weight, source.layer3[0].conv2.weight)


def test_wrong_checkpoint_lists_keys():
    state = tiny().state_dict()
    state.pop("layer2.0.bn1.running_var")
    state["layer5.0.conv1.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint(tiny(), "reid-resnet50", state, layout="native")
    assert "layer2.0.bn1.running_var" in str(err.value) and "layer5.0.conv1.weight" in str(err.value)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return train_model_dir(
        tmp_path_factory.mktemp("reid") / "model", "reid-resnet50", TINY, "fashion-mnist",
        {"classes": [1, 5, 9], "per_class": 12, "test_per_class": 4, "image_size": 16, "channels": 3},
        {"optimizer": "sgd", "epochs": 2, "lr": 0.05, "batch_size": 12, "weight_decay": 5e-4, "seed": 0},
    )


@pytest.mark.slow
def test_removal_end_to_end_tiny(tiny_model_dir):
    assert_removal_end_to_end(tiny_model_dir)


@pytest.mark.slow
def test_identity_forgetting_scorecard_has_retrieval_metrics(tiny_model_dir, tmp_path):
    from pipeline.evaluate.protocol import EvalConfig, evaluate

    result = evaluate(EvalConfig.model_validate({
        "model_dir": str(tiny_model_dir), "forget": {"scenario": "class", "classes": [2]}, "methods": {},
        "baselines": ["retrain"], "residual_gradient": False, "cache_dir": str(tmp_path / "cache"),
    }))
    rows = result["rows"]
    assert result["m"] == 12  # every training image of identity 2
    assert rows["retrain"]["UA"] == 100.0
    for row in rows.values():
        # retrieval on the remaining identities' test images: 2 queries (one per identity)
        assert 0 < row["mAP"] <= 100 and row["rank1"] in (0.0, 50.0, 100.0)
