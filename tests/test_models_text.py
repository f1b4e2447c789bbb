"""text preset: HF sequence classifiers from local directories (the real MiniLM, a tiny random
DistilBERT), tokenizer-derived TokenTask, checkpoint layouts and refusals, a removal end to end."""
from __future__ import annotations

import pytest
import torch

from pipeline.checkpoint import CheckpointMismatchError
from pipeline.hf_local import ModelPathError, resolve_model_path
from pipeline.models import build, load_checkpoint
from pipeline.models.text import freeze_all_but_last
from tests.kit import assert_removal_end_to_end, trained_model_dir as train_model_dir

MINILM = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def minilm_dir():
    return resolve_model_path(MINILM)


@pytest.fixture(scope="module")
def distilbert_dir(tmp_path_factory):
    """A tiny randomly initialised DistilBERT saved as an HF directory (no tokenizer files)."""
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(0)
    cfg = DistilBertConfig(vocab_size=120, dim=16, n_layers=2, n_heads=2, hidden_dim=32,
                           max_position_embeddings=64, pad_token_id=0)
    directory = tmp_path_factory.mktemp("distilbert")
    DistilBertModel(cfg).save_pretrained(directory)
    return directory


def test_minilm_builds_with_tokenizer_task(minilm_dir):
    model, task = build("text", {"model_path": MINILM, "num_labels": 8})
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.classifier.out_features == 8
    assert task.vocab_size == 30522 and set(task.special_ids) == {0, 100, 101, 102, 103}
    assert task.loss == "cross_entropy"
    multi = build("text", {"model_path": str(minilm_dir), "num_labels": 5, "multi_label": True})[1]
    assert multi.loss == "bce_multilabel"


def test_minilm_directory_loads_as_encoder_checkpoint(minilm_dir):
    model, _ = build("text", {"model_path": MINILM, "num_labels": 3})
    with torch.no_grad():
        for p in model.bert.parameters():
            p.zero_()
    report = load_checkpoint(model, "text", minilm_dir, scope="backbone")
    assert report.layout == "hf-base"
    assert any(k.endswith("position_ids") for k in report.dropped_from_checkpoint)
    fresh, _ = build("text", {"model_path": MINILM, "num_labels": 3})
    assert torch.equal(model.bert.encoder.layer[5].output.dense.weight, fresh.bert.encoder.layer[5].output.dense.weight)
    with pytest.raises(CheckpointMismatchError, match="classifier.weight"):
        load_checkpoint(model, "text", minilm_dir)  # full scope: the head is missing


def test_saved_classifier_directory_round_trip(minilm_dir, tmp_path):
    model, _ = build("text", {"model_path": MINILM, "num_labels": 4})
    model.save_pretrained(tmp_path / "clf")
    twin, _ = build("text", {"model_path": MINILM, "num_labels": 4})
    assert load_checkpoint(twin, "text", tmp_path / "clf").layout == "hf"
    assert torch.equal(twin.classifier.weight, model.classifier.weight)
    wrong, _ = build("text", {"model_path": MINILM, "num_labels": 5})
    with pytest.raises(CheckpointMismatchError, match="classifier.weight: checkpoint"):
        load_checkpoint(wrong, "text", tmp_path / "clf")


def test_tiny_distilbert_directory(distilbert_dir, tmp_path):
    model, task = build("text", {"model_path": str(distilbert_dir), "num_labels": 3})
    assert type(model).__name__ == "DistilBertForSequenceClassification"
    assert task.vocab_size == 120 and 0 in task.special_ids
    ids = torch.randint(1, 120, (2, 10))
    assert model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.shape == (2, 3)
    report = load_checkpoint(model, "text", distilbert_dir, scope="backbone")
    assert report.layout == "hf-base" and "classifier.weight" in report.kept_from_model
    model.save_pretrained(tmp_path / "seqcls")
    twin, _ = build("text", {"model_path": str(distilbert_dir), "num_labels": 3})
    assert load_checkpoint(twin, "text", tmp_path / "seqcls").layout == "hf"
    torch.save({"distilbert.embeddings.word_embeddings.weight": torch.zeros(120, 16)}, tmp_path / "partial.bin")
    with pytest.raises(CheckpointMismatchError, match="missing keys"):
        load_checkpoint(twin, "text", tmp_path / "partial.bin")


