"""Population membership-inference attack with a support-vector classifier (MIA-efficacy).

Following Jia et al. (NeurIPS 2023, "Model Sparsity Can Simplify Machine Unlearning",
appendix C.3; their ``SVC_MIA``, after Song & Mittal, USENIX Security 2021): an RBF SVC
(C = 3, gamma = 'auto' = 1 / #features) is fitted on per-sample features of the model's
outputs, label 1 for training members (a sample of D_r) and 0 for non-members (the test set,
equally many), then applied to the forget set D_f:
    MIA-efficacy = 100 * (share of D_f predicted non-member) = 100 * TN / |D_f|.
Higher means the forget set looks less like training data; Retrain is the reference.

Repeats (``repeats`` = B > 1): the members and non-members the SVC is fitted on are a seeded
sample, and on a well-generalising model the two confidence distributions nearly coincide, so
the fitted boundary, and the share of D_f it calls non-member, moves a lot with the draw (on
Fashion-MNIST, one model and one forget set: std 6.5 points over draws of 2,000 + 2,000). With
B > 1 the value is the mean over B independent balanced draws (draw 0 is the single-draw
value): the same metric, its sampling noise divided by about sqrt(B).

Features (``FEATURES``; p = output probabilities, y = label):
  confidence  p_y                                     (the paper's reported setting)
  entropy     -sum_k p_k log p_k
  m_entropy   -(1 - p_y) log p_y - sum_{k != y} p_k log(1 - p_k)     (Song & Mittal's Mentr)
  correctness [argmax_k p_k = y]
  prob        the whole vector p
For multi-label outputs p is the per-label sigmoid and p_y is replaced by the mean probability
of the correct value of each label, (1/K) sum_k [y_k p_k + (1 - y_k)(1 - p_k)].
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.data.sampleset import SampleSet
from pipeline.evaluate.predict import logits_of, output_kind, probabilities
from pipeline.tasks import Task

EPS = 1e-12


def _p_true(p: Tensor, y: Tensor, kind: str) -> Tensor:
    if kind == "multi":
        yf = y.float()
        return (yf * p + (1 - yf) * (1 - p)).mean(dim=1)
    return p.gather(1, y.long().view(-1, 1)).squeeze(1)


def _entropy(p: Tensor, y: Tensor, kind: str) -> Tensor:
    if kind == "multi":
        return -(p * (p + EPS).log() + (1 - p) * (1 - p + EPS).log()).mean(dim=1)
    return -(p * (p + EPS).log()).sum(dim=1)


def _m_entropy(p: Tensor, y: Tensor, kind: str) -> Tensor:
    if kind == "multi":
        q = _p_true(p, y, kind)
        return -(1 - q) * (q + EPS).log()
    py = _p_true(p, y, kind)
    others = -(p * (1 - p + EPS).log())
    others = others.sum(dim=1) - others.gather(1, y.long().view(-1, 1)).squeeze(1)
    return -(1 - py) * (py + EPS).log() + others


def _correctness(p: Tensor, y: Tensor, kind: str) -> Tensor:
    if kind == "multi":
        return ((p >= 0.5).float() == y.float()).all(dim=1).float()
    return (p.argmax(dim=1) == y.long()).float()


FEATURES: dict[str, Callable[[Tensor, Tensor, str], Tensor]] = {
    "confidence": lambda p, y, k: _p_true(p, y, k).unsqueeze(1),
    "entropy": lambda p, y, k: _entropy(p, y, k).unsqueeze(1),
    "m_entropy": lambda p, y, k: _m_entropy(p, y, k).unsqueeze(1),
    "correctness": lambda p, y, k: _correctness(p, y, k).unsqueeze(1),
    "prob": lambda p, y, k: p,
}


def attack_features(probs: Tensor, y: Tensor, feature: str = "confidence", kind: str = "single") -> np.ndarray:
    if feature not in FEATURES:
        raise ValueError(f"MIA feature '{feature}' is unknown; choose one of {sorted(FEATURES)}")
    return FEATURES[feature](probs, y, kind).double().numpy()


def svc_nonmember_share(members: np.ndarray, nonmembers: np.ndarray, target: np.ndarray) -> float:
    """Fit the SVC on members (1) vs non-members (0); share of ``target`` predicted 0."""
    from sklearn.svm import SVC

    x = np.concatenate([members, nonmembers]).reshape(len(members) + len(nonmembers), -1)
    labels = np.concatenate([np.ones(len(members)), np.zeros(len(nonmembers))])
    clf = SVC(C=3, gamma="auto", kernel="rbf")
    clf.fit(x, labels)
    return float(1.0 - clf.predict(target.reshape(len(target), -1)).mean())


def shadow_positions(n_retain: int, n_test: int, seed: int | tuple[int, int] = 0,
                     max_shadow: int | None = 5000) -> tuple[np.ndarray, np.ndarray]:
    """Seeded, equally many member (D_r) and non-member (test) positions."""
    rng = np.random.default_rng(seed)
    n = min(n_retain, n_test, max_shadow or n_test)
    return np.sort(rng.choice(n_retain, n, replace=False)), np.sort(rng.choice(n_test, n, replace=False))


def mia_draws_from_logits(
    task: Task, retain: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor], forget: tuple[Tensor, Tensor], *,
    feature: str = "confidence", seed: int = 0, max_shadow: int | None = 5000, repeats: int = 1,
) -> list[float]:
    """MIA-efficacy in percent of each of ``repeats`` independent seeded draws (draw 0 is the single-draw value)
    from precomputed (logits, targets) of D_r, test and D_f. Where a model generalises, one draw often calls the
    whole forget set one way (0 or 100): the draws show it where their mean cannot."""
    if repeats < 1:
        raise ValueError(f"MIA repeats must be >= 1 (got {repeats})")
    kind = output_kind(task)

    def feats(logits: Tensor, y: Tensor) -> np.ndarray:
        return attack_features(probabilities(logits, task), y, feature, kind)

    target = feats(*forget)
    shares = []
    for r in range(repeats):
        member_pos, nonmember_pos = shadow_positions(len(retain[1]), len(test[1]), seed if r == 0 else (seed, r),
                                                     max_shadow)
        idx_m, idx_n = torch.as_tensor(member_pos), torch.as_tensor(nonmember_pos)
        shares.append(100.0 * svc_nonmember_share(feats(retain[0][idx_m], retain[1][idx_m]),
                                                  feats(test[0][idx_n], test[1][idx_n]), target))
    return shares


def mia_efficacy_from_logits(
    task: Task, retain: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor], forget: tuple[Tensor, Tensor], *,
    feature: str = "confidence", seed: int = 0, max_shadow: int | None = 5000, repeats: int = 1,
) -> float:
    """MIA-efficacy in percent from precomputed (logits, targets) of D_r, test and D_f: the mean over ``repeats``
    independent seeded draws of the members and non-members (``mia_draws_from_logits``)."""
    return float(np.mean(mia_draws_from_logits(task, retain, test, forget, feature=feature, seed=seed,
                                               max_shadow=max_shadow, repeats=repeats)))


def mia_efficacy(
    model: nn.Module, task: Task, retain: SampleSet, test: SampleSet, forget: SampleSet, *,
    feature: str = "confidence", seed: int = 0, max_shadow: int | None = 5000, batch_size: int = 256,
) -> float:
    """MIA-efficacy in percent (see the module docstring). Members: a seeded sample of D_r of
    the size of the (possibly capped) test set."""
    member_pos, nonmember_pos = shadow_positions(len(retain), len(test), seed, max_shadow)
    members = retain.take(torch.as_tensor(member_pos))
    nonmembers = test.take(torch.as_tensor(nonmember_pos))

    def pair(data: SampleSet) -> tuple[Tensor, Tensor]:
        return logits_of(model, task, data, batch_size), data.columns["y"]

    # positions already chosen: pass everything through unchanged (max_shadow = no cap)
    m_logits, m_y = pair(members)
    n_logits, n_y = pair(nonmembers)
    kind = output_kind(task)
    return 100.0 * svc_nonmember_share(
        attack_features(probabilities(m_logits, task), m_y, feature, kind),
        attack_features(probabilities(n_logits, task), n_y, feature, kind),
        attack_features(probabilities(logits_of(model, task, forget, batch_size), task), forget.columns["y"], feature, kind),
    )
