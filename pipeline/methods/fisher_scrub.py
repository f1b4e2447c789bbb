"""Fisher / Newton scrubbing (Golatkar, Achille, Soatto, "Eternal Sunshine of the Spotless
Net: Selective Forgetting in Deep Networks", CVPR 2020), with the corrected noise covariance.

Quadratic view: with L_D = L_Dr + L_Df near the trained point w = w*(D),
    w*(Dr) = w - B^{-1} grad L_Dr(w),      B = Hessian of L_Dr,
where L_Dr(w) = (1/|Dr|) sum_{z in Dr} loss(w, z) + (lambda/2)||w||^2 (the objective the
model was trained with, restricted to the retained data). The scrubbing function is
    S(w) = w - B^{-1} grad L_Dr(w) + n,     n ~ N(0, Sigma).
Minimising the forgetting Lagrangian E[L_Dr(S(w))] + lambda_f KL(P(S(w)|D) || P(S(w)|Dr))
gives Sigma B Sigma = lambda_f Sigma_h; for an isotropic error Sigma_h = sigma_h^2 I,
    Sigma = sqrt(lambda_f sigma_h^2) B^{-1/2}
(the paper drops lambda_f; the corrected form is used here). So n = s B^{-1/4} z with
z ~ N(0, I) and s = (lambda_f sigma_h^2)^{1/4}.

Curvature B on the chosen parameter block P (a registry, ``CURVATURES``):
  dense     exact Hessian of L_Dr restricted to P (``BlockHessian``, lambda I included),
            eigendecomposed: B = U diag(e) U^T; Newton step U diag(1/e) U^T g and noise
            s U diag(e^{-1/4}) z. Eigenvalues below ``eigen_floor`` (default: lambda, the
            smallest a convex loss plus (lambda/2)||w||^2 can have) are raised to it, and
            that is recorded (a non-convex network's Hessian may have negative eigenvalues).
  diagonal  a Fisher diagonal F = (1/|Dr|) sum_x E_y (grad_P loss(w, (x, y)))^2 + lambda:
            Newton step g / F, noise std s F^{-1/4} per coordinate (Golatkar et al.'s Fisher
            forgetting, but with the Newton term and the F^{-1/4} their notebook lacks: it
            used no Newton term and std proportional to F^{-1/2}).
            ``fisher="predictive"`` (default, Golatkar et al.'s Fisher): y from the model's own
            predictive distribution, so F is the diagonal of the Gauss-Newton matrix
            J^T H_out J whatever the training loss: for the cross-entropy the exact expectation
            sum_k p_k grad_k^2 over the classes (their code's way); otherwise (or with
            ``fisher_samples``) labels sampled from the model (``LABEL_SAMPLERS``, random
            stream FISHER_LABELS). One sampled label per sample is too noisy: on a digits MLP
            it left coordinates at F ~ lambda and cut retain accuracy to 44-97%. ``fisher="empirical"``: y = the training labels; near zero training
            loss its gradients vanish, F collapses to lambda, the step g / lambda explodes and
            the scrub destroys the model (R8: retain accuracy 37%, Fashion-MNIST: 10%; see
            tests/test_fisher.py). The record's "verification" says when a step raised
            ||grad L_Dr||.
``auto`` takes dense when |P| <= ``dense_max``, diagonal otherwise.

Noise is secret: z comes from the OS CSPRNG (``secret_standard_normal``), never from the
removal's seed. It is NOT calibrated to an (epsilon, delta) theorem: the release is ``none``
(heuristic noise for the forgetting Lagrangian, no privacy claim).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from pydantic import Field
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from pipeline.curvature import BlockHessian, block_gradient
from pipeline.errors import NonFiniteGradientError
from pipeline.data.sampleset import SampleSet
from pipeline.prepared import Prepared
from pipeline.methods.base import (
    MethodSettings, RandomStream, RemovalMethod, RemovalOutcome, RemovalProblem, register_method,
)
from pipeline.privacy.noise import secret_standard_normal
from pipeline.privacy.release import Guarantee, PrivacyRelease
from pipeline.param_block import ParamBlock
from pipeline.target import TargetKind, budget_damping, resolve_target
from pipeline.tasks import Task, output_logits


def _norm(t: Tensor) -> float:
    return float(torch.linalg.vector_norm(t))


def noise_scale(tradeoff: float, sigma_h: float) -> float:
    """s = (lambda_f sigma_h^2)^{1/4}: n = s B^{-1/4} z has covariance sqrt(lambda_f sigma_h^2) B^{-1/2}."""
    return (tradeoff * sigma_h ** 2) ** 0.25


def _standard_normal(dim: int, z: Tensor | None, generator: torch.Generator | None, draws: int | None) -> Tensor:
    """(draws or 1) x dim standard normals: ``z`` as given, else seeded (tests), else secret."""
    shape = (draws or 1, dim)
    if z is not None:
        z = z.to("cpu", torch.float64).reshape(shape)
    elif generator is not None:
        z = torch.randn(shape, generator=generator, dtype=torch.float64)
    else:
        z = secret_standard_normal(shape)
    return z


# -- curvature models -------------------------------------------------------------------------
@dataclass
class DenseCurvature:
    """B = U diag(e) U^T (eigenvalues already floored), CPU float64."""

    eigenvalues: Tensor
    eigenvectors: Tensor
    kind: str = "dense"
    notes: list[str] = field(default_factory=list)

    def solve(self, g: Tensor) -> Tensor:
        """B^{-1} g."""
        u = self.eigenvectors
        return u @ ((u.T @ g) / self.eigenvalues)

    def noise(self, scale: float, *, z: Tensor | None = None, generator: torch.Generator | None = None,
              draws: int | None = None) -> Tensor:
        """s B^{-1/4} z, z ~ N(0, I): covariance s^2 B^{-1/2}. ``draws`` stacks that many rows.
        z: given, else from ``generator`` (statistical tests only), else the OS CSPRNG."""
        z = _standard_normal(self.eigenvalues.numel(), z, generator, draws)
        out = scale * (z * self.eigenvalues.pow(-0.25)) @ self.eigenvectors.T
        return out if draws is not None else out[0]

    def largest_std(self, scale: float) -> float:
        """The noise's largest standard deviation (along B's smallest eigenvalue)."""
        return scale * float(self.eigenvalues.min()) ** -0.25

    def noise_covariance(self, scale: float) -> Tensor:
        """s^2 B^{-1/2} = sqrt(lambda_f sigma_h^2) B^{-1/2}."""
        u = self.eigenvectors
        return scale ** 2 * (u * self.eigenvalues.pow(-0.5)) @ u.T

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, "min_eigenvalue": float(self.eigenvalues.min()),
                "max_eigenvalue": float(self.eigenvalues.max()), "notes": self.notes}


@dataclass
class DiagonalCurvature:
    """B ~ diag(F), F = mean squared per-sample gradient + lambda (+ damping), CPU float64."""

    diagonal: Tensor
    kind: str = "diagonal"
    notes: list[str] = field(default_factory=list)

    def solve(self, g: Tensor) -> Tensor:
        return g / self.diagonal

    def noise(self, scale: float, *, z: Tensor | None = None, generator: torch.Generator | None = None,
              draws: int | None = None) -> Tensor:
        """s F^{-1/4} z per coordinate (z as in ``DenseCurvature.noise``)."""
        z = _standard_normal(self.diagonal.numel(), z, generator, draws)
        out = scale * z * self.diagonal.pow(-0.25)
        return out if draws is not None else out[0]

    def largest_std(self, scale: float) -> float:
        return scale * float(self.diagonal.min()) ** -0.25

    def noise_covariance(self, scale: float) -> Tensor:
        return torch.diag(scale ** 2 * self.diagonal.pow(-0.5))

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, "min_diagonal": float(self.diagonal.min()),
                "max_diagonal": float(self.diagonal.max()), "notes": self.notes}


Curvature = DenseCurvature | DiagonalCurvature


def dense_curvature(matrix: Tensor, floor: float | None) -> DenseCurvature:
    """Eigendecompose a symmetric B, raising eigenvalues below ``floor`` to it (recorded);
    ``floor=None`` (or <= 0) means 1e-8 times the largest |eigenvalue|."""
    evals, evecs = torch.linalg.eigh(matrix.to("cpu", torch.float64))
    if floor is None or floor <= 0:
        floor = 1e-8 * max(float(evals.abs().max()), 1e-300)
    notes = []
    low = evals < floor
    if bool(low.any()):
        notes.append(f"{int(low.sum())} of {evals.numel()} eigenvalues below the floor {floor:.3e} "
                     f"(smallest {float(evals.min()):.3e}) were raised to it")
        evals = evals.clamp(min=floor)
    return DenseCurvature(evals, evecs, notes=notes)


# -- labels from the model's predictive distribution ------------------------------------------------
# loss name -> (sampler(outputs, generator) -> labels, scale c): with y drawn from the model,
# c * E_y[grad loss grad loss^T] is the Gauss-Newton matrix J^T (d^2 loss / d f^2) J of the loss.
LabelSampler = Callable[[Tensor, torch.Generator], Tensor]


def _sample_categorical(logits: Tensor, generator: torch.Generator) -> Tensor:
    """y ~ Categorical(softmax(logits)): loss = -log p(y | x) exactly (c = 1)."""
    probs = torch.softmax(logits.detach().to("cpu", torch.float64), dim=1)
    return torch.multinomial(probs, 1, generator=generator).flatten()


def _sample_gaussian(out: Tensor, generator: torch.Generator) -> Tensor:
    """y ~ N(f, (K/2) I): the mean-over-K squared error is then -log p(y | x) + const (c = 1)."""
    f = out.detach().to("cpu", torch.float64).reshape(out.shape[0], -1)
    k = f.shape[1]
    return f + (k / 2.0) ** 0.5 * torch.randn(f.shape, generator=generator, dtype=torch.float64)


def _sample_bernoulli(logits: Tensor, generator: torch.Generator) -> Tensor:
    """y_k ~ Bernoulli(sigmoid(logit_k)): the mean-over-K BCE is -log p(y | x) / K (c = K)."""
    p = torch.sigmoid(logits.detach().to("cpu", torch.float64).reshape(logits.shape[0], -1))
    return torch.bernoulli(p, generator=generator)


LABEL_SAMPLERS: dict[str, tuple[LabelSampler, Callable[[int], float]]] = {
    "cross_entropy": (_sample_categorical, lambda k: 1.0),
    "mse": (_sample_gaussian, lambda k: 1.0),
    "bce_multilabel": (_sample_bernoulli, lambda k: float(k)),
}


def predictive_labels(model: nn.Module, task: Task, batch: dict[str, Tensor],
                      generator: torch.Generator) -> tuple[dict[str, Tensor], float]:
    """The batch with y drawn from the model's predictive distribution, and the scale c."""
    if task.loss not in LABEL_SAMPLERS:
        raise ValueError(f"the predictive Fisher supports the losses {sorted(LABEL_SAMPLERS)}, not '{task.loss}'; "
                         "use fisher='empirical'")
    sampler, scale = LABEL_SAMPLERS[task.loss]
    with torch.no_grad():
        out = output_logits(task.forward(model, batch))
    y = sampler(out, generator)
    y = y.to(batch["y"].device, batch["y"].dtype if task.loss == "cross_entropy" else out.dtype)
    return {**batch, "y": y}, scale(int(out.reshape(out.shape[0], -1).shape[1]))


