"""Every evaluation metric on a case with a known (hand-computed) answer."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from pipeline.data import SampleSet
from pipeline.evaluate.classification import accuracy, micro_f1, task_accuracy, ua_ra_ta
from pipeline.evaluate.divergence import bernoulli_kl_from_logits, kl_from_logits, kl_from_probs
from pipeline.evaluate.forget_sets import build_forget_set
from pipeline.evaluate.lira import balanced_membership, gaussian_llr, logit_confidence
from pipeline.evaluate.mia import (
    attack_features, mia_draws_from_logits, mia_efficacy, mia_efficacy_from_logits, shadow_positions,
    svc_nonmember_share,
)
from pipeline.evaluate.retrieval import average_precision, query_gallery_split, retrieval_metrics
from pipeline.evaluate.scorecard import avg_gap
from pipeline.evaluate.weights import relative_distance, residual_gradient_norm, weight_distance
from pipeline.tasks import DenseInputTask
from pipeline.training import fit_lbfgs


class FixedLogits(nn.Module):
    """Returns the logits stored in column x (so any output distribution can be dialled in)."""

    def forward(self, x):
        return x


def test_accuracy_and_ua_ra_ta():
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0], [0.0, 1.0]])
    assert accuracy(logits, torch.tensor([0, 1, 1, 1])) == pytest.approx(75.0)
    task = DenseInputTask()
    forget = SampleSet({"x": logits[:2], "y": torch.tensor([0, 0])}, torch.tensor([0, 1]))   # 1 of 2 right
    retain = SampleSet({"x": logits, "y": torch.tensor([0, 1, 0, 1])}, torch.arange(4))      # all right
    test = SampleSet({"x": logits[2:], "y": torch.tensor([1, 1])}, torch.tensor([5, 6]))     # 1 of 2 right
    assert ua_ra_ta(FixedLogits(), task, forget, retain, test) == pytest.approx({"UA": 50.0, "RA": 100.0, "TA": 50.0})


def test_micro_f1_hand_computed():
    # predictions (sigmoid >= 0.5): [1,0,1], [0,1,1]; truth: [1,1,0], [0,1,1] -> TP 3, FP 1, FN 1
    logits = torch.tensor([[3.0, -3.0, 2.0], [-1.0, 1.0, 4.0]])
    y = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    assert micro_f1(logits, y) == pytest.approx(100 * 6 / 8)
    task = DenseInputTask(loss="bce_multilabel")
    data = SampleSet({"x": logits, "y": y}, torch.arange(2))
    assert task_accuracy(FixedLogits(), task, data) == pytest.approx(75.0)


def test_kl_identical_is_zero_and_known_pair():
    z = torch.randn(5, 4)
    assert kl_from_logits(z, z) == pytest.approx(0.0, abs=1e-12)
    p, q = torch.tensor([[0.5, 0.5]]), torch.tensor([[0.25, 0.75]])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl_from_probs(p, q) == pytest.approx(expected)
    assert kl_from_logits(p.log(), q.log()) == pytest.approx(expected)
    assert kl_from_probs(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.5]])) == pytest.approx(math.log(2))
    # Bernoulli(0.5) vs Bernoulli(0.25), one label: the same expected value with two outcomes
    assert bernoulli_kl_from_logits(torch.tensor([[0.0]]), torch.tensor([[math.log(0.25 / 0.75)]])) == \
        pytest.approx(0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75))


def test_svc_mia_on_separable_confidences():
    rng = np.random.default_rng(0)
    members = rng.uniform(0.9, 1.0, (50, 1))     # training samples: confident
    nonmembers = rng.uniform(0.0, 0.5, (50, 1))  # unseen samples: unsure
    assert svc_nonmember_share(members, nonmembers, rng.uniform(0.0, 0.4, (20, 1))) == pytest.approx(1.0)
    assert svc_nonmember_share(members, nonmembers, rng.uniform(0.92, 1.0, (20, 1))) == pytest.approx(0.0)
    mixed = np.concatenate([rng.uniform(0.0, 0.4, (10, 1)), rng.uniform(0.92, 1.0, (30, 1))])
    assert svc_nonmember_share(members, nonmembers, mixed) == pytest.approx(0.25)


def test_mia_efficacy_end_to_end_on_dialled_outputs():
    task = DenseInputTask()
    confident, unsure = torch.tensor([[8.0, 0.0]]), torch.tensor([[0.2, 0.0]])
    retain = SampleSet({"x": confident.repeat(40, 1) + 0.01 * torch.arange(40.0).view(-1, 1), "y": torch.zeros(40, dtype=torch.long)}, torch.arange(40))
    test = SampleSet({"x": unsure.repeat(40, 1) + 0.01 * torch.arange(40.0).view(-1, 1), "y": torch.zeros(40, dtype=torch.long)}, torch.arange(40))
    forget = SampleSet({"x": torch.cat([unsure.repeat(3, 1), confident.repeat(1, 1)]), "y": torch.zeros(4, dtype=torch.long)}, torch.arange(4))
    assert mia_efficacy(FixedLogits(), task, retain, test, forget) == pytest.approx(75.0)


def test_mia_features_hand_computed():
    p = torch.tensor([[0.5, 0.25, 0.25]])
    y = torch.tensor([0])
    assert attack_features(p, y, "confidence")[0, 0] == pytest.approx(0.5)
    assert attack_features(p, y, "entropy")[0, 0] == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)))
    m_entr = -(0.5) * math.log(0.5) - 2 * 0.25 * math.log(0.75)
    assert attack_features(p, y, "m_entropy")[0, 0] == pytest.approx(m_entr)
    assert attack_features(p, y, "correctness")[0, 0] == 1.0


def test_retrieval_map_and_rank1_on_a_toy_gallery():
    # 1-D features, no normalisation; query A at 0, query B at 10.
    gallery = torch.tensor([[1.0], [2.0], [3.0], [4.0], [11.0], [12.0]])
    gallery_ids = torch.tensor([1, 2, 1, 2, 2, 1])
    query, query_ids = torch.tensor([[0.0], [10.0]]), torch.tensor([1, 2])
    # query 1: ranking ids 1,2,1,2,2,1 -> hits at 1,3,6: AP = (1/1 + 2/3 + 3/6)/3 = 13/18; rank-1 hit
    # query 2: ranking by |x-10|: 11(2),12(1),4(2),3(1),2(2),1(1) -> hits at 1,3,5: AP = (1 + 2/3 + 3/5)/3 = 34/45
    out = retrieval_metrics(query, query_ids, gallery, gallery_ids, normalize=False)
    assert out["mAP"] == pytest.approx(100 * (13 / 18 + 34 / 45) / 2)
    assert out["rank1"] == pytest.approx(100.0) and out["queries"] == 2
    # same-camera matches are ignored (Market-1501): drop gallery 0 for query 1 -> first hit at rank 2
    cams = retrieval_metrics(query, query_ids, gallery, gallery_ids, normalize=False,
                             query_cams=torch.tensor([0, 0]), gallery_cams=torch.tensor([0, 1, 1, 1, 1, 1]))
    assert cams["rank1"] == pytest.approx(50.0)
    assert average_precision(np.array([0, 1])) == pytest.approx(0.5)
    q, g = query_gallery_split(torch.tensor([3, 3, 4, 3, 4]))
    assert q.tolist() == [0, 2] and g.tolist() == [1, 3, 4]


def test_lira_constructed_case():
    # in-shadows at 2 +- 1, out-shadows at -2 +- 1 (exactly: two shadows each side).
    in_mask = np.array([[True], [True], [False], [False]])
    stats = np.array([[3.0], [1.0], [-1.0], [-3.0]])
    # fixed variance: var of (stats - mean) over each side = 1
    for target, expected in ((2.0, 8.0), (0.0, 0.0), (-2.0, -8.0)):
        llr = gaussian_llr(np.array([target]), stats, stats, in_mask, fixed_variance=True)
        assert llr[0] == pytest.approx(expected)
    mask = balanced_membership(7, 4, seed=3)
    assert (mask.sum(axis=0) == 2).all()
    z = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    phi = logit_confidence(z, torch.tensor([0, 1]))
    p = torch.softmax(z, 1)[0, 0].item()
    assert phi[0] == pytest.approx(math.log(p / (1 - p))) and phi[1] == pytest.approx(0.0)


def test_logit_parts_and_the_shift_the_attack_reads():
    """phi = label - others exactly; statistic_shift gives the mean of mu_u - mu_r and the spreads the attack's
    fixed variances use: models that add 2.0 to every example's phi, with a known spread, read +2.0 and 2.0 / sd."""
    from pipeline.evaluate.lira import logit_parts, statistic_shift

    z, y = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.3, 0.2]]), torch.tensor([0, 2])
    split = logit_parts(z, y)
    assert np.allclose(split["label"] - split["others"], logit_confidence(z, y))
    assert split["others"][0] == pytest.approx(math.log(math.exp(0.5) + math.exp(-1.0)))
    rng = np.random.default_rng(0)
    base = rng.normal(size=40) * 3.0                       # per-example means, far apart
    noise = np.array([-1.0, 1.0, -1.0, 1.0])[:, None]      # spread 1.0 around each example's mean
    retrained, unlearned = base + 0.5 * noise, base + 2.0 + noise
    read = statistic_shift(unlearned, retrained)
    assert read["shift"] == pytest.approx(2.0) and read["shift_spread"] == pytest.approx(0.0, abs=1e-12)
    assert read["std_retrained"] == pytest.approx(0.5) and read["std_unlearned"] == pytest.approx(1.0)
    assert read["shift_in_std"] == pytest.approx(4.0)
    assert statistic_shift(retrained, unlearned)["shift"] == pytest.approx(-2.0)
    same = statistic_shift(np.ones((3, 4)), np.zeros((3, 4)))  # no spread: the attack's variance floor, not nan
    assert same["std_retrained"] == pytest.approx(1e-2) and same["shift_in_std"] == pytest.approx(100.0)


