"""`unlearn train` of a Mixed-Linear model (Golatkar, Achille, Ravichandran, Polito, Soatto,
"Mixed-Privacy Forgetting in Deep Networks", CVPR 2021), end to end.

The core weights w_c hold only data nobody will ask to delete: the preset's initial weights (its
public pre-training, e.g. the all-MiniLM-L6-v2 checkpoint, or a seeded initialisation trained on
nothing), optionally fitted with the recipe on a declared public ``core_data`` that shares no
sample with the personal data. The user weights w_u of the first-order model

    f_ML(x) = f_{w_c}(x) + J_{w_c}(x) w_u

are the exact minimiser of the user objective on the personal data D (mean MSE over samples and
outputs against one-hot targets, + lambda/2 ||w_u||^2, lambda = recipe.weight_decay), found by
one Newton step solved with conjugate gradient (``train_user_weights``). The model directory
holds the core (``model.safetensors``), the card (n = |D|, lambda) and ``user_weights.safetensors``
bound to lambda and the ids of D, so that ``unlearn forget --method mixed-linear`` forgets a person
exactly: w_u <- w_u - H_{D_r}^{-1} grad L_{D_r}(w_u).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from pipeline.data.sampleset import SampleSet
from pipeline.evaluate.classification import score_logits
from pipeline.linearized import LinearizedModel
from pipeline.methods.mixed_linear import FLAT_KEY, UserWeights, train_user_weights, user_block, user_state
from pipeline.tasks import Task


class MixedLinearTraining(BaseModel):
    """The ``mixed_linear`` section of a train config (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    user_last_modules: int = Field(1, ge=1, description="user block = parameters of the last k modules")
    user_parameters: list[str] = Field(
        default_factory=list, description="qualified names of the user parameters; empty: the last modules")
    cg_rtol: float = Field(1e-10, gt=0, description="CG stops at ||r|| <= cg_rtol ||b||")
    cg_max_iter: int | None = Field(None, gt=0, description="CG iteration cap (default 2 * block size)")
    batch_size: int = Field(256, ge=1, description="samples per Jacobian-vector product pass")


@dataclass
class MixedLinearFit:
    """What training the user weights produced: the weights to save and the record."""

    user: UserWeights
    record: dict[str, Any]
    lin: LinearizedModel
    flat: torch.Tensor

    def accuracy(self, task: Task, data: SampleSet) -> float:
        """Accuracy of f_ML (core + J w_u) on ``data``, in percent."""
        return linearized_accuracy(self.lin, self.flat, task, data, self.record["batch_size"])


def linearized_accuracy(lin: LinearizedModel, w_u: torch.Tensor, task: Task, data: SampleSet,
                        batch_size: int = 256) -> float:
    """Accuracy (or micro-F1) of f_ML(x) = f_{w_c}(x) + J_{w_c}(x) w_u on ``data``, in percent."""
    if len(data) == 0:
        return float("nan")
    logits = torch.cat([lin.predict(batch, w_u).float().cpu() for batch in data.batches(batch_size)])
    return score_logits(logits, data.columns["y"], task)


def shared_ids(core: SampleSet, personal: SampleSet) -> list[int]:
    """Sample ids present in both sets (meaningful when both come from one source and split)."""
    return sorted(set(core.sample_ids.tolist()) & set(personal.sample_ids.tolist()))


def fit_user_weights(core: torch.nn.Module, task: Task, personal: SampleSet, weight_decay: float,
                     spec: MixedLinearTraining) -> MixedLinearFit:
    """w_u = argmin (1/(N K)) sum ||f_ML(x) - onehot(y)||^2 / 2 + lambda/2 ||w_u||^2 on the
    personal data, linearised at the core ``core`` (eval mode, its current weights)."""
    core.eval()
    block = user_block(core, spec.user_parameters or None, spec.user_last_modules)
    lin = LinearizedModel(core, task, block)
    result = train_user_weights(lin, personal, weight_decay, rtol=spec.cg_rtol, max_iter=spec.cg_max_iter,
                                batch_size=spec.batch_size)
    if result.solve is not None and not result.solve.converged:
        raise ValueError(
            f"mixed_linear: the user-weight system was not solved to cg_rtol {spec.cg_rtol:g} in "
            f"{result.solve.iterations} CG iterations (relative residual {result.solve.relative_residual:.2e}); "
            "raise mixed_linear.cg_max_iter or cg_rtol")
    flat = result.user_weights
    tensors = {k: v.contiguous() for k, v in user_state(block, core, flat).items()}
    tensors[FLAT_KEY] = flat.contiguous()
    user = UserWeights(tensors, weight_decay, personal.sample_ids.tolist())
    record = {**result.record, "user_block": block.describe() if block.numel <= 10_000 else f"{len(block.parts)} parts",
              "user_dim": block.numel, "batch_size": spec.batch_size,
              "settings": {"user_last_modules": spec.user_last_modules, "user_parameters": spec.user_parameters}}
    return MixedLinearFit(user, record, lin, flat)