def test_freeze_all_but_last_layers(distilbert_dir):
    model, _ = build("text", {"model_path": str(distilbert_dir), "num_labels": 2})
    kept = freeze_all_but_last(model, 1)
    assert all(n.startswith(("distilbert.transformer.layer.1.", "pre_classifier", "classifier")) for n in kept)
    assert any(n.startswith("distilbert.transformer.layer.1.") for n in kept)
    assert not model.distilbert.embeddings.word_embeddings.weight.requires_grad


def test_missing_path_and_uncached_hub_name_are_clear_errors(tmp_path):
    with pytest.raises(ModelPathError, match="does not exist"):
        build("text", {"model_path": str(tmp_path / "nope"), "num_labels": 2})
    with pytest.raises(ModelPathError, match="not in the local Hugging Face cache"):
        resolve_model_path("distilbert/distilbert-base-uncased-not-cached")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelPathError, match="without config.json"):
        resolve_model_path(tmp_path / "empty")


@pytest.mark.slow
def test_minilm_r8_removal_end_to_end(tmp_path):
    directory = train_model_dir(
        tmp_path / "minilm", "text", {"model_path": MINILM, "num_labels": 8, "train_last_layers": 0},
        "reuters-r8", {"max_length": 32, "per_class": 8, "test_per_class": 2},
        {"optimizer": "sgd", "epochs": 2, "lr": 0.1, "batch_size": 16, "weight_decay": 1e-4, "seed": 0},
    )
    out = assert_removal_end_to_end(directory, settings={
        "perturbations": 16, "pass_size": 16, "max_slices": 4, "curvature_samples": 16, "damping": 0.01,
        "dense_max": 32, "cg_rtol": 1e-6, "forget_gradient_share": 0.0, "newton_max_steps": 1,
        "min_gradient_reduction": 0.0})
    assert all(not k.startswith("bert.embeddings") for k in out["changed"])  # frozen stays frozen


@pytest.mark.parametrize("which", ["distilbert", "minilm"])
def test_padding_mask_is_exact_and_vmap_safe(which, distilbert_dir):
    """The task's 4-D additive mask gives HF's own logits, and per-sample gradients (vmap) and
    forward-over-reverse products (jvp of grad) run through it - what the removal methods need."""
    from torch.func import functional_call, grad, jvp, vmap

    from pipeline.tasks import output_logits

    path = str(distilbert_dir) if which == "distilbert" else MINILM
    model, task = build("text", {"model_path": path, "num_labels": 3})
    model.eval()
    ids = torch.randint(5, 100, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "y": torch.tensor([0, 1, 2])}
    assert torch.allclose(task.forward(model, batch), model(input_ids=ids, attention_mask=mask).logits, atol=1e-5)
    params = {k: v.detach() for k, v in model.named_parameters() if k.startswith("classifier")}

    def loss(p, b):
        args, kwargs = task.model_args(b)
        return task.per_sample_loss(output_logits(functional_call(model, p, args, kwargs)), b).sum()

    per_sample = vmap(grad(lambda p, b: loss(p, {k: v[None] for k, v in b.items()})), in_dims=(None, 0))(params, batch)
    assert per_sample["classifier.weight"].shape[0] == 3
    tangent = {k: torch.ones_like(v) for k, v in params.items()}
    _, hvp = jvp(lambda p: grad(loss)(p, batch), (params,), (tangent,))
    assert all(bool(torch.isfinite(v).all()) for v in hvp.values())
