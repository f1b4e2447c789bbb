"""Prepared Mixed-Linear forgetting when the user weights are the core's output Linear layer.

With the user block = the last Linear layer of a Sequential core (weight K x d and bias), the
linearised model of ``pipeline.methods.mixed_linear`` is

    f_ML(x) = f_c(x) + W_u phi(x) + b_u,      J_i = I_K (x) x~_i^T,   x~ = (phi(x), 1),

with phi the core's features entering that layer (independent of w_u). In the (K, d+1) layout
Theta of w_u, on a sample set S of N_S samples, the user objective
L_S = (1/(N_S K)) sum_S ||f_c + J w_u - y||^2 + (lambda/2)||w_u||^2 has

    grad L_S(Theta) = (2/(N_S K)) (Theta G_S - C_S^T) + lambda Theta,
    H_S             = (2/(N_S K)) I_K (x) G_S + lambda I      (Theta -> Theta A_S),
    A_S = (2/(N_S K)) G_S + lambda I,  G_S = X~_S^T X~_S  ((d+1) x (d+1)),  C_S = X~_S^T (Y_S - F_c,S)  ((d+1) x K).

G and C are sums over samples, so those of D_r = D \\ U are the prepared sums of D minus the m
forgotten rows' own. A removal is then the exact Newton step of the method,

    Theta' = Theta - grad L_Dr(Theta) A_Dr^{-1}   (= C_Dr^T A_Dr^{-1} (2/(N_r K)), the optimum on D_r),

at O(m d^2 + d^3 + K d^2) with no pass over the retained data; it equals retraining the user
weights on D_r up to float64 rounding. ``PreparedUserSums`` is bound, like ``UserWeights``, to
the weight decay and the exact sample ids it was summed over, and also to the core (a SHA-256 of
its parameters and buffers: phi and F_c depend on them); a removal returns the sums of D_r, so
sequential requests compose. Sums are taken in eval mode (dropout off, batch-norm statistics
fixed), in preparation and removal alike, so G_D - G_U is G of D_r.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from pipeline.data.sampleset import SampleSet
from pipeline.curvature.linear_layer import layer_order
from pipeline.linearized import LinearizedModel, output_linear, output_targets, outputs_and_inputs
from pipeline.prepared import state_digest

__all__ = ["PreparedUserSums", "UserWeightsBindingError"]


def _rows(lin: LinearizedModel, layer: nn.Linear, data: SampleSet, outputs: int,
          batch_size: int) -> tuple[Tensor, Tensor]:
    """(G, C) = (X~^T X~, X~^T (Y - F_c)) over ``data``, float64: one core pass per batch, the
    layer's inputs read by a forward pre-hook."""
    d1 = layer.in_features + 1
    gram = torch.zeros(d1, d1, dtype=torch.float64)
    cross = torch.zeros(d1, outputs, dtype=torch.float64)
    for batch in data.batches(batch_size):
        f_c, x = outputs_and_inputs(lin, layer, batch)
        y = output_targets(batch["y"], outputs, torch.float64).to("cpu")
        gram += x.T @ x
        cross += x.T @ (y - f_c.to("cpu", torch.float64))
    return gram, cross


class UserWeightsBindingError(ValueError):
    """User weights (or their prepared sums) used with a lambda, data or core other than those
    they were made with."""