def test_forget_set_builders():
    train = SampleSet({"x": torch.zeros(10, 1), "y": torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])}, torch.arange(100, 110))
    assert build_forget_set("class", train, classes=[2]) == [102, 105, 108]
    picked = build_forget_set("random", train, fraction=0.3, seed=1)
    assert len(picked) == 3 and picked == build_forget_set("random", train, count=3, seed=1)
    assert set(picked) <= set(range(100, 110))
    with pytest.raises(ValueError, match="unknown"):
        build_forget_set("oldest", train)


def test_avg_gap_and_weight_distances():
    assert avg_gap({"UA": 10, "RA": 90, "TA": 80, "MIA": 30}, {"UA": 12, "RA": 94, "TA": 80, "MIA": 20}) == pytest.approx(4.0)
    a, b = {"w": torch.tensor([3.0, 0.0])}, {"w": torch.tensor([0.0, 4.0])}
    assert weight_distance(a, b) == pytest.approx(5.0)
    assert relative_distance(a, {"w": torch.tensor([6.0, 8.0])}, a) == pytest.approx(0.0)


def test_residual_gradient_norm_vanishes_at_the_optimum():
    torch.manual_seed(0)
    x = torch.randn(60, 3, dtype=torch.float64)
    y = (x[:, 0] > 0).long()
    data = SampleSet({"x": x, "y": y}, torch.arange(60))
    model = nn.Linear(3, 2).double()
    task = DenseInputTask()
    before = residual_gradient_norm(model, task, data, 0.1)
    fit_lbfgs(model, task, data, 0.1, tolerance=1e-9, max_steps=10)
    assert residual_gradient_norm(model, task, data, 0.1) < 1e-7 < before


