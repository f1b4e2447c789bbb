"""The probe's activation values against hand computations (REFERENCE.md section 1, step 2):
Linear -> mean over batch (and real tokens) of output unit j; Conv2d -> mean over batch, H, W
of channel j; a module that does not run -> zero columns, listed; a module called twice -> the
sum of its per-call means; token replacements are never special ids."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.probe import SliceMap, gather, run_probe
from pipeline.tasks import DenseInputTask, TokenTask


def probe(model, task, batch, rows=5, **options):
    return run_probe(model, task, batch, seed=3, start=0, stop=rows, pass_size=2,
                     perturb_options=options or {"perturb_sigma": 0.0})


def test_linear_columns_are_batch_means_of_each_unit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(6, 3)
    batch = {"x": x, "y": torch.tensor([0, 1, 0, 1, 1, 0])}
    result = probe(model, DenseInputTask(), batch)  # sigma = 0: every perturbation is x itself
    with torch.no_grad():
        h = model[0](x)
        expected = torch.cat([h.mean(0), model[2](torch.relu(h)).mean(0)])
    assert result.activations.shape == (5, 6)
    assert torch.allclose(result.activations, expected.expand(5, 6), atol=1e-6, rtol=0)
    assert result.not_run == ()


def test_perturbed_rows_use_their_own_inputs():
    """With sigma > 0 each row is the batch mean of the unit on that row's perturbed input."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    batch = {"x": x, "y": torch.tensor([0, 1, 0, 1])}
    task = DenseInputTask()
    result = probe(model, task, batch, rows=3, perturb_sigma=0.5)
    from pipeline.probe import perturbation_generator

    for p in range(3):
        xp = task.perturb(batch, perturbation_generator(3, p), perturb_sigma=0.5)["x"]
        with torch.no_grad():
            assert torch.allclose(result.activations[p], model[0](xp).mean(0), atol=1e-6, rtol=0)


def test_conv_columns_are_means_over_batch_and_space():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 5, 4))
    x = torch.randn(3, 2, 5, 5)
    result = probe(model, DenseInputTask(), {"x": x, "y": torch.tensor([0, 1, 2])})
    with torch.no_grad():
        c = model[0](x)
        expected = torch.cat([c.mean(dim=(0, 2, 3)), model[3](torch.relu(c).flatten(1)).mean(0)])
    assert torch.allclose(result.activations, expected.expand(5, 7), atol=1e-6, rtol=0)


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 4)
        self.proj = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, input_ids, attention_mask=None):
        h = self.proj(self.embed(input_ids))  # (B, T, 3)
        return self.head(h.mean(1))


def test_token_linear_columns_average_real_tokens_then_the_batch():
    torch.manual_seed(3)
    model = TokenModel()
    ids = torch.tensor([[1, 7, 8, 9, 0], [1, 10, 11, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": mask, "y": torch.tensor([0, 1])}
    result = probe(model, TokenTask(vocab_size=20, special_ids=(0, 1)), batch, token_replacements=0)
    with torch.no_grad():
        h = model.proj(model.embed(ids))
        per_sample = torch.stack([h[0, :4].mean(0), h[1, :3].mean(0)])  # real tokens only
        expected = torch.cat([per_sample.mean(0), model.head(h.mean(1)).mean(0)])
    assert torch.allclose(result.activations, expected.expand(5, 5), atol=1e-6, rtol=0)


class UnusedAndShared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(3, 3)
        self.unused = nn.Linear(3, 7)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.shared(torch.tanh(self.shared(x))))


def test_unused_module_is_zero_and_listed_and_repeated_calls_sum():
    torch.manual_seed(4)
    model = UnusedAndShared()
    x = torch.randn(4, 3)
    batch = {"x": x, "y": torch.tensor([0, 1, 1, 0])}
    slice_map = SliceMap(model)
    result = probe(model, DenseInputTask(), batch)
    with torch.no_grad():
        first = model.shared(x)
        second = model.shared(torch.tanh(first))
        shared = first.mean(0) + second.mean(0)  # both calls: the same weight rows move both outputs
        head = model.head(second).mean(0)
    cols = {g.module: slice(g.offset, g.offset + g.units) for g in slice_map.groups}
    assert torch.allclose(result.activations[:, cols["shared"]], shared.expand(5, 3), atol=1e-6, rtol=0)
    assert torch.equal(result.activations[:, cols["unused"]], torch.zeros(5, 7))
    assert torch.allclose(result.activations[:, cols["head"]], head.expand(5, 2), atol=1e-6, rtol=0)
    assert result.not_run == ("unused",)
    assert bool(torch.isfinite(result.activations).all())
    # gathered shards keep the list
    a = run_probe(model, DenseInputTask(), batch, seed=3, start=0, stop=2, pass_size=2, perturb_options={"perturb_sigma": 0.0})
    b = run_probe(model, DenseInputTask(), batch, seed=3, start=2, stop=5, pass_size=2, perturb_options={"perturb_sigma": 0.0})
    merged = gather([b, a])
    assert merged.not_run == ("unused",) and torch.equal(merged.activations, result.activations)


def test_token_replacements_are_never_special_ids():
    """vocab 12 with ids 0..10 special: the only allowed replacement is 11. Replaced positions
    are never special or padding positions."""
    task = TokenTask(vocab_size=12, special_ids=tuple(range(11)))
    ids = torch.tensor([[0, 11, 11, 11, 2, 3], [0, 11, 11, 2, 3, 3]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    batch = {"input_ids": ids, "attention_mask": mask}
    for p in range(50):
        out = task.perturb(batch, torch.Generator().manual_seed(p), token_replacements=2)["input_ids"]
        assert torch.equal(out[ids != 11], ids[ids != 11])  # special positions untouched
        assert bool((out[ids == 11] == 11).all())            # and replacements are never special
    # A realistic vocabulary: replacements avoid the BERT special ids.
    bert = TokenTask(vocab_size=110, special_ids=(0, 100, 101, 102, 103))
    seq = torch.tensor([[101] + list(range(1, 40)) + [102]])
    drawn = []
    for p in range(300):
        out = bert.perturb({"input_ids": seq}, torch.Generator().manual_seed(p), token_replacements=5)["input_ids"]
        drawn.append(out[out != seq])
    drawn = torch.cat(drawn)
    assert drawn.numel() > 1000 and not bool(torch.isin(drawn, torch.tensor([0, 100, 101, 102, 103])).any())


def test_bad_vocabulary_is_a_clear_error():
    task = TokenTask(vocab_size=3, special_ids=(0, 1, 2))
    with pytest.raises(ValueError, match="vocab_size=3"):
        task.perturb({"input_ids": torch.tensor([[5, 6]])}, torch.Generator().manual_seed(0), token_replacements=1)
