"""The prepared decision layer: one state per model version, shared by the decision-layer Newton
methods (``pipeline.methods.decision_layer_newton``, ``pipeline.methods.head_gauss_newton``) and
the stream service's fast path (``pipeline.streaming``).

The decision layer is the whole last Linear layer (theta = [W, b], K x (d+1)) of a Sequential under
softmax cross-entropy; every module before it is frozen for the removal, so its outputs on D (the
layer's inputs x, cached once: ``pipeline.frozen_prefix``) do not depend on the samples a request
removes. At the weights theta_0 it was built at, the state holds:
  * the frozen prefix's outputs on D (``prefix``), and X~ = (x, 1) of D in the products' precision
    (``products_dtype``: float32 for a float32 model, whose features are exact in it) with X~^T,
    the logits theta_0 X~^T (class-major) and ||X~||_F, when X~ and X~^T fit a quarter of the
    memory budget (``inputs_within``): a removal then masks the forgotten rows instead of copying
    D \\ U, and starts its Newton iteration without a pass over X~;
  * grad_P L_D(theta_0) (mean over D, lambda theta included): a removal then passes over its m
    forgotten samples only, grad L_{D\\U} = (n grad L_D - g_U) / (n - m);
  * H_P(D) (mean, lambda I included; ``pipeline.curvature.linear_layer``) and its inverse, when the
    dense K(d+1) x K(d+1) matrix fits a quarter of the budget: the Newton iteration's first
    preconditioner (the inverse, permuted into the layer's layout once: ``layer_inverse``).
It is bound (``pipeline.prepared.Binding``) to exactly the weights, buffers, data, weight decay and
loss options it was built from; ``after_removal`` keeps the cached prefix outputs of D \\ U for the
next version (the prefix did not move) and recomputes the rest there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from pipeline import memory
from pipeline.curvature.hessian import block_gradient
from pipeline.curvature.linear_layer import LinearCrossEntropyHessian, closed_form_layer, products_dtype
from pipeline.curvature.softmax_layer import layer_ordered
from pipeline.curvature.solve import inverse_from_cholesky
from pipeline.data.sampleset import SampleSet
from pipeline.frozen_prefix import PrefixCache, cache_frozen_prefix
from pipeline.param_block import ParamBlock
from pipeline.prepared import Binding, Prepared
from pipeline.target.oracles import SoftmaxLayerOracle
from pipeline.target.replay import ReplayPrepared, ReplaySchedule, prepare_replay, replay_target
from pipeline.tasks import Task

__all__ = ["DecisionLayerState", "LayerReplay", "decision_layer_block", "inputs_within"]


def decision_layer_block(model: nn.Module, parameters: list[str]) -> ParamBlock:
    """The block of the decision layer: the named parameters, or (none named) the weight and bias
    of the model's last module when that is a Linear layer (a Sequential's last module, or a Hugging
    Face classifier's ``classifier``); ``ValueError`` naming the fix otherwise."""
    if parameters:
        return ParamBlock.from_rows(model, {name: None for name in parameters})
    last = list(model.children())[-1] if isinstance(model, nn.Sequential) and len(model) else \
        getattr(model, "classifier", None)
    if not isinstance(last, nn.Linear):
        raise ValueError("parameters: name the decision layer's weight and bias (e.g. ['3.weight', '3.bias']); the "
                         "model is neither a Sequential ending in a Linear layer nor a classifier with a Linear "
                         "`classifier`, so it cannot be found by itself")
    own = {id(p) for p in last.parameters()}
    return ParamBlock.from_rows(model, {name: None for name, p in model.named_parameters() if id(p) in own})


def inputs_within(n: int, d: int, budget: "memory.MemoryBudget | None" = None, itemsize: int = 8) -> bool:
    """True when X~ (n x (d+1), ``itemsize`` bytes per entry) and its transpose fit in a quarter
    of the budget."""
    return 2 * n * (d + 1) * itemsize <= (budget or memory.current_budget()).bytes / 4


def _dense_within(dim: int) -> bool:
    """The dense H_P(D), its Cholesky factor and inverse (3 dim^2 float64) fit a quarter of the budget."""
    return 3 * 8 * dim * dim <= memory.current_budget().bytes / 4