def test_mia_repeats_average_independent_balanced_draws():
    """repeats = 1 is the single-draw value; repeats = B the mean over B seeded balanced draws
    (each its own SVC), all of the same size; repeats < 1 is refused."""
    task = DenseInputTask()
    gen = torch.Generator().manual_seed(0)
    retain = (torch.randn(300, 3, generator=gen) * 2, torch.randint(0, 3, (300,), generator=gen))
    test = (torch.randn(200, 3, generator=gen) * 2, torch.randint(0, 3, (200,), generator=gen))
    forget = (torch.randn(30, 3, generator=gen) * 2, torch.randint(0, 3, (30,), generator=gen))
    one = mia_efficacy_from_logits(task, retain, test, forget, seed=5, max_shadow=80)
    many = mia_efficacy_from_logits(task, retain, test, forget, seed=5, max_shadow=80, repeats=3)
    shares = []
    for seed in (5, (5, 1), (5, 2)):
        m, n = shadow_positions(300, 200, seed, 80)
        assert len(m) == len(n) == 80
        feats = [attack_features(torch.softmax(lg, 1), y) for lg, y in
                 ((retain[0][m], retain[1][m]), (test[0][n], test[1][n]), forget)]
        shares.append(svc_nonmember_share(*feats))
    assert one == pytest.approx(100 * shares[0])
    assert many == pytest.approx(100 * float(np.mean(shares)))
    assert len({round(v, 6) for v in shares}) > 1  # the draws differ, so the mean is not a copy of one
    draws = mia_draws_from_logits(task, retain, test, forget, seed=5, max_shadow=80, repeats=3)
    assert draws == pytest.approx([100 * v for v in shares])  # each draw kept, in order, draw 0 the single one
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        mia_efficacy_from_logits(task, retain, test, forget, repeats=0)
