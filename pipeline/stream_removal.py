"""Removals from model directories through a warm ``DecisionLayerStream`` (pipeline/streaming.py):
the stream service's fast path. Nothing here knows the ledger, the version store or HTTP; the
caller (``jobs.service``) hands a parent model directory and sample ids and gets a
``RemovalRun`` back, as from ``pipeline.removal.remove``.

The state is used only for the weights and data it holds: before each removal the parent
directory's card (the removed ids) and weights are compared with what the state last produced
(its block weights cast to the model's dtype, every other parameter as at the build). Anything
else (a restart, a rollback, a removal that was computed but not published) rebuilds the state
from the parent: load, cache the frozen prefix over D (and the test split, for verification),
one exact pass. After a published fast removal the state continues from the published weights
(its float64 theta is reset to them), so it always describes exactly the version it serves.

Verification metrics (``metrics``: the keys of ``pipeline.evaluate.removal_metrics``) come from
the cached layer inputs: the predictions of the parent and of the new weights on the whole split
(one matrix product each) and on the test split, read off for the batch, the cumulative forget
set and the retained set. The removal's target is the method's ``target`` (``pipeline.target``), the
point theta_T each removal sets as the unique stationary point of F_R(theta) - <a, theta>: a = 0 for
the minimiser of F_R; a = grad F_R(theta_T) for Retrain's point by recipe replay (the layer's replay
is prepared with the state and replays D minus every sample removed since). A version counts as having reached it
(``record["fast_path"]["target_reached"]``) only when its refresh converged; every version carries
the exact residual of its weights as published (dtype-cast) against that target,
``published_residual`` = ||grad F_R(theta_pub) - a||, and ``distance_to_target_bound`` = that / lambda
>= ||theta_pub - theta*_a|| (lambda-strong convexity): a bound on the distance to the target, not
to the optimum of D_r unless the target is the minimiser.
The state rounds a fast step to the model's dtype before measuring its drift (``publish_dtype``),
so after a fast step that measure is already the published residual of exactly these weights
(checked by equality; a refresh's weights get their own exact pass).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from pipeline import memory
from pipeline.checkpoint import read_state_dict
from pipeline.methods.base import TrainedModel, get_method, prepare
from pipeline.models.card import WEIGHTS_FILE, load_model_dir, read_card
from pipeline.privacy.release import PrivacyRelease
from pipeline.removal import RemovalRun, training_set
from pipeline.streaming import DecisionLayerStream, StreamSettings

__all__ = ["FastPathError", "WarmStreamRemover", "check_fast_path_settings", "stream_settings_of"]


class FastPathError(ValueError):
    """The method settings cannot run on the streaming fast path; the message names the field."""


def check_fast_path_settings(method: str, settings: Any, field: str = "method") -> tuple[Any, str]:
    """(the parsed decision-layer-newton settings, its target), or FastPathError naming the field."""
    from pipeline.methods.base import parse_settings

    if method != "decision-layer-newton":
        raise FastPathError(f"fast_path serves the decision-layer Newton removal: {field} must run method "
                            f"decision-layer-newton (e.g. method: newton-head; got '{method}'); switch the method or "
                            "set fast_path.enabled: false")
    parsed = parse_settings(method, settings)
    if parsed.epsilon != float("inf"):
        raise FastPathError(f"fast_path adds no privacy noise: {field}.settings.epsilon must be .inf (got "
                            f"{parsed.epsilon}); set fast_path.enabled: false for noisy removals")
    return parsed, parsed.target


@dataclass
class _Held:
    """What the state was built from and what it last produced."""

    directory: Path
    parameters: dict[str, Tensor]   # every parameter at the build (the prefix must stay equal)
    removed: frozenset[int]         # the card's removed ids the state's retained set stands for
    block_dtype: torch.dtype
    test_x: Tensor | None           # the test split's layer inputs (float64)
    test_y: Tensor | None
    x_all: Tensor                   # layer inputs of every sample of the split (for cumulative sets)
    y_all: Tensor
    position: dict[int, int]
    in_state: Tensor                # row of x_all of each of the state's rows


class WarmStreamRemover:
    """``remove(parent_dir, sample_ids, seed)`` -> ``RemovalRun``; ``metrics(...)`` for verification."""

    def __init__(self, method: str, settings: Mapping[str, Any], stream: StreamSettings, *, batch_size: int = 4096,
                 log=None) -> None:
        self.method = method
        self.settings, self.target = check_fast_path_settings(method, settings)
        self.target_term: Any = None  # state -> a, for the target of the state's version (set by warm)
        self.target_record: dict[str, Any] = {}
        self.parameters: list[str] = []  # the decision layer's weight and bias (known once a state is built)
        self.stream_settings, self.batch_size = stream, batch_size
        self.log = log or (lambda _msg: None)
        self.state: DecisionLayerStream | None = None
        self.held: _Held | None = None
        self.builds = 0
        self._before: Tensor | None = None   # theta of the parent of the last run (for metrics)
        # (theta, right on the whole split, right on the test split) of the last metrics call: the
        # next batch's parent is usually that version, so its "before" needs no second product
        self._last_correct: tuple[Tensor, Tensor | None, Tensor | None] | None = None

    # -- building and checking -------------------------------------------------------------
    def _matches(self, directory: Path) -> bool:
        """The state holds exactly the parent's data and weights."""
        if self.state is None or self.held is None:
            return False
        card = read_card(directory)
        if frozenset(int(i) for i in card.training.removed_ids) != self.held.removed:
            return False
        weights = read_state_dict(Path(directory) / WEIGHTS_FILE)
        w_name, b_name = self.parameters
        if not (torch.equal(weights[w_name], self.state.weight.to(self.held.block_dtype))
                and torch.equal(weights[b_name], self.state.bias.to(self.held.block_dtype))):
            return False
        return all(torch.equal(weights[k], v) for k, v in self.held.parameters.items() if k not in self.parameters)

    def warm(self, directory: str | Path) -> dict[str, Any] | None:
        """Build the state from ``directory`` unless it already holds it; the build's record or None."""
        directory = Path(directory)
        if self._matches(directory):
            return None
        started = time.perf_counter()
        model, task, card = load_model_dir(directory)
        model.eval()
        train = training_set(card, model)
        # the decision-layer methods' own preparation (the same state ``unlearn forget --method newton-head``
        # starts from), then the stream's sums over its cached prefix outputs
        method = get_method(self.method)
        prepared, _ = prepare(method, TrainedModel(model, task, train, card.training.weight_decay, self.batch_size,
                                                   card), self.settings)
        assert prepared.block is not None
        self.parameters = [part.name for part in prepared.block.parts]
        block_dtype = model.state_dict()[self.parameters[0]].dtype
        state, prefix = DecisionLayerStream.from_state(prepared, model, task, train, card.training.weight_decay,
                                                       settings=self.stream_settings,
                                                       publish_dtype=block_dtype)
        from pipeline.data import load_source

        splits = load_source(card.data.source, card.data.options)
        full = splits[card.data.split]
        test = splits.get("test") if card.data.split != "test" else None

        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())

        def layer_inputs(data) -> Tensor:
            data = data.astype(dtype)  # the model's dtype, as the training set has (token ids stay integers)
            size = memory.forward_batch_size(model, task, data, self.batch_size)
            with torch.no_grad():
                xs = [(prefix.prefix(model, b)["x"] if prefix is not None else b["x"]) for b in data.batches(size)]
            return torch.cat(xs).reshape(len(data), -1).to(torch.float64)

        # layer inputs of the whole split: the state's cached ones for D, the prefix on the rest
        position = {int(i): j for j, i in enumerate(full.sample_ids.tolist())}
        x_all = torch.empty(len(full), state.d, dtype=torch.float64)
        in_state = torch.tensor([position[int(i)] for i in state.sample_ids.tolist()], dtype=torch.long)
        x_all[in_state] = state.x
        rest = torch.ones(len(full), dtype=torch.bool)
        rest[in_state] = False
        if bool(rest.any()):
            x_all[rest] = layer_inputs(full.take(torch.nonzero(rest).squeeze(1)))
        self.target_term, self.target_record = self._target_term(prepared, model, task, train, card, state)
        self._last_correct = None  # predictions were of the old cached inputs
        self.held = _Held(directory, {k: v.detach().clone() for k, v in model.state_dict().items()},
                          frozenset(int(i) for i in card.training.removed_ids), block_dtype,
                          layer_inputs(test) if test is not None else None,
                          test.columns["y"] if test is not None else None,
                          x_all, full.columns["y"], position, in_state)
        self.state = state
        self.builds += 1
        record = {"directory": str(directory), "seconds": time.perf_counter() - started, **state.build_record,
                  "state": state.describe()}
        self.log(f"fast path: state built from {directory.name} in {record['seconds']:.2f} s "
                 f"(n = {state.n}, block {state.p})")
        return record

    def _target_term(self, prepared: Any, model: Any, task: Any, train: Any, card: Any,
                     state: DecisionLayerStream) -> tuple[Any, dict[str, Any]]:
        """(state -> a, the target's record) for the method's ``target`` on this version: a = 0 for the
        minimiser; a = grad F_R(theta_T) for the recipe replay's theta_T of the retained set.
        FastPathError naming the field where the target cannot run on the fast path."""
        from pipeline.methods.block_choice import trainable_numel
        from pipeline.recipe import start_weights
        from pipeline.target import resolve_target

        kind, schedule, why = resolve_target(self.target, card, card.training.weight_decay, state.p,
                                             self.settings.replay_max_parameters)
        record: dict[str, Any] = {"setting": self.target, "how": kind, "why": why}
        if kind == "minimiser":
            record["point"] = "the optimum of D_r (grad F_R = 0)"
            return (lambda st: torch.zeros(st.p, dtype=torch.float64)), record
        if kind != "replay":
            raise FastPathError(f"method.settings.target: the fast path serves the minimiser or the recipe replay of a "
                                f"layer of at most replay_max_parameters = {self.settings.replay_max_parameters} "
                                f"entries (this layer has {state.p}); raise replay_max_parameters, set target: "
                                "minimiser, or set fast_path.enabled: false")
        k, d = state.k, state.d
        order = torch.cat([(torch.arange(k)[:, None] * (d + 1) + torch.arange(d)[None, :]).reshape(-1),
                           torch.arange(k) * (d + 1) + d])  # the stream's [W row-major, b] -> (class, input-with-bias)
        whole = state.p == trainable_numel(model)
        theta_init = prepared.block.gather(start_weights(card))
        replay = prepared.layer_replay(model, task, train, schedule, theta_init, order, whole)
        record["point"] = ("Retrain's point by recipe replay (theta_T = replay(D \\ U))" if whole else
                           "Retrain's point by recipe replay (theta_T = theta_0 + replay(D \\ U) - replay(D))")

        def term(st: DecisionLayerStream) -> Tensor:
            theta_layer, replayed = replay.target(st.retained_ids())
            record["replay"] = replayed
            return st.exact_gradient(theta_layer[order])

        return term, record

    # -- one removal ------------------------------------------------------------------------
    def remove(self, directory: str | Path, sample_ids: Sequence[int], seed: int = 0) -> RemovalRun:
        """The removal of ``sample_ids`` from the parent in ``directory`` on the warm state."""
        started = time.perf_counter()
        directory = Path(directory)
        built = self.warm(directory)
        assert self.state is not None and self.held is not None
        state = self.state
        model, _task, card = load_model_dir(directory)
        w_name, b_name = self.parameters
        self._before = torch.cat([model.state_dict()[w_name].reshape(-1), model.state_dict()[b_name]]).to(torch.float64)
        try:
            step = state.remove(sample_ids, field="sample_ids", target=self.target_term)
        except Exception:
            # a removal that failed part-way may have changed the sums: never reuse this state
            self.state, self.held = None, None
            raise
        new_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        new_state[w_name] = state.weight.to(self.held.block_dtype).clone()
        new_state[b_name] = state.bias.to(self.held.block_dtype).clone()
        new_card = card.model_copy(deep=True)
        ids = [int(i) for i in sample_ids]
        new_card.training.removed_ids = sorted(set(card.training.removed_ids) | set(ids))
        new_card.training.n = card.training.n - len(ids)
        # the state now stands for the new version: its weights as published (dtype-cast); the
        # checks are of those weights: ||grad F_R(theta_pub) - a|| exactly (one O(n K d) pass),
        # and ||theta_pub - theta*_R|| <= that / lambda (lambda-strong convexity)
        published_theta = torch.cat([new_state[w_name].reshape(-1), new_state[b_name]]).to(torch.float64)
        if step.path == "fast" and step.residual_measured is not None and torch.equal(published_theta, state.theta):
            published, published_from = step.residual_measured, "drift measure (the same weights)"
        else:
            state.theta = published_theta
            published = float(torch.linalg.vector_norm(state.exact_gradient() - state.anchor))
            published_from = "exact pass at the published weights"
        refresh_converged = bool(step.refresh["converged"]) if step.refresh is not None else None
        self.held.removed = frozenset(new_card.training.removed_ids)
        record = {
            "method": self.method, "settings": self.settings.model_dump(mode="json"),
            "seed": seed, "sample_ids": ids, "n_before": card.training.n, "n_after": new_card.training.n,
            "fast_path": {**step.as_record(),
                          # a converged exact refresh; the weights as published are within
                          # distance_to_target_bound of the target's stationary point (dtype rounding included)
                          "target_reached": bool(refresh_converged),
                          "refresh_converged": refresh_converged,
                          "published_residual": published, "distance_to_target_bound": published / state.lam,
                          "published_residual_from": published_from,
                          "state": state.describe(), "built": built},
            "target": {**self.target_record, "target_term_norm": float(torch.linalg.vector_norm(state.anchor))},
            "step_norm": step.step_norm,
            "release": PrivacyRelease.non_private().model_dump(mode="json"),
            "wall_seconds": time.perf_counter() - started,
        }
        return RemovalRun(new_state, new_card, record)

    # -- verification from the cached inputs ---------------------------------------------------
    def _correct(self, theta: Tensor, x: Tensor | None, y: Tensor | None) -> Tensor | None:
        """Whether the layer with ``theta`` classifies each row of ``x`` right (None without rows)."""
        if x is None or y is None or len(y) == 0:
            return None
        assert self.state is not None
        k, d = self.state.k, self.state.d
        logits = torch.addmm(theta[k * d:], x, theta[: k * d].reshape(k, d).T)
        return logits.argmax(dim=1) == y

    @staticmethod
    def _share(correct: Tensor | None, rows: Tensor | None) -> float | None:
        if correct is None or rows is None or int(rows.numel()) == 0 or (rows.dtype == torch.bool and not bool(rows.any())):
            return None
        return float(correct[rows].double().mean())

    def metrics(self, parent_dir: str | Path, run: RemovalRun, sample_ids: Sequence[int],
                cumulative_ids: Sequence[int] = ()) -> dict[str, Any]:
        """The keys of ``removal_metrics`` for the run just computed, from cached layer inputs."""
        assert self.state is not None and self.held is not None and self._before is not None
        held, after, before = self.held, self.state.theta, self._before

        def rows(ids: Sequence[int]) -> Tensor | None:
            return torch.tensor([held.position[int(i)] for i in ids], dtype=torch.long) if ids else None

        retain = torch.zeros(len(held.y_all), dtype=torch.bool)
        retain[held.in_state[self.state.retained]] = True
        sets = {"forget": rows(sample_ids), "cumulative_forget": rows(cumulative_ids), "retain": retain}
        out: dict[str, Any] = {"n_train": run.card.training.n, "n_removed_total": len(run.card.training.removed_ids),
                               "batch_samples": len(sample_ids), "measured_on": "cached decision-layer inputs"}
        last = self._last_correct
        for suffix, theta in (("", after), ("_before", before)):
            if suffix and last is not None and torch.equal(last[0], theta):
                correct, test = last[1], last[2]
            else:
                correct, test = self._correct(theta, held.x_all, held.y_all), self._correct(theta, held.test_x, held.test_y)
            if not suffix:
                self._last_correct = (theta.clone(), correct, test)
            for name, r in sets.items():
                out[f"{name}_accuracy{suffix}"] = self._share(correct, r)
            out[f"test_accuracy{suffix}"] = None if test is None else float(test.double().mean())
        b, a = out["retain_accuracy_before"], out["retain_accuracy"]
        out["retain_accuracy_drop"] = None if b is None or a is None else b - a
        return out


def stream_settings_of(spec: Any) -> StreamSettings:
    """``StreamSettings`` from a config object with the same field names."""
    return StreamSettings(refresh_every=spec.refresh_every, drift_threshold=spec.drift_threshold,
                          refresh_tol=spec.refresh_tol, refresh_max_steps=spec.refresh_max_steps,
                          drift_measure=spec.drift_measure)