@dataclass
class LayerReplay:
    """The ``retrain`` target of the decision layer by recipe replay (``pipeline.target.replay``),
    prepared over the layer's inputs on the D it was built for (``sample_ids``) and carried to later
    versions whose frozen prefix is unchanged: a removal at any later version replays D minus every
    sample removed since. ``whole_model``: the layer is every trained parameter, so the target is the
    replay itself; otherwise the layer's trained weights move by the replay's difference,
    theta_0 + replay(D \\ U) - replay(D), which cancels what the replay of one layer over the final
    features cannot know of the training of the layers below it. All in the layer's (class,
    input-with-bias) layout."""

    sample_ids: Tensor
    oracle: SoftmaxLayerOracle
    prepared: ReplayPrepared
    theta_origin: Tensor
    whole_model: bool

    @classmethod
    def build(cls, inputs: Tensor, labels: Tensor, sample_ids: Tensor, smoothing: float, classes: int,
              schedule: ReplaySchedule, theta_init: Tensor, theta_origin: Tensor, whole_model: bool) -> "LayerReplay":
        targets = (1 - smoothing) * nn.functional.one_hot(labels.long(), classes).to(torch.float64) + smoothing / classes
        oracle = SoftmaxLayerOracle(inputs, targets)
        return cls(sample_ids.clone(), oracle, prepare_replay(oracle, schedule, theta_init.to(torch.float64)),
                   theta_origin.to(torch.float64).clone(), whole_model)

    def target(self, retained_ids: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """(the layer's target weights, flat in the layer layout, and the replay's record) for the
        retained samples ``retained_ids`` (a subset of ``sample_ids``)."""
        started = time.perf_counter()
        keep = torch.isin(self.sample_ids, retained_ids)
        if int(keep.sum()) != len(retained_ids):
            raise ValueError("the retained samples are not all among those the layer's replay was prepared on")
        forget = torch.nonzero(~keep).squeeze(1)
        labels = self.oracle.t.argmax(1)
        theta, cost = replay_target(self.oracle, self.prepared, forget, labels=labels)
        if not self.whole_model:
            theta = self._difference_form(theta, labels, keep)
        return theta, {"how": "recipe replay" if self.whole_model else
                       "theta_0 + replay(D \\ U) - replay(D), an emptied class without its own offset",
                       "removed_since_preparation": int(forget.numel()), "seconds": time.perf_counter() - started,
                       "cost": cost.as_record(), "preparation_cost": self.prepared.cost.as_record(),
                       "preparation_seconds": self.prepared.seconds}

    def _difference_form(self, replayed: Tensor, labels: Tensor, keep: Tensor) -> Tensor:
        """theta_0 + replay(D \\ U) - replay(D), row by row of the layer: each class row keeps its offset
        o_c = theta_0,c - replay(D)_c (what co-training with the layers below gave that row beyond the
        replay over the final features). A class with no retained sample keeps only the offset its
        classes share, the mean of the retained classes' o_c (adding one vector to every row leaves the
        softmax unchanged), not its own: Retrain never learns that class, and its own offset is exactly
        what training on its samples put there. Measured on R8's tuning classes (7, 4; newton-head): Avg.
        Gap 12.7 / 5.0 with the class's own offset, 1.1 / 0.0 without (Retrain's own noise 0.02-0.05)."""
        width = self.oracle.width
        offset = (self.theta_origin - self.prepared.w_mean_field).reshape(self.oracle.k, width)
        present = torch.zeros(self.oracle.k, dtype=torch.bool)
        present[torch.unique(labels[keep])] = True
        emptied = torch.zeros(self.oracle.k, dtype=torch.bool)
        emptied[torch.unique(labels)] = True
        emptied &= ~present
        if bool(emptied.any()) and bool(present.any()):
            offset = offset.clone()
            offset[emptied] = offset[present].mean(0)
        return replayed + offset.reshape(-1)


#: A campaign's next version keeps the previous H_P(D)^-1 as the matrix-free Newton's preconditioner
#: (the only use of matrix / inverse) for up to this many versions, then rebuilds it: a batch removes a
#: few samples and moves the layer a little, so the stale inverse preconditions about as well, and the
#: dense rebuild (K^2 n d^2 work: 3.8-4.1 s of a 5.4-7.1 s batch on Fashion-MNIST, n = 60,000) is
#: skipped. The Newton iteration still stops on its own tolerance: the weights do not depend on it.
PRECONDITIONER_MAX_AGE = 8


@dataclass
class DecisionLayerState(Prepared):
    """The decision layer's prepared state (module docstring)."""

    block: ParamBlock | None = None
    prefix: PrefixCache | None = None   # the frozen prefix's outputs on D (None: the layer is the whole model)
    theta: Tensor | None = None         # the block's flat weights at the build (float64)
    matrix: Tensor | None = None        # H_P(D), (numel, numel) float64, mean + lambda I (None: too big), at the
                                        # weights and D of ``preconditioner_age`` versions before (the preconditioner)
    inverse: Tensor | None = None       # matrix^{-1}
    training_gradient: Tensor | None = None  # grad_P L_D at theta (mean, lambda theta included), float64
    inputs: Tensor | None = None        # X~ of D (n, d+1), products precision
    inputs_t: Tensor | None = None      # X~^T, contiguous
    logits: Tensor | None = None        # theta X~^T, class-major (K, n)
    inputs_norm: float | None = None    # ||X~||_F
    layer_inverse_cache: "tuple[Tensor, torch.dtype, Tensor] | None" = field(default=None, repr=False, compare=False)
    replay: LayerReplay | None = field(default=None, repr=False, compare=False)  # built on the first replay target
    preconditioner_age: int = 0         # versions since matrix / inverse were built (they precondition only)

    what = ("the decision layer over the frozen prefix's cached outputs on D: H_P(D) and its inverse, grad_P L_D, "
            "X~ and the logits (pipeline.decision_layer)")

    @classmethod
    def build(cls, binding: Binding, model: nn.Module, task: Task, train: SampleSet, block: ParamBlock,
              weight_decay: float, batch_size: int = 4096, prefix: PrefixCache | None = None,
              dense: bool = True) -> "DecisionLayerState":
        """Cache the frozen prefix over D (unless ``prefix`` is given: outputs of the same frozen
        modules on ``train``), then the closed forms at the layer's current weights (the dense
        H_P(D) and its inverse only with ``dense``: a state built for one removal does without)."""
        started = time.perf_counter()
        if prefix is None:
            prefix = cache_frozen_prefix(model, task, train, block, batch_size)
        else:  # the same frozen modules' outputs; the suffix is this model's
            prefix = replace(prefix, suffix=prefix.suffix_of(model))
        suffix, data, task = (model, train, task) if prefix is None else (prefix.suffix, prefix.train, prefix.task)
        layer = closed_form_layer(suffix, task, block)
        if layer is None:
            raise ValueError(
                "the decision-layer methods need a block that is the whole weight and bias of the last Linear layer "
                "of a Sequential under cross-entropy, every module before it frozen for the removal; name that "
                "layer's parameters (e.g. ['3.weight', '3.bias']) or use lfoci-newton for other blocks")
        if layer.bias is None:
            raise ValueError("the decision-layer methods need an output layer with a bias (their closed form works "
                             "on x~ = (x, 1)); use lfoci-newton for a Linear without bias")
        cached = time.perf_counter() - started
        params = {k: v.detach() for k, v in model.named_parameters()}
        theta = block.gather(params).to("cpu", torch.float64).clone()
        training_gradient = block_gradient(suffix, task, data, block, weight_decay, reduction="mean",
                                           batch_size=batch_size)
        op = LinearCrossEntropyHessian(suffix, task, data, block, weight_decay, reduction="mean", batch_size=batch_size)
        matrix = inverse = None
        if dense and _dense_within(block.numel):
            matrix = op.to_dense()
            chol, status = torch.linalg.cholesky_ex(matrix)
            inverse = inverse_from_cholesky(chol) if int(status) == 0 else None
        inputs = inputs_t = logits = inputs_norm = None
        dtype = products_dtype(layer)
        if inputs_within(len(data), layer.in_features, itemsize=torch.finfo(dtype).bits // 8):
            inputs = torch.ones(len(data), layer.in_features + 1, dtype=dtype)
            inputs[:, :-1] = data.columns["x"].reshape(len(data), -1)
            inputs_t = inputs.T.contiguous()
            w = torch.cat([layer.weight.detach(), layer.bias.detach()[:, None]], 1).to("cpu", dtype)
            logits, inputs_norm = w @ inputs_t, float(torch.linalg.vector_norm(inputs, dtype=torch.float64))
        state = cls(binding, 0.0, {}, block, prefix, theta, matrix, inverse, training_gradient, inputs, inputs_t,
                    logits, inputs_norm)
        if inverse is not None:  # the Newton iteration's preconditioner, ready for the first removal
            state.layer_inverse(op.order, dtype)
        state.details = {"prefix_seconds": cached, "layer_seconds": time.perf_counter() - started - cached,
                         "dense_curvature": matrix is not None, "inputs_kept": inputs is not None,
                         "preconditioner_age": 0,
                         "frozen_prefix": None if prefix is None else prefix.describe()}
        return state

    def suffix_and_data(self, model: nn.Module, task: Task, train: SampleSet) -> tuple[nn.Module, Task, SampleSet]:
        """The module the removal's passes run on (the layer alone over the cached prefix outputs,
        with this model's own suffix modules), the task that reads them, and its data."""
        if self.prefix is None:
            return model, task, train
        return self.prefix.suffix_of(model), self.prefix.task, self.prefix.train

    def layer_inverse(self, order: Tensor, dtype: torch.dtype) -> Tensor | None:
        """``inverse`` permuted into the layer's (class, input-with-bias) layout and cast to
        ``dtype`` (``pipeline.curvature.softmax_layer.layer_ordered``): made on first use, then kept
        for every later removal from these weights (one copy per layout and precision)."""
        if self.inverse is None:
            return None
        if not self.has_layer_inverse(order, dtype):
            self.layer_inverse_cache = (order.clone(), dtype, layer_ordered(self.inverse, order, dtype))
        return self.layer_inverse_cache[2]  # type: ignore[index]

    def has_layer_inverse(self, order: Tensor, dtype: torch.dtype) -> bool:
        """True when ``layer_inverse(order, dtype)`` is already made (no new copy)."""
        cached = self.layer_inverse_cache
        return cached is not None and cached[1] == dtype and torch.equal(cached[0], order)

    def after_removal(self, trained: Any, removed: Tensor, outcome: Any, binding: Binding) -> "DecisionLayerState | None":
        """The next version's state: the frozen prefix's cached outputs of D \\ U are kept (the
        removal moved only the decision layer, so the prefix is as it was); the closed forms are
        recomputed at the new weights. None where the removal moved anything else."""
        if self.prefix is None or self.block is None:
            return None
        if not set(outcome.new_parameters) <= {part.name for part in self.block.parts}:
            return None
        keep = torch.ones(len(self.prefix.train), dtype=torch.bool)
        keep[removed] = False
        kept = self.prefix.train.take(torch.nonzero(keep).squeeze(1))
        if not torch.equal(kept.sample_ids, trained.train.sample_ids):
            return None
        started = time.perf_counter()
        age = self.preconditioner_age + 1
        carry = self.inverse is not None and age < PRECONDITIONER_MAX_AGE
        state = DecisionLayerState.build(binding, trained.model, trained.task, trained.train, self.block,
                                         trained.weight_decay, trained.batch_size,
                                         prefix=replace(self.prefix, train=kept, seconds=0.0), dense=not carry)
        if carry:  # the Newton iteration's preconditioner only: an earlier version's H_P(D)^-1
            state.matrix, state.inverse, state.layer_inverse_cache = self.matrix, self.inverse, self.layer_inverse_cache
            state.preconditioner_age = age
        state.seconds = time.perf_counter() - started
        state.details["updated_from_removal"] = (
            "frozen prefix outputs of D \\ U kept; gradient, inputs and logits recomputed; " +
            (f"preconditioner H_P(D)^-1 carried from {age} version(s) before" if carry else
             "H_P(D) and its inverse recomputed"))
        state.details["preconditioner_age"] = state.preconditioner_age
        state.replay = self.replay  # prepared on an earlier D over the same inputs: it replays D minus all removed
        return state

    def layer_replay(self, model: nn.Module, task: Task, train: SampleSet, schedule: ReplaySchedule,
                     theta_init: Tensor, order: Tensor, whole_model: bool) -> LayerReplay:
        """The layer's replay (``LayerReplay``), built here on first use over the layer's inputs on
        ``train`` (the prefix's cached outputs) and kept with the state; ``theta_init`` and the
        layer's weights are in block order and put into the layer layout by ``order``."""
        if self.replay is not None and self.replay.whole_model == whole_model \
                and self.replay.prepared.schedule == schedule:
            return self.replay
        suffix, task, data = self.suffix_and_data(model, task, train)
        assert self.block is not None and self.theta is not None
        layer = closed_form_layer(suffix, task, self.block)
        assert layer is not None
        x = torch.ones(len(data), layer.in_features + 1, dtype=torch.float64)
        x[:, :-1] = data.columns["x"].reshape(len(data), -1)
        smoothing = float(getattr(task, "loss_options", {}).get("label_smoothing", 0.0))

        def layered(flat: Tensor) -> Tensor:
            out = torch.empty(flat.numel(), dtype=torch.float64)
            out[order] = flat.to("cpu", torch.float64)
            return out

        self.replay = LayerReplay.build(x, data.columns["y"], data.sample_ids, smoothing, layer.out_features, schedule,
                                        layered(theta_init), layered(self.theta), whole_model)
        return self.replay
