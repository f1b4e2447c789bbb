"""KL divergence between two models' output distributions, averaged over samples.

  KL(P || Q) = (1/N) sum_i sum_k p_ik (log p_ik - log q_ik)
computed from logits with log-softmax (numerically stable; 0 log 0 = 0). For multi-label
outputs each label is a Bernoulli and the per-sample KL is the mean over labels of
  p log(p/q) + (1 - p) log((1 - p)/(1 - q)).
Used on the forget set between the unlearned model (P) and Retrain (Q): 0 means identical
predictions on the forgotten samples.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def kl_from_logits(p_logits: Tensor, q_logits: Tensor) -> float:
    """Mean over rows of KL(softmax(p) || softmax(q)), in nats."""
    log_p = F.log_softmax(p_logits.double(), dim=-1)
    log_q = F.log_softmax(q_logits.double(), dim=-1)
    return float((log_p.exp() * (log_p - log_q)).sum(dim=-1).mean())


def kl_from_probs(p: Tensor, q: Tensor) -> float:
    """Mean over rows of KL(p || q) for probability rows (zeros in p contribute 0)."""
    p, q = p.double(), q.double()
    terms = torch.where(p > 0, p * (p.clamp_min(1e-300).log() - q.clamp_min(1e-300).log()), torch.zeros_like(p))
    return float(terms.sum(dim=-1).mean())


def bernoulli_kl_from_logits(p_logits: Tensor, q_logits: Tensor) -> float:
    """Mean over rows and labels of KL(Bernoulli(sigmoid p) || Bernoulli(sigmoid q))."""
    lp1, lq1 = F.logsigmoid(p_logits.double()), F.logsigmoid(q_logits.double())
    lp0, lq0 = F.logsigmoid(-p_logits.double()), F.logsigmoid(-q_logits.double())
    return float((lp1.exp() * (lp1 - lq1) + lp0.exp() * (lp0 - lq0)).mean())


KL_BY_KIND = {"single": kl_from_logits, "multi": bernoulli_kl_from_logits}


def function_space_gap(model_logits: Tensor, retrain_logits: Tensor, reseed_logits: Tensor,
                       kind: str = "single") -> dict[str, float | None]:
    """Mean KL(model || Retrain) over a set of samples, in nats and in units of KL(retrain-reseed ||
    Retrain) on the same samples (Retrain's recipe from another seed: how far two equally valid Retrains'
    predictions are apart). ``units`` is None when that unit is 0 (two identical Retrains)."""
    kl = KL_BY_KIND[kind]
    value, unit = kl(model_logits, retrain_logits), kl(reseed_logits, retrain_logits)
    return {"kl": value, "unit": unit, "units": (value / unit) if unit > 0 else None}