def _class_probabilities(model: nn.Module, task: Task, batch: dict[str, Tensor]) -> Tensor:
    with torch.no_grad():
        out = output_logits(task.forward(model, batch))
    return torch.softmax(out.to(torch.float64), dim=1)


def fisher_diagonal(model: nn.Module, task: Task, data: SampleSet, block: ParamBlock, weight_decay: float,
                    *, batch_size: int = 256, max_elements: int = 1 << 25, labels: str = "empirical",
                    generator: torch.Generator | None = None, samples: int | None = None) -> Tensor:
    """(1/|S|) sum_{x in S} c E_y[(grad_P loss(w, (x, y)))^2] + lambda, a Fisher diagonal of the
    block from per-sample gradients (``vmap`` of ``grad``), ``max_elements`` floats at a time.
      labels="empirical":  y = the data's labels (c = 1).
      labels="predictive": y from the model's predictive distribution. ``samples=None`` with the
        cross-entropy: the exact expectation sum_k p_k(x) grad_k^2 over the classes (as Golatkar
        et al.'s code does); otherwise ``samples`` labels (default 8) per sample drawn from
        ``generator`` (``LABEL_SAMPLERS``) and averaged."""
    if labels not in ("empirical", "predictive"):
        raise ValueError(f"labels must be 'empirical' or 'predictive', got '{labels}'")
    exact = labels == "predictive" and samples is None and task.loss == "cross_entropy"
    draws = 1 if labels == "empirical" or exact else (samples or 8)
    if labels == "predictive" and not exact and generator is None:
        raise ValueError("the predictive Fisher samples labels here: pass a generator")
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    first = next(iter(params.values()))
    zero = torch.zeros(block.numel, device=first.device, dtype=first.dtype)

    def sample_loss(delta: Tensor, sample: dict[str, Tensor]) -> Tensor:
        single = {k: v.unsqueeze(0) for k, v in sample.items()}
        args, kwargs = task.model_args(single)
        out = functional_call(model, {**block.insert(params, delta), **buffers}, args, kwargs)
        return task.per_sample_loss(output_logits(out), single).sum()

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0))

    def squared(batch: dict[str, Tensor]) -> Tensor:  # (N, |P|) squared per-sample gradients
        return per_sample(zero, batch).detach().to("cpu", torch.float64).pow(2)

    chunk = max(1, min(batch_size, max_elements // max(1, block.numel)))
    total = torch.zeros(block.numel, dtype=torch.float64)
    for raw in data.batches(chunk):
        batch = dict(raw)
        if labels == "empirical":
            total += squared(batch).sum(0)
        elif exact:
            probs = _class_probabilities(model, task, batch).cpu()
            for k in range(probs.shape[1]):
                fixed = {**batch, "y": torch.full_like(batch["y"], k)}
                total += (probs[:, k : k + 1] * squared(fixed)).sum(0)
        else:
            for _ in range(draws):
                drawn, c = predictive_labels(model, task, batch, generator)  # type: ignore[arg-type]
                total += c * squared(drawn).sum(0) / draws
    out = total / len(data) + weight_decay
    if not bool(torch.isfinite(out).all()):
        raise NonFiniteGradientError("the Fisher diagonal contains NaN or infinite values: check the model "
                                     "weights and inputs; nothing was changed")
    return out


# -- the method ------------------------------------------------------------------------------------
class FisherScrubSettings(MethodSettings):
    parameters: Literal["all"] | list[str] = Field(
        "all", description='"all" or a list of qualified parameter names forming the block')
    curvature: Literal["auto", "dense", "diagonal"] = Field(
        "auto", description="dense: exact restricted Hessian; diagonal: Fisher diagonal")
    fisher: Literal["predictive", "empirical"] = Field(
        "predictive", description="diagonal: labels from the model's predictive distribution, or the data's")
    fisher_samples: int | None = Field(
        None, gt=0, description="predictive: labels drawn per sample; null = exact expectation over the "
                                "classes for cross-entropy (8 draws for other losses)")
    dense_max: int = Field(4096, gt=0, description="auto uses the dense Hessian up to this block size")
    newton_step: bool = Field(True, description="apply -B^{-1} grad L_Dr (off: noise only)")
    step_search: bool = Field(
        True, description="diagonal: the step -B^{-1} g is halved until the retained objective decreases "
                          "(Armijo, at most max_halvings; none decreases: no step, noise only). A diagonal is "
                          "no model of the loss, and its full step can wreck a network (measured on MiniLM: "
                          "retain accuracy 99 -> 14); the dense curvature's step is Newton's and is taken whole")
    max_halvings: int = Field(12, ge=0, description="step_search: halvings tried before giving the step up")
    target: TargetKind = Field(
        "retrain", description="retrain (pipeline.target): for an SGD recipe the budget-damped step "
                               "-(B + mu I)^{-1} (grad L_Dr(w) - grad L_D(w)), mu = 1/tau, else as minimiser; "
                               "minimiser: the step -B^{-1} grad L_Dr(w) (the quadratic view at w = w*(D))")
    tradeoff: float = Field(1e-4, ge=0, description="lambda_f of the forgetting Lagrangian")
    sigma_h: float = Field(1e-2, ge=0, description="sigma_h: std of the isotropic error model")
    eigen_floor: float | None = Field(
        None, gt=0, description="smallest eigenvalue kept (dense); default: the weight decay lambda")
    damping: float = Field(0.0, ge=0, description="added to B (dense and diagonal)")


Builder = Callable[[RemovalProblem, ParamBlock, FisherScrubSettings, SampleSet], Curvature]


def _build_dense(problem: RemovalProblem, block: ParamBlock, settings: FisherScrubSettings,
                 retain: SampleSet) -> Curvature:
    from pipeline.frozen_prefix import cache_frozen_prefix
    from pipeline.curvature.linear_layer import LinearCrossEntropyHessian, closed_form_layer

    prefix = cache_frozen_prefix(problem.model, problem.task, retain, block, problem.batch_size)
    if prefix is not None and closed_form_layer(prefix.suffix, prefix.task, block) is not None:
        # the decision layer over its cached inputs: the same matrix in closed form (pipeline.curvature.linear_layer)
        h: Any = LinearCrossEntropyHessian(prefix.suffix, prefix.task, prefix.train, block, problem.weight_decay,
                                           reduction="mean", batch_size=problem.batch_size)
    else:
        h = BlockHessian(problem.model, problem.task, retain, block, problem.weight_decay,
                         reduction="mean", batch_size=problem.batch_size)
    b = h.to_dense() + settings.damping * torch.eye(block.numel, dtype=torch.float64)
    return dense_curvature(b, settings.eigen_floor or problem.weight_decay + settings.damping)


def _build_diagonal(problem: RemovalProblem, block: ParamBlock, settings: FisherScrubSettings,
                    retain: SampleSet) -> Curvature:
    f = fisher_diagonal(problem.model, problem.task, retain, block, problem.weight_decay,
                        batch_size=problem.batch_size, labels=settings.fisher, samples=settings.fisher_samples,
                        generator=problem.generator(RandomStream.FISHER_LABELS)) + settings.damping
    notes = []
    if bool((f <= 0).any()):
        tiny = float(f[f > 0].min()) if bool((f > 0).any()) else 1.0
        notes.append(f"{int((f <= 0).sum())} zero Fisher entries (lambda = 0) raised to {tiny:.3e}")
        f = f.clamp(min=tiny)
    return DiagonalCurvature(f, notes=notes)


CURVATURES: dict[str, Builder] = {"dense": _build_dense, "diagonal": _build_diagonal}


def _block(model: nn.Module, parameters: Literal["all"] | list[str]) -> ParamBlock:
    if parameters == "all":
        return ParamBlock.all_parameters(model)
    if not parameters:
        raise ValueError('parameters must be "all" or a non-empty list of qualified parameter names')
    return ParamBlock.from_rows(model, {name: None for name in parameters})


def _searched_step(problem: RemovalProblem, block: ParamBlock, retain: SampleSet, anchor: Tensor, g: Tensor,
                   step: Tensor, max_halvings: int, mu: float = 0.0) -> tuple[Tensor, dict[str, Any]]:
    """The longest t * step, t = 1, 1/2, ..., 2^-max_halvings, with Armijo decrease of the block's
    retained objective F(w) = L_Dr(w) + (lambda/2) ||w_P||^2 - <anchor, w_P> + (mu/2) ||w_P - w_P0||^2
    (whose gradient at w_0 is g - anchor): F(w + t s) <= F(w) + 1e-4 t <g - anchor, s>; a zero step (noise only) when none
    decreases it or s is no descent direction. One no-grad pass over D_r per trial."""
    from pipeline.training import mean_loss

    lam = problem.weight_decay
    params = dict(problem.model.named_parameters())
    w0 = block.gather({name: p.detach() for name, p in params.items()}).to(torch.float64)

    def objective(model: nn.Module, w: Tensor) -> float:
        with torch.no_grad():
            loss = float(mean_loss(model, problem.task, retain, problem.batch_size))
        return loss + 0.5 * lam * float(w @ w) - float(anchor.to(torch.float64) @ w) + 0.5 * mu * float((w - w0) @ (w - w0))

    f0 = objective(problem.model, w0)
    slope = float((g - anchor).to(torch.float64) @ step.to(torch.float64))
    out: dict[str, Any] = {"objective_before": f0, "step_length": 0.0, "halvings": None}
    if not slope < 0:
        out["note"] = "the diagonal step is no descent direction: no step"
        return torch.zeros_like(step), out
    for k in range(max_halvings + 1):
        t = 0.5 ** k
        probe = copy.deepcopy(problem.model)
        block.add_to_model(probe, t * step)
        f = objective(probe, w0 + t * step.to(torch.float64))
        del probe
        if math.isfinite(f) and f <= f0 + 1e-4 * t * slope:
            out.update(step_length=t, halvings=k, objective_after=f)
            return t * step, out
    out["note"] = f"no step length down to 2^-{max_halvings} decreased the retained objective: no step (noise only)"
    return torch.zeros_like(step), out


def _verify(g_before: Tensor, g_newton: Tensor, kind: str, newton: bool, numbers: bool = True) -> dict[str, Any]:
    """Surface (never hide) a Newton step that made the retained-objective gradient larger
    (``numbers``: quote the norms; not where the step was noised: they would describe it before the noise)."""
    reduced = _norm(g_newton) <= _norm(g_before)
    out: dict[str, Any] = {"retain_gradient_reduced": reduced}
    if newton and not reduced:
        norms = f" ({_norm(g_before):.3e} -> {_norm(g_newton):.3e})" if numbers else ""
        out["note"] = (f"the {kind} Newton step increased ||grad L_Dr||{norms}: the quadratic model does not hold at "
                       "this step; use the dense curvature on a smaller block, add damping, or set newton_step=false")
    return out


@register_method
class FisherScrub(RemovalMethod):
    """S(w) = w - B^{-1} grad L_Dr(w) + n, n ~ N(0, sqrt(lambda_f sigma_h^2) B^{-1/2}) on a block.
    Changes ``problem.model`` in place and returns the block's new parameter values."""

    name = "fisher"
    Settings = FisherScrubSettings

    def remove(self, problem: RemovalProblem, settings: FisherScrubSettings,  # type: ignore[override]
               prepared: Prepared) -> RemovalOutcome:
        timings: dict[str, float] = {}
        model, task, lam, bs = problem.model, problem.task, problem.weight_decay, problem.batch_size
        block = _block(model, settings.parameters)
        retain = problem.retain
        kind = settings.curvature
        if kind == "auto":
            kind = "dense" if block.numel <= settings.dense_max else "diagonal"

        how, schedule, why = resolve_target(settings.target, problem.card, lam, block.numel, replay_max_parameters=0)
        with problem.stage("gradient", timings):
            g_before = block_gradient(model, task, retain, block, lam, reduction="mean", batch_size=bs)
            anchor, mu = torch.zeros_like(g_before), 0.0
            if how == "budget_damped":  # r0 = grad L_D(w) = ((n - m) g_Dr + sum_U grad f) / n; mu = 1 / tau
                g_forget = block_gradient(model, task, problem.forget, block, lam, reduction="sum", batch_size=bs)
                anchor = ((problem.n - problem.m) * g_before + g_forget) / problem.n
                mu = budget_damping(schedule, problem.n - problem.m)
        with problem.stage("curvature", timings):
            damped = settings if mu == 0.0 else settings.model_copy(update={"damping": settings.damping + mu})
            curv = CURVATURES[kind](problem, block, damped, retain)

        with problem.stage("update", timings):
            step = -curv.solve(g_before - anchor) if settings.newton_step else torch.zeros_like(g_before)
            search = None
            if settings.newton_step and settings.step_search and kind == "diagonal":
                step, search = _searched_step(problem, block, retain, anchor, g_before, step, settings.max_halvings, mu)
            scale = noise_scale(settings.tradeoff, settings.sigma_h)
            noise = curv.noise(scale) if scale > 0 else torch.zeros_like(g_before)  # secret (OS CSPRNG)
            probe = copy.deepcopy(model)
            block.add_to_model(probe, step)
        with problem.stage("verify", timings):
            g_newton = block_gradient(probe, task, retain, block, lam, reduction="mean", batch_size=bs)
            del probe
        with problem.stage("update", timings):
            block.add_to_model(model, step + noise)
        noised = scale > 0
        if noised:
            with problem.stage("verify", timings):
                g_after = block_gradient(model, task, retain, block, lam, reduction="mean", batch_size=bs)
        else:
            g_after = g_newton
        # with noise, the record describes the published weights only: nothing of the step before the noise
        published_step = step + noise

        release = _release(curv, scale)
        params = dict(model.named_parameters())
        new_parameters = {part.name: params[part.name].detach().clone() for part in block.parts}
        record = {
            "block": {"numel": block.numel,
                      "parts": block.describe() if block.numel <= 100_000 else len(block.parts)},
            "curvature": {**curv.summary(), "data": f"retain set ({len(retain)} samples), mean loss + lambda",
                          "damping": settings.damping,
                          "fisher": settings.fisher if kind == "diagonal" else None},
            "noise": {"tradeoff": settings.tradeoff, "sigma_h": settings.sigma_h, "scale": scale,
                      "covariance": "sqrt(tradeoff * sigma_h^2) * B^-1/2", "source": "OS CSPRNG (secret)"},
            "gradient_norms": {
                "retain_mean_block_before": _norm(g_before),
                "retain_mean_block_after": _norm(g_after),  # at the published weights
            },
            "step_norm": _norm(published_step),  # the published step (noise included)
            "step_search": search,
            "target": {"setting": settings.target, "how": how, "why": why, "training_budget_damping": mu},
            # the Newton step's own check: made before the noise, published only as its verdict when noised
            "verification": _verify(g_before - anchor, g_newton - anchor + mu * step.to(g_newton.dtype), kind,
                                    settings.newton_step, numbers=not noised),
            "timings": timings,
            "release": release.model_dump(mode="json"),
        }
        return RemovalOutcome(new_parameters, record, release)


def _release(curv: Curvature, scale: float) -> PrivacyRelease:
    """Fisher noise is not calibrated to an (epsilon, delta) theorem: no privacy claim."""
    if scale <= 0:
        return PrivacyRelease.non_private("Fisher scrub without noise (tradeoff or sigma_h = 0)")
    return PrivacyRelease(
        mechanism="gaussian", sigma=curv.largest_std(scale), guarantee=Guarantee.NONE,
        reasons=["Fisher-scrub noise N(0, sqrt(tradeoff sigma_h^2) B^-1/2) minimises the forgetting Lagrangian; "
                 "it is not calibrated to a sensitivity, so it makes no (epsilon, delta) claim "
                 "(sigma: its largest standard deviation)"])
