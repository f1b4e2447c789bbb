"""The evaluation protocol: judge removal methods against Retrain on one forget set.
``unlearn eval`` (jobs/evaluate.py) is its command line; benchmarks and tests call ``evaluate``.

For a trained model directory and a forget set (random samples, a whole class / identity, or
explicit ids) it runs
  * the Retrain baseline (the model's own recipe from the same start on D_r; cached per forget
    set) and the fine-tune baseline (a few SGD epochs on D_r from the trained weights; cached),
  * every requested removal method through ``pipeline.removal.remove``,
and reports for each: UA, RA, TA, MIA-efficacy, Avg. Gap to Retrain, wall time, KL to
Retrain's outputs on D_f, distance to Retrain's weights (absolute and relative to the
original's), the residual gradient norm on D_r, optionally a LiRA per-example attack with a
handful of shadow models, optionally the U-LiRA distinguishing game (``ulira_shadows`` pairs of
an original trained on D and a Retrain on D_r, each method removing D_f from every original),
mAP / rank-1 for models with a retrieval ``features(x)`` method, and
optionally a removal curve over sequential removals. See ``EvalConfig`` for every field.
Bad input raises ``EvaluationError`` (a ``ValueError``) naming the field.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, field_validator, model_validator
from torch import nn

from pipeline import memory
from pipeline.jsonio import write_json
from pipeline.trajectory import refer_to_trajectory
from pipeline.methods.base import MethodRef, MethodSettings, TrainedModel
from pipeline.data import SampleSet, load_source
from pipeline.evaluate.baselines import Baseline, FineTuneSettings, finetune, init_of, recipe_of, retrain
from pipeline.evaluate.curves import removal_curve
from pipeline.evaluate.divergence import KL_BY_KIND
from pipeline.evaluate.forget_sets import build_forget_set
from pipeline.evaluate.lira import lira_scores, shadow_statistics
from pipeline.evaluate.predict import features_of, logits_of, output_kind, retrieval_method
from pipeline.evaluate.retrieval import query_gallery_split, retrieval_metrics
from pipeline.evaluate.shadows import original_at_seed
from pipeline.evaluate.scorecard import EvalSets, avg_gap, format_table, predict_sets, score, split_for_scenario
from pipeline.evaluate.weights import relative_distance, residual_gradient_norm, trainable_state, weight_distance
from pipeline.models.card import ModelCard, load_model_dir, write_model_dir
from pipeline.progress import StageProgress, Steps
from pipeline.recipe import fit, initial_model
from pipeline.errors import RemovalNotServed
from pipeline.removal import load_trained, remove, training_set

# Method names that mean the baselines (never run twice if a method registry also has them).
BASELINE_NAMES: frozenset[str] = frozenset({"retrain", "finetune", "fine-tune"})


class EvaluationError(ValueError):
    """An evaluation cannot run as configured; the message names the field and the fix."""


class ForgetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scenario: Literal["random", "class", "ids"] = "random"
    fraction: float | None = Field(None, gt=0, lt=1)
    count: int | None = Field(None, gt=0)
    classes: list[int] | None = None
    sample_ids: list[int] | None = None
    seed: int = 0

    @model_validator(mode="after")
    def _complete(self) -> "ForgetSpec":
        needs = {"random": ("fraction", "count"), "class": ("classes",), "ids": ("sample_ids",)}[self.scenario]
        if not any(getattr(self, f) for f in needs):
            raise ValueError(f"forget.scenario '{self.scenario}' needs forget.{' or forget.'.join(needs)}")
        return self


class CurveSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: str = "lfoci-newton"
    step: int = Field(1, ge=1)
    steps: int = Field(5, ge=1)


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_dir: str
    forget: ForgetSpec = Field(default_factory=lambda: ForgetSpec(fraction=0.01))
    methods: dict[str, SerializeAsAny[MethodSettings] | None] = Field(
        default_factory=lambda: {"lfoci-newton": {}},
        description="method name -> its settings (parsed once into the method's Settings; baselines: null)")
    baselines: list[Literal["retrain", "finetune"]] = Field(default_factory=lambda: ["retrain", "finetune"])
    finetune: FineTuneSettings = Field(default_factory=FineTuneSettings)
    retrain_seeds: list[int] | None = None
    test_split: str = "test"
    mia_feature: str = "confidence"
    residual_gradient: bool = True
    lira_shadows: int = Field(0, ge=0)
    ulira_shadows: int = Field(
        0, ge=0, description="U-LiRA (Hayes et al. 2024): this many shadow pairs, pair s an original trained on D "
                             "and a Retrain on D_r, both with the recipe's seed + s (pair 0: the model itself and "
                             "its Retrain); every method and fine-tune remove D_f from each original; 0 = off, "
                             "else at least 3")
    ulira_controls: int = Field(
        0, ge=0, description="U-LiRA: also play the game on this many members of D_r and this many test samples "
                             "(drawn with the evaluation's seed; 0 = off), samples the removal was not asked about: a "
                             "removal that differs from Retrain on every sample reads above 50 there too, so the forget "
                             "set's reading above theirs is what it left of D_f")
    retrieval: bool | None = None
    curve: CurveSpec | None = None
    seed: int = 0
    batch_size: int = Field(256, gt=0)
    memory_budget: memory.Setting = Field(
        "auto", description="working memory each pass may use on top of the loaded model and data: 'auto' "
                            f"({memory.AUTO_FRACTION:g} x available RAM, or CUDA free memory), or a size like '8GiB'; "
                            "batches, Hessian columns per pass and probe passes shrink to fit it")
    continue_on_error: bool = Field(False, description="record a failing method's error and go on")
    cache_dir: str | None = "runs/cache/baselines"
    out: str | None = None
    plots: str | None = None

    @field_validator("methods", mode="before")
    @classmethod
    def _parse_methods(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        out: dict[str, Any] = {}
        for name, settings in raw.items():
            if name in BASELINE_NAMES:
                out[name] = None
                continue
            # a variant in configs/methods/ or a registered method, these settings on top of the variant's
            out[name] = MethodRef.model_validate({"name": name, "settings": settings}).settings
        return out

    @model_validator(mode="after")
    def _shadows_and_baselines(self) -> "EvalConfig":
        if self.lira_shadows and self.lira_shadows % 2:
            raise ValueError("lira_shadows must be even (each forget sample is 'in' for half of the shadows)")
        if self.ulira_shadows in (1, 2):
            raise ValueError("ulira_shadows must be 0 or at least 3 (the attack fits its Gaussians on the other pairs "
                             "than the one it holds out, and needs two of them for a spread)")
        if self.ulira_controls and not self.ulira_shadows:
            raise ValueError("ulira_controls needs ulira_shadows (the controls are played in the U-LiRA game)")
        if self.ulira_shadows and "retrain" not in self.baselines:
            raise ValueError("ulira_shadows needs baselines to include 'retrain' (the game's other side)")
        if "retrain" not in self.baselines and (self.methods or "finetune" in self.baselines):
            raise ValueError("baselines must include 'retrain': every comparison is against Retrain")
        return self


# ---------------------------------------------------------------------------------------------
def _with_state(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    twin = copy.deepcopy(model)
    twin.load_state_dict(state, strict=True)
    twin.eval()
    return twin


def _card_digest(card: ModelCard) -> str:
    import hashlib

    return hashlib.sha256(card.model_dump_json().encode()).hexdigest()[:20]


def _reference_row(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = set.intersection(*(set(r) for r in rows))
    return {k: float(np.mean([r[k] for r in rows])) for k in keys if isinstance(rows[0][k], (int, float))}


class Evaluation:
    """One evaluation run (state shared by the steps below)."""

    def __init__(self, config: EvalConfig) -> None:
        self.config = config
        self.model, self.task, self.card = load_model_dir(config.model_dir)
        self.model.eval()
        self.train = training_set(self.card)
        splits = load_source(self.card.data.source, self.card.data.options)
        if config.test_split not in splits:
            raise EvaluationError(f"test_split: '{config.test_split}' is not a split of the data (has {sorted(splits)})")
        self.test: SampleSet = splits[config.test_split]
        spec = config.forget
        options = spec.model_dump(exclude={"scenario", "sample_ids"}, exclude_none=True)
        if spec.scenario == "ids":
            self.sample_ids = sorted(spec.sample_ids or [])
            self.train.positions_of(self.sample_ids, field="forget.sample_ids")  # unknown ids: a clear error
        else:
            self.sample_ids = build_forget_set(spec.scenario, self.train, **options)
        self.sets: EvalSets = split_for_scenario(self.train, self.test, self.sample_ids,
                                                 spec.classes if spec.scenario == "class" else None)
        self.kind = output_kind(self.task)
        if config.ulira_shadows:
            self._check_ulira()
        self.models: dict[str, nn.Module] = {"original": self.model}
        self.rows: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, str] = {}
        self.needs_retrain: dict[str, dict[str, Any]] = {}  # methods that refused (RemovalNotServed)
        self._w0_path: Path | None = None
        self.forget_logits: dict[str, torch.Tensor] = {}
        self.steps: Steps | None = None  # the progress bar over the protocol's steps (evaluate)

    def _check_ulira(self) -> None:
        """The U-LiRA game's preconditions, before any work: pair 0 must be drawn as the others are."""
        extra = self.card.training.extra
        why = None
        if "mixed_linear" in extra:
            why = ("a Mixed-Linear model's shadow originals would need their core and user weights trained per seed, "
                   "which this protocol does not do")
        elif self.card.training.removed_ids or "baseline" in extra:
            why = ("the model is not a trained original (its card records removed samples): pair 0 would be a "
                   "removal while the other originals are trained; evaluate the original it came from")
        elif str(extra.get("dtype", "float32")) != "float32":
            why = f"the model is in {extra['dtype']} and the Retrain baseline trains in float32; the pairs would differ"
        elif self.kind != "single":
            why = "the attack's statistic, the logit of p_y, needs one label per example; this model is multi-label"
        if why is not None:
            raise EvaluationError(f"ulira_shadows: {why}; set it to 0")

    def step(self, name: str):
        """One step of the protocol on the progress bar (a no-op context without one)."""
        return self.steps.step(name) if self.steps is not None else contextlib.nullcontext()

    # -- rows ------------------------------------------------------------------------------
    def score_row(self, name: str, model: nn.Module, seconds: float, extra: dict[str, Any] | None = None) -> None:
        logits = predict_sets(model, self.task, self.sets, self.config.batch_size)
        row: dict[str, Any] = score(model, self.task, self.sets, mia_feature=self.config.mia_feature,
                                    seed=self.config.seed, batch_size=self.config.batch_size, logits=logits)
        self.forget_logits[name] = logits["forget"]
        row["seconds"] = seconds
        row.update(extra or {})
        self.rows[name] = row
        self.models[name] = model

    def run_baselines(self) -> None:
        cfg = self.config
        if "retrain" in cfg.baselines:
            seeds = cfg.retrain_seeds or [recipe_of(self.card).seed]
            runs: list[Baseline] = []
            for i, s in enumerate(seeds):
                name = "retrain" if i == 0 else f"retrain-seed{s}"
                with self.step(name):
                    runs.append(retrain(self.card, self.sets.retain, self.sample_ids, cache_dir=cfg.cache_dir, seed=s))
                    self.score_row(name, runs[-1].model, runs[-1].seconds, {"cached": runs[-1].cached})
            if len(runs) > 1:
                self.rows["retrain-mean"] = _reference_row([self.rows["retrain"]] +
                                                           [self.rows[f"retrain-seed{s}"] for s in seeds[1:]])
        if "finetune" in cfg.baselines:
            with self.step("finetune"):
                run = finetune(self.card, self.model, self.task, self.sets.retain, self.sample_ids,
                               settings=cfg.finetune, cache_dir=cfg.cache_dir)
                self.score_row("finetune", run.model, run.seconds, {"cached": run.cached})

    def run_methods(self) -> dict[str, Any]:
        records = {}
        for name, settings in self.config.methods.items():
            if name in BASELINE_NAMES:
                continue
            with self.step(name):
                started = time.perf_counter()
                try:
                    run = remove(self.config.model_dir, self.sample_ids, method=name, settings=settings,
                                 seed=self.config.seed, batch_size=self.config.batch_size,
                                 memory_budget=memory.current_budget(), stage_hook=StageProgress(name))
                except RemovalNotServed as refused:  # the method's own verdict, not a failure
                    self.needs_retrain[name] = {"reason": refused.reason, "diagnostics": refused.diagnostics,
                                                "seconds": time.perf_counter() - started}
                    continue
                except Exception as err:
                    if not self.config.continue_on_error:
                        raise
                    self.errors[name] = f"{type(err).__name__}: {err}"
                    continue
                seconds = time.perf_counter() - started
                self.score_row(name, _with_state(self.model, run.new_state), seconds, {
                    "preparation_seconds": run.record["preparation"]["seconds"],
                    "removal_seconds": run.record["removal_seconds"]})
                records[name] = {k: v for k, v in run.record.items() if k != "sample_ids"}
        return records

    # -- comparisons with Retrain ----------------------------------------------------------------
    def compare(self) -> None:
        if "retrain" not in self.rows:
            return
        reference = self.rows.get("retrain-mean", self.rows["retrain"])
        ref_model = self.models["retrain"]
        ref_logits = self.forget_logits["retrain"]
        ref_state, orig_state = trainable_state(ref_model), trainable_state(self.model)
        kl = KL_BY_KIND[self.kind]
        for name, row in self.rows.items():
            if name.startswith("retrain") and name != "retrain":
                continue
            model = self.models[name]
            row["AvgGap"] = avg_gap(row, reference)
            row["KL_forget_vs_retrain"] = kl(self.forget_logits[name], ref_logits)
            state = trainable_state(model)
            row["distance_to_retrain"] = weight_distance(state, ref_state)
            row["relative_distance_to_retrain"] = relative_distance(state, orig_state, ref_state)
            if self.config.residual_gradient:
                row["residual_gradient_norm"] = residual_gradient_norm(
                    model, self.task, self.sets.retain, self.card.training.weight_decay, self.config.batch_size)

    def retrieval(self) -> None:
        wanted = self.config.retrieval
        has_features = retrieval_method(self.model) is not None and "x" in self.test.columns
        if wanted is False or (wanted is None and not has_features):
            return
        query_pos, gallery_pos = query_gallery_split(self.sets.test.columns["y"])
        query, gallery = self.sets.test.take(query_pos), self.sets.test.take(gallery_pos)
        for name, row in self.rows.items():
            if name not in self.models:
                continue
            model = self.models[name]
            metrics = retrieval_metrics(features_of(model, query, self.config.batch_size), query.columns["y"],
                                        features_of(model, gallery, self.config.batch_size), gallery.columns["y"])
            row["mAP"], row["rank1"] = metrics["mAP"], metrics["rank1"]

    def lira(self) -> dict[str, Any] | None:
        n = self.config.lira_shadows
        if not n:
            return None
        recipe, init = recipe_of(self.card), init_of(self.card)

        def train_shadow(data: SampleSet, seed: int) -> nn.Module:
            model, task, _ = initial_model(self.card.preset, self.card.options, seed=recipe.seed, init=init)
            fit(model, task, data, recipe.model_copy(update={"seed": recipe.seed + 1 + seed}))
            return model.eval()

        started = time.perf_counter()
        stats, mask = shadow_statistics(self.task, self.sets.forget, self.sets.retain, train_shadow,
                                        n_shadows=n, seed=self.config.seed, batch_size=self.config.batch_size)
        for name, row in self.rows.items():
            if name in self.models:
                result = lira_scores(self.models[name], self.task, self.sets.forget, stats, mask,
                                     batch_size=self.config.batch_size)
                row["LiRA_member_rate"] = result["member_rate"]
                row["LiRA_mean_llr"] = result["mean_llr"]
        return {"shadows": n, "seconds": time.perf_counter() - started}

    def ulira(self) -> dict[str, Any] | None:
        """The U-LiRA distinguishing game (``pipeline.evaluate.lira.play_ulira``) over ``ulira_shadows`` pairs:
        pair s is the recipe run with seed s0 + s on D (an original, written as a model directory with its
        recorded run: ``original_at_seed``) and on D_r (a Retrain); pair 0 is the model itself and its Retrain. Each
        method removes D_f from every original through ``pipeline.removal.remove`` (with the method's seed + s),
        fine-tune tunes each; a method that refuses or fails on a pair has no game, and says which pair. Pairs are
        played one at a time: only phi on D_f is kept from each."""
        n = self.config.ulira_shadows
        if not n:
            return None
        from pipeline.evaluate.lira import control_games, phi_parts, play_ulira
        from pipeline.progress import bar

        cfg, s0 = self.config, recipe_of(self.card).seed
        y = self.sets.forget.columns["y"]
        controls = self._ulira_controls()

        def parts(model: nn.Module) -> dict[str, Any]:
            out: dict[str, Any] = phi_parts(logits_of(model, self.task, self.sets.forget, cfg.batch_size), y)
            out["controls"] = {key: phi_parts(logits_of(model, self.task, subset, cfg.batch_size),
                                              subset.columns["y"])["phi"] for key, subset in controls.items()}
            return out

        names = [name for name in self.config.methods if name not in BASELINE_NAMES]
        if "finetune" in cfg.baselines:
            names.append("finetune")
        rows: dict[str, Any] = {"original": [parts(self.model)]}
        for name in names:
            if name in self.models:
                rows[name] = [parts(self.models[name])]
            else:  # refused or failed on the model itself: no game
                why = self.needs_retrain.get(name)
                rows[name] = ({"needs_retrain": why["reason"], "shadow": 0} if why else
                              {"error": self.errors.get(name, "not run"), "shadow": 0})
        first_seed = (cfg.retrain_seeds or [s0])[0]
        retrained = [parts(self.models["retrain"]) if first_seed == s0 else
                     parts(retrain(self.card, self.sets.retain, self.sample_ids, cache_dir=cfg.cache_dir, seed=s0).model)]
        started, trained = time.perf_counter(), {"seconds": 0.0, "cached": 0}
        with tempfile.TemporaryDirectory(prefix="unlearn-ulira-") as scratch, \
                bar(n - 1, "U-LiRA shadow pairs", unit="pair") as pairs:
            for s in range(1, n):
                directory, seconds, cached = original_at_seed(self.card, self.train, s0 + s, Path(scratch) / f"original{s}",
                                                              cache_dir=cfg.cache_dir)
                trained["seconds"] += seconds
                trained["cached"] += int(cached)
                shadow = load_trained(directory, batch_size=cfg.batch_size)  # once per pair: every row removes from it
                rows["original"].append(parts(shadow.model))
                for name in names:
                    if isinstance(rows[name], dict):
                        continue
                    phi, why = self._shadow_removal(name, s, shadow, parts)
                    if why is not None:
                        rows[name] = why
                    else:
                        rows[name].append(phi)
                run = retrain(self.card, self.sets.retain, self.sample_ids, cache_dir=cfg.cache_dir, seed=s0 + s)
                retrained.append(parts(run.model))
                pairs.update(1)
        cell = play_ulira(retrained, rows, seed=cfg.seed)
        if controls:
            cell["controls"] = {key: {"sample_ids": controls[key].sample_ids.tolist(), "rows": game}
                                for key, game in control_games(retrained, rows, seed=cfg.seed).items()}
        return {**cell, "seeds": [s0 + s for s in range(n)],
                "originals_trained": {"seconds": trained["seconds"], "cached": trained["cached"]},
                "seconds": time.perf_counter() - started}

    def _ulira_controls(self) -> dict[str, SampleSet]:
        """The U-LiRA game's control sets (``ulira_controls`` samples each, drawn with the evaluation's seed): members
        of D_r ("retained") and test samples ("test"; in a class scenario, of the classes kept)."""
        k = self.config.ulira_controls
        if not k:
            return {}
        generator = torch.Generator().manual_seed(self.config.seed)
        out = {}
        for key, subset in (("retained", self.sets.retain), ("test", self.sets.test)):
            out[key] = subset.take(torch.randperm(len(subset), generator=generator)[:k])
        return out

    def _shadow_removal(self, name: str, s: int, shadow: TrainedModel,
                        parts: Any) -> tuple[dict[str, np.ndarray] | None, dict[str, Any] | None]:
        """(phi's parts under one row's removal from shadow original ``s``, None), or (None, why the row has no
        game: a refusal or, with ``continue_on_error``, an error, naming the pair). ``shadow`` is left as it was
        (the removal runs on a copy of its model: ``remove`` changes a loaded model in place)."""
        cfg = self.config
        try:
            if name == "finetune":
                run = finetune(shadow.card, shadow.model, shadow.task, self.sets.retain, self.sample_ids,
                               settings=cfg.finetune, cache_dir=cfg.cache_dir)
                return parts(run.model), None
            work = dataclasses.replace(shadow, model=copy.deepcopy(shadow.model))
            removal = remove(work, self.sample_ids, method=name, settings=cfg.methods[name], seed=cfg.seed + s,
                             batch_size=cfg.batch_size, memory_budget=memory.current_budget(),
                             stage_hook=StageProgress(f"U-LiRA {name} {s}"))
        except RemovalNotServed as refused:
            return None, {"needs_retrain": refused.reason, "shadow": s}
        except Exception as err:
            if not cfg.continue_on_error:
                raise
            return None, {"error": f"{type(err).__name__}: {err}", "shadow": s}
        return parts(_with_state(shadow.model, removal.new_state)), None

    def curve(self) -> dict[str, Any] | None:
        spec = self.config.curve
        if spec is None:
            return None
        order = list(self.sample_ids)[: spec.step * spec.steps]
        settings = self.config.methods.get(spec.method)
        with tempfile.TemporaryDirectory(prefix="unlearn-curve-") as tmp:
            current = {"dir": Path(self.config.model_dir)}

            def step_fn(ids: list[int]) -> nn.Module:
                run = remove(current["dir"], ids, method=spec.method, settings=settings, seed=self.config.seed,
                             batch_size=self.config.batch_size, memory_budget=memory.current_budget(),
                             stage_hook=StageProgress(f"curve {spec.method}"))
                nxt = Path(tmp) / f"step{len(list(Path(tmp).iterdir()))}"
                write_model_dir(nxt, run.new_state, refer_to_trajectory(run.card, current["dir"], nxt))
                current["dir"] = nxt
                return _with_state(self.model, run.new_state)

            curve = removal_curve(self.model, self.task, self.train, self.test, order, spec.step, step_fn,
                                  label=spec.method, batch_size=self.config.batch_size)
        self.curve_result = curve
        return curve.as_dict()