@dataclass(frozen=True)
class PreparedUserSums:
    """G_S, C_S, N_S of the sample set S the user weights minimise L_S on (module docstring),
    bound to ``weight_decay`` and ``sample_ids``; ``order[i]`` = the (output, input-with-bias)
    flat index of user-block entry i."""

    gram: Tensor
    cross: Tensor
    count: int
    outputs: int
    weight_decay: float
    sample_ids: frozenset[int]
    order: Tensor
    core: str = ""
    seconds: float = 0.0

    @classmethod
    def prepare(cls, lin: LinearizedModel, data: SampleSet, weight_decay: float, *,
                batch_size: int = 1024) -> "PreparedUserSums":
        """One pass over the user data D; raises ``ValueError`` when the user block is not the
        core's output Linear layer."""
        layer = output_linear(lin.model, lin.block)
        if layer is None:
            raise ValueError("prepared Mixed-Linear sums need the user block to be the whole last Linear layer (with a "
                             "bias) of a Sequential core (user_last_modules: 1); other blocks forget by CG")
        started = time.perf_counter()
        k, d = layer.out_features, layer.in_features
        gram, cross = _rows(lin, layer, data, k, batch_size)
        names = {n: ("weight" if p is layer.weight else "bias") for n, p in lin.model.named_parameters()
                 if p is layer.weight or p is layer.bias}
        return cls(gram, cross, len(data), k, float(weight_decay), frozenset(int(i) for i in data.sample_ids.tolist()),
                   layer_order(lin.block, names, k, d), state_digest(lin.model), time.perf_counter() - started)

    def check(self, weight_decay: float, sample_ids: Sequence[int], model: nn.Module) -> None:
        """Refuse sums of another lambda, other data or another core (``UserWeightsBindingError``)."""
        if self.core != state_digest(model):
            raise UserWeightsBindingError(
                "the prepared user sums were taken with another core (its parameters or buffers differ from this "
                "model's): prepare them again with this core")
        if not math.isclose(self.weight_decay, weight_decay, rel_tol=1e-12, abs_tol=0.0):
            raise UserWeightsBindingError(
                f"the prepared user sums are of weight decay {self.weight_decay!r}, this forget uses {weight_decay!r}: "
                "prepare them again for this lambda")
        if self.sample_ids != {int(i) for i in sample_ids}:
            raise UserWeightsBindingError(
                "the prepared user sums were summed over other samples than this model's user data: prepare them "
                "again on this data (or pass the sums a previous removal returned)")

    def _theta(self, w_u: Tensor) -> Tensor:
        out = torch.empty(self.outputs * self.gram.shape[0], dtype=torch.float64)
        out[self.order] = w_u.to("cpu", torch.float64)
        return out.reshape(self.outputs, -1)

    def _flat(self, theta: Tensor) -> Tensor:
        return theta.reshape(-1)[self.order]

    def gradient(self, w_u: Tensor) -> Tensor:
        """grad L_S(w_u) in block order, from the sums (exact up to float64 rounding)."""
        theta = self._theta(w_u)
        if self.count == 0:  # no data left: L = (lambda/2)||w_u||^2
            return self._flat(self.weight_decay * theta)
        scale = 2.0 / (self.count * self.outputs)
        return self._flat(scale * (theta @ self.gram - self.cross.T) + self.weight_decay * theta)

    def forget(self, lin: LinearizedModel, w_u: Tensor, forget: SampleSet, *,
               batch_size: int = 1024) -> tuple[Tensor, "PreparedUserSums", dict[str, Any]]:
        """The exact Newton step of L_{S \\ U} from ``w_u`` (module docstring): (new w_u, the sums of
        S \\ U, record). ``forget`` must be samples of S."""
        layer = output_linear(lin.model, lin.block)
        if layer is None:
            raise ValueError("the prepared sums belong to an output-layer user block; this block is another")
        ids = {int(i) for i in forget.sample_ids.tolist()}
        if not ids <= self.sample_ids or len(ids) != len(forget):
            raise ValueError("forget holds samples the prepared sums do not include (or repeats one): "
                             "forget only samples of the user data, each once")
        started = time.perf_counter()
        g_u, c_u = _rows(lin, layer, forget, self.outputs, batch_size)
        retained = replace(self, gram=self.gram - g_u, cross=self.cross - c_u, count=self.count - len(forget),
                           sample_ids=self.sample_ids - ids)
        if retained.count == 0:  # no data term is left: the minimiser of (lambda/2)||w_u||^2 is 0
            record = {"path": "prepared-kronecker", "samples_retained": 0, "outputs": retained.outputs,
                      "forgot_all_user_data": True,
                      "step_norm": float(torch.linalg.vector_norm(w_u.to("cpu", torch.float64))),
                      "seconds": time.perf_counter() - started}
            return torch.zeros(w_u.numel(), dtype=torch.float64), retained, record
        theta = self._theta(w_u)
        scale = 2.0 / (retained.count * retained.outputs)
        eye = torch.eye(retained.gram.shape[0], dtype=torch.float64)
        a = scale * retained.gram + retained.weight_decay * eye
        chol, info = torch.linalg.cholesky_ex(a)
        if int(info) != 0:
            raise ValueError("the retained user Hessian is not positive definite: the weight decay must be > 0")
        g = scale * (theta @ retained.gram - retained.cross.T) + retained.weight_decay * theta
        new_theta = theta - torch.cholesky_solve(g.T, chol).T  # Theta - g A^{-1} (A symmetric)
        new = retained._flat(new_theta)
        after = retained.gradient(new)
        record = {"path": "prepared-kronecker", "samples_retained": retained.count, "outputs": retained.outputs,
                  "system": int(a.shape[0]), "hessian_scale": scale,
                  "retain_gradient_norm_before": float(torch.linalg.vector_norm(g)),
                  "retain_gradient_norm_after": float(torch.linalg.vector_norm(after)),
                  "step_norm": float(torch.linalg.vector_norm(new - w_u.to("cpu", torch.float64))),
                  "seconds": time.perf_counter() - started}
        return new, retained, record

