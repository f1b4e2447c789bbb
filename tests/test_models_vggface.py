"""vggface preset: builds, loads VGG-Face (conv1_1 ...) and torchvision-layout checkpoints,
refuses wrong ones with the key lists, and runs a removal end to end at 32x32."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from pipeline.checkpoint import CheckpointMismatchError
from pipeline.models import build, load_checkpoint
from pipeline.models.vggface import VGGFACE_CONV_NAMES, conv_feature_indices, to_vggface_names
from tests.kit import assert_removal_end_to_end, trained_model_dir as train_model_dir

TINY = {"num_classes": 3, "image_size": 32, "width_divisor": 16, "hidden": 32, "pool_size": 1, "dropout": 0.0}


def tiny(**extra):
    torch.manual_seed(1)
    return build("vggface", {**TINY, **extra})[0]


def test_default_is_vgg16_d_with_2622_identities():
    assert conv_feature_indices() == [0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28]
    model, task = build("vggface", {"hidden": 8})  # real conv widths, small fc to keep it light
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["features.0.weight", "features.0.bias"]
    assert model.features[28].weight.shape == (512, 512, 3, 3)
    assert model.classifier[0].weight.shape == (8, 512 * 7 * 7)
    assert model.classifier[6].weight.shape == (2622, 8)
    assert task.loss == "cross_entropy"
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 2622)  # adaptive pool: small inputs work


def test_loads_vggface_names_including_fully_convolutional_fc(tmp_path):
    source = tiny()
    state = to_vggface_names(source.state_dict())
    assert {f"{n}.weight" for n in VGGFACE_CONV_NAMES} <= set(state) and "fc8.weight" in state
    # Caffe-style fc kernels: fc6 as (out, C, k, k) over the pooled map, fc7/fc8 as 1x1.
    state["fc6.weight"] = state["fc6.weight"].reshape(32, 32, 1, 1)
    state["fc7.weight"] = state["fc7.weight"].reshape(32, 32, 1, 1)
    path = tmp_path / "vgg_face_dag.pth"
    torch.save(state, path)
    target = tiny()
    report = load_checkpoint(target, "vggface", path)
    assert report.layout == "vggface"
    x = torch.randn(2, 3, 32, 32)
    source.eval(), target.eval()
    assert torch.allclose(source(x), target(x))


def test_loads_torchvision_layout_pt_and_safetensors(tmp_path):
    source = tiny()
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}, "epoch": 3}, tmp_path / "tv.pth")
    save_file(source.state_dict(), str(tmp_path / "tv.safetensors"))
    for name in ("tv.pth", "tv.safetensors"):
        target = tiny()
        report = load_checkpoint(target, "vggface", tmp_path / name)
        assert report.layout == "torchvision"
        assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


def test_backbone_scope_keeps_fresh_identity_head():
    source = tiny(num_classes=5)  # other identities
    target = tiny(num_classes=3)
    head = target.classifier[6].weight.clone()
    report = load_checkpoint(target, "vggface", to_vggface_names(source.state_dict()), scope="backbone")
    assert "classifier.6.weight" in report.dropped_from_checkpoint
    assert torch.equal(target.classifier[6].weight, head)
    assert torch.equal(target.features[0].weight, source.features[0].weight)


def test_wrong_checkpoint_lists_missing_and_unexpected_keys():
    state = to_vggface_names(tiny().state_dict())
    del state["conv3_2.weight"]
    state["fc9.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint(tiny(), "vggface", state)
    assert "features.12.weight" in str(err.value) and "fc9.weight" in str(err.value)
    wide = build("vggface", {**TINY, "width_divisor": 8})[0].state_dict()
    with pytest.raises(CheckpointMismatchError, match="shape mismatches"):
        load_checkpoint(tiny(), "vggface", wide)


@pytest.mark.slow
def test_fine_tune_from_vggface_checkpoint_then_remove(tmp_path):
    from pipeline.models.card import read_card

    pretrained = tiny(num_classes=5)  # "VGG-Face" trained on other identities
    torch.save(to_vggface_names(pretrained.state_dict()), tmp_path / "vgg_face_dag.pth")
    directory = train_model_dir(
        tmp_path / "vgg", "vggface", TINY, "fashion-mnist",
        {"classes": [0, 1, 7], "per_class": 12, "test_per_class": 4, "image_size": 32, "channels": 3},
        {"optimizer": "sgd", "epochs": 2, "lr": 0.02, "batch_size": 12, "weight_decay": 5e-4, "seed": 0},
        init={"checkpoint": str(tmp_path / "vgg_face_dag.pth"), "scope": "backbone"},
    )
    report = read_card(directory).training.extra["init_report"]
    assert report["layout"] == "vggface" and "classifier.6.weight" in report["dropped_from_checkpoint"]
    out = assert_removal_end_to_end(directory)
    assert out["record"]["method"] == "lfoci-newton"