def pool_ulira_results(results: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The U-LiRA games of several ``evaluate`` results (each ``ulira_shadows`` on its own forget set of one model)
    pooled per row (``pipeline.evaluate.lira.pool_ulira``). They must share the model directory and the shadow pairs'
    seeds (so that pair s holds the same original in every game); ``names`` name them in errors and in the rows
    that are not pooled."""
    from pipeline.evaluate.lira import pool_ulira

    if len(results) < 2:
        raise EvaluationError("pooling U-LiRA games needs at least two results")
    for name, result in zip(names, results):
        if not isinstance(result, dict) or not isinstance(result.get("ulira"), dict):
            raise EvaluationError(f"{name}: holds no U-LiRA game (an `unlearn eval` result with ulira_shadows)")
    first = results[0]
    for name, result in zip(names[1:], results[1:]):
        for key, value, where in (("model_dir", result.get("model_dir"), first.get("model_dir")),
                                  ("ulira.seeds", result["ulira"].get("seeds"), first["ulira"].get("seeds"))):
            if value != where:
                raise EvaluationError(f"{name}: {key} is {value!r}, not {where!r} as in {names[0]}: the games must be "
                                      "played on one model with the same shadow pairs")
    seen: dict[tuple[int, ...], str] = {}
    for name, result in zip(names, results):
        ids = tuple(sorted(int(i) for i in result.get("sample_ids") or []))
        if ids in seen:
            raise EvaluationError(f"{name}: the same forget set as {seen[ids]}; pool each forget set once")
        seen[ids] = name
    pooled = pool_ulira([r["ulira"] for r in results], names, what="result")
    return {"model_dir": first.get("model_dir"), "shadows": first["ulira"]["shadows"],
            "seeds": first["ulira"].get("seeds"), "pooled": list(names),
            "forget_sets": [r.get("scenario") for r in results], "examples": [r.get("m") for r in results], **pooled}


def protocol_steps(config: EvalConfig) -> list[str]:
    """The steps ``evaluate`` runs, in order (its progress bar counts them)."""
    names = ["load", "original"]
    if "retrain" in config.baselines:
        names += ["retrain"] + [f"retrain-seed{s}" for s in (config.retrain_seeds or [])[1:]]
    if "finetune" in config.baselines:
        names.append("finetune")
    names += [name for name in config.methods if name not in BASELINE_NAMES]
    names.append("compare")
    if config.lira_shadows:
        names.append("lira")
    if config.ulira_shadows:
        names.append("ulira")
    if config.curve is not None:
        names.append("curve")
    return names


def evaluate(config: EvalConfig) -> dict[str, Any]:
    """Run the whole evaluation; returns the JSON-ready result (also written to ``config.out``).
    Every pass (baselines' evaluation, removals, metrics) sizes its chunks from
    ``config.memory_budget``; a budget too small for one sample fails before any work."""
    with memory.use_budget(config.memory_budget) as budget:
        return _evaluate(config, budget)


def _evaluate(config: EvalConfig, budget: memory.MemoryBudget) -> dict[str, Any]:
    started = time.perf_counter()
    with Steps(protocol_steps(config), "eval") as steps:
        with steps.step("load"):
            ev = Evaluation(config)
            memory.check_one_sample(ev.model, ev.task, ev.train, budget)
        ev.steps = steps
        with steps.step("original"):
            ev.score_row("original", ev.model, 0.0)
        ev.run_baselines()
        records = ev.run_methods()
        with steps.step("compare"):
            ev.compare()
            ev.retrieval()
        lira = curve = None
        if config.lira_shadows:
            with steps.step(f"LiRA ({config.lira_shadows} shadows)"):
                lira = ev.lira()
        ulira = None
        if config.ulira_shadows:
            with steps.step(f"U-LiRA ({config.ulira_shadows} shadow pairs)"):
                ulira = ev.ulira()
        if config.curve is not None:
            with steps.step(f"removal curve ({config.curve.method})"):
                curve = ev.curve()
    result: dict[str, Any] = {
        "model_dir": config.model_dir, "preset": ev.card.preset, "data": ev.card.data.model_dump(),
        "n": len(ev.train), "scenario": config.forget.model_dump(exclude_none=True),
        "sample_ids": ev.sample_ids, "m": len(ev.sample_ids), "rows": ev.rows, "method_records": records,
        "method_errors": ev.errors, "needs_retrain": ev.needs_retrain,
        "lira": lira, "ulira": ulira, "curve": curve, "table": format_table({k: v for k, v in ev.rows.items()}),
        "config": config.model_dump(mode="json"), "wall_seconds": time.perf_counter() - started,
    }
    if config.plots:
        from pipeline.evaluate.plots import plot_removal_curves, plot_scorecard

        plots = {"scorecard": str(plot_scorecard(ev.rows, Path(config.plots) / "scorecard.png"))}
        if curve is not None:
            plots["curve"] = str(plot_removal_curves([ev.curve_result], Path(config.plots) / "removal_curve.png"))
        result["plots"] = plots
    if config.out:
        write_json(Path(config.out), result)
    return result


