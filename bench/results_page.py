"""Write docs/RESULTS.md, the measured-results page, from the JSON files in bench/results/.

    python -m bench.results_page                      # writes docs/RESULTS.md (atomically)
    python -m bench.results_page --out /tmp/R.md      # elsewhere (the test does this)
    python -m bench.results_page --results DIR        # from another results folder

The page opens with the headline tables (``headline_tables``): the end-to-end benchmark's twelve cells on one
processor with the files behind every row, then the identities cells on another processor (``SECOND_MACHINE_CELLS``),
the Fashion-MNIST cells with a brief refit (``BRIEF_CELLS``) and the R8 cells run again (``R8_BRIEF_CELLS``). The
default run also rewrites README.md's short results table from the same JSON (``readme_table``: the first of them
with at most ten rows, its U-LiRA games, and a pointer to the page; between the markers ``<!-- results:start -->``
and ``<!-- results:end -->``); ``--readme PATH`` rewrites that file's table even with ``--out`` or ``--results``
given.

One section per benchmark script, one subsection per JSON file: the command that produced it
(recorded in the JSON, else the usage lines of the script's docstring), the machine it ran on (the
JSON's ``environment`` or ``machine`` entry) and its tables. The tables come from the code that
already renders them: the forgetting benchmarks' from ``bench.forgetting`` and ``bench.deep_forgetting``
(``render_summary``, ``render_markdown``), the other benchmarks' from ``bench.run_all``'s summarisers, and the two
stream benchmarks' key figures from the short lists below. A file that cannot be read or rendered
gets one line naming it and the error, never a crash. The page is deterministic: files in sorted
order, no timestamps, so running it twice gives the same bytes.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
DEFAULT_OUT = ROOT / "docs" / "RESULTS.md"
README = ROOT / "README.md"
README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"
# The first headline table (README's, with fewer rows): the end-to-end benchmark's cells (file, scenario)
README_CELLS = (("deep_fmnist-cnn_partial_class.json", "class"),
                ("deep_fmnist-cnn_partial_random_1pct.json", "random_1pct"),
                ("deep_fmnist-cnn_partial_random_10pct.json", "random_10pct"),
                ("deep_fmnist-cnn_partial_subject.json", "subject"),
                ("deep_r8-minilm_partial_class.json", "class"),
                ("deep_r8-minilm_partial_random_1pct.json", "random_1pct"),
                ("deep_r8-minilm_partial_random_10pct.json", "random_10pct"),
                ("deep_r8-minilm_partial_subject.json", "subject"),
                ("deep_identities_partial_identity.json", "identity"),
                ("deep_identities_partial_random_1pct.json", "random_1pct"),
                ("deep_identities_partial_random_10pct.json", "random_10pct"),
                ("deep_identities_partial_subject.json", "subject"))
# the R8 runs (the fourth headline table's, and the pair whose rows the first table shows): the scenarios each file
# of a pair holds (a pair of processes, two scenarios each)
R8_BRIEF_RUNS = {"class": "class-random_10pct", "random_1pct": "random_1pct-subject",
                 "random_10pct": "class-random_10pct", "subject": "random_1pct-subject"}
R8_CELL_BASELINES = {"class": ("deep_r8-minilm_partial_class_baselines.json",),
                     "random_10pct": ("deep_r8-minilm_partial_random_10pct_baselines.json",
                                      "deep_r8-minilm_partial_random_10pct_recorded_run.json")}

# the pair of runs on the first table's original, each request charged whole, and the rows it replaces there
R8_FIRST_TABLE = "-whole-request-first-table"
R8_RUN_ROWS = ("trajectory-refit", "trajectory-refit-lean", "trajectory-refit-leaner", "salun")


def r8_brief_file(scenario: str, suffix: str = "") -> str:
    """The R8 brief run's file holding ``scenario`` (``suffix`` "-whole-request-first-table": the latest pair's, on
    the first table's original, each request charged whole; "-whole-request": the pair before, on another processor,
    charged so; "-leaner": the pair before that, on the first table's original; "": the pair before that)."""
    return f"deep_r8-minilm_partial_{R8_BRIEF_RUNS[scenario]}_grid-r8-minilm{suffix}.json"


# Companion files of a first-table cell: more rows of the same cell, run by another command on the same reported
# forget sets (its rows are shown where the cell's own file has none; ``merged_block`` checks that the sets'
# sample ids and the reference rows' figures agree, else they are left out and the table says why).
README_COMPANIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("deep_fmnist-cnn_partial_class.json", "class"): ("deep_fmnist-cnn_partial_class_baselines.json",
                                                      "deep_fmnist-cnn_partial_class_recorded_run.json"),
    # a row two companions hold is taken from the first: the *_swept files ran the grids configs/tuning/sweeps/ placed
    ("deep_identities_partial_identity.json", "identity"): ("deep_identities_partial_identity_baselines_swept.json",
                                                            "deep_identities_partial_identity_baselines.json",
                                                            "deep_identities_partial_identity_recorded_run.json"),
    **{(f"deep_identities_partial_{sc}.json", sc):
       ("deep_identities_partial_random_1pct-random_10pct-subject_baselines_swept.json",
        "deep_identities_partial_random_1pct-random_10pct-subject_baselines.json",
        f"deep_identities_partial_{sc}_recorded_run.json")
       for sc in ("random_1pct", "random_10pct", "subject")},
    # R8: trajectory-refit, -lean, -leaner and SalUn from the latest pair of runs on this table's original, each
    # request charged whole (README_RETIMED, so first; the pairs before held only those rows), then the baselines
    **{(f"deep_r8-minilm_partial_{sc}.json", sc): (r8_brief_file(sc, R8_FIRST_TABLE), *R8_CELL_BASELINES.get(sc, ()))
       for sc in R8_BRIEF_RUNS},
}
# suffix-retrain's runs on the identities cells, SalUn beside it in the same run (the table keeps the cell files' own
# SalUn rows, the same figures where both ran the same sets): the last companion of each cell
SUFFIX_RETRAIN_FILE = "deep_identities_partial_{}_suffix_retrain.json"
# U-LiRA played on the three reported sets of a cell and pooled (--ulira-sets 3), at the table's settings
ULIRA_POOLED_FILE = "deep_identities_partial_{}_grid-ulira-pooled-{}.json"
SUFFIX_RETRAIN_CELLS = ("identity", "random_1pct", "random_10pct", "subject")
for _sc in SUFFIX_RETRAIN_CELLS:
    _cell = (f"deep_identities_partial_{_sc}.json", _sc)
    README_COMPANIONS[_cell] = (*README_COMPANIONS[_cell], SUFFIX_RETRAIN_FILE.format(_sc))
# on the identity, suffix-retrain at the cuts a sweep on the tuning sets placed (configs/tuning/timing/
# suffix-retrain-identity-cut.yaml: layer4 on, 4 epochs), its game pooled over the three reported sets: before the
# layer3 run, so that the table shows it
SUFFIX_CUT_FILE = "deep_identities_partial_identity_grid-suffix-retrain-identity-cut.json"
_cell = ("deep_identities_partial_identity.json", "identity")
_at = README_COMPANIONS[_cell].index(SUFFIX_RETRAIN_FILE.format("identity"))
README_COMPANIONS[_cell] = (*README_COMPANIONS[_cell][:_at], SUFFIX_CUT_FILE, *README_COMPANIONS[_cell][_at:])
# and on R8's random 10 % (MiniLM's last layer, the pooler and the head retrained), SalUn beside it
R8_SUFFIX_RETRAIN_FILE = "deep_r8-minilm_partial_random_10pct_suffix_retrain.json"
_cell = ("deep_r8-minilm_partial_random_10pct.json", "random_10pct")
README_COMPANIONS[_cell] = (*README_COMPANIONS[_cell], R8_SUFFIX_RETRAIN_FILE)
# Rows of a companion that replace the cell file's own (and the table's lead says so): on the identities,
# trajectory-refit timed again on the first table's processor, the current method (guard and sibling check), at the
# points configs/tuning/timing/ gives (placed by sweeps on the tuning sets; the cell files hold an older setting, before
# the check), trajectory-refit-sampled beside it in the same run; on R8, the rows of one pair of runs charged whole
README_RETIMED: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    **{(f"deep_identities_partial_{sc}.json", sc): (f"deep_identities_partial_{sc}_grid-{grid}.json", ("trajectory-refit",))
       for sc, grid in (("identity", "trajectory-refit-and-sampled-identity-quarter"),
                        ("random_1pct", "trajectory-refit-and-sampled-quarter-scale-0.3"),
                        ("subject", "trajectory-refit-sampled-orthogonal-subject"))},
    # R8: the rows of ours and SalUn from one pair of runs, each request charged whole
    **{(f"deep_r8-minilm_partial_{sc}.json", sc): (r8_brief_file(sc, R8_FIRST_TABLE), R8_RUN_ROWS)
       for sc in R8_BRIEF_RUNS}}
README_CHARGE = ("Charged each request whole (the remove call, its check that the kept state holds included, and in a "
                 f"campaign the next version's state): the suffix-retrain rows and R8's {', '.join(R8_RUN_ROWS)} "
                 "rows; the others the removal's own seconds, which leave out 0.01-0.06 s of a request on the image "
                 "cells (a median 0.1 %-3 %) and on R8 about 0.1 s of a cold request, 0.5 s of a later one")
README_RETIMED_WHY = ("on the identities, the current method, its guard's sibling check included, with a quarter-epoch "
                      "refit at the scales its sweeps on the tuning sets placed: 0.03 on the identity, 0.3 on random "
                      "1 %, 0.03 on the subject (five tuning subjects); trajectory-refit-sampled beside it in the same "
                      "run (0.1, 0.3, 0.1) and, on the subject, trajectory-refit-sampled-orthogonal (1.0, backtracked by "
                      "its guard); the U-LiRA games below are the cell files' own rows, then those played again at "
                      "these settings. On R8, from one later pair of runs on the same original and sets. "
                      + README_CHARGE)
for _cell, (_retimed, _) in README_RETIMED.items():  # a retimed file is a companion too (first, unless named already)
    if _retimed not in README_COMPANIONS.get(_cell, ()):
        README_COMPANIONS[_cell] = (_retimed, *README_COMPANIONS.get(_cell, ()))
# U-LiRA games played again at the settings of the retimed rows (README_RETIMED), on the cell's first reported set
# or, where the file's game names its forget_sets, on its first k pooled: each file's game is a line after the cell
# file's own (checked: the same sets and reference rows)
README_ULIRA_AGAIN: dict[tuple[str, str], tuple[str, ...]] = {
    ("deep_identities_partial_identity.json", "identity"): (
        "deep_identities_partial_identity_grid-trajectory-refit-and-sampled-identity-quarter_ulira16.json",
        ULIRA_POOLED_FILE.format("identity", "identity"), SUFFIX_CUT_FILE),
    ("deep_identities_partial_random_1pct.json", "random_1pct"): (
        "deep_identities_partial_random_1pct_grid-trajectory-refit-and-sampled-quarter-scale-0.3_ulira16.json",
        SUFFIX_RETRAIN_FILE.format("random_1pct"), ULIRA_POOLED_FILE.format("random_1pct", "random-1pct")),
}
# what a game of README_ULIRA_AGAIN played at settings the table no longer shows for a row (a later run replaced it)
ULIRA_EARLIER_SETTINGS = {ULIRA_POOLED_FILE.format("identity", "identity"):
                          "suffix-retrain there at its earlier cut, layer3 on for 8 epochs"}
# games of README_ULIRA_AGAIN that were not played again but first, for the rows their file adds to the cell
ULIRA_FIRST_PLAYED = frozenset({SUFFIX_RETRAIN_FILE.format("random_1pct"), SUFFIX_CUT_FILE})
# U-LiRA games played through `unlearn eval --ulira-shadows` on a cell's reported sets and pooled by `unlearn eval
# --pool-ulira` (bench/results/eval/): each a line after the cell's other games (checked: its forget sets are the
# cell's first k reported sets, by identity or sample ids), saying at which settings its rows were played
README_ULIRA_EVAL: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    ("deep_identities_partial_identity.json", "identity"): (
        ("eval/reid-identities-ulira32-pooled.json", "suffix-retrain at the earlier cut, layer3 on for 8 epochs: "
                                                     "configs/evaluate/reid-identities-ulira32.yaml"),
        ("eval/reid-identities-ulira32-cut-pooled.json", "suffix-retrain at the table's cut, layer4 on for 4 epochs: "
                                                         "configs/evaluate/reid-identities-ulira32-cut.yaml"),
        ("eval/reid-identities-ulira32-others-pooled.json", "the table's settings: "
                                                            "configs/evaluate/reid-identities-ulira32-others.yaml"),
        ("eval/reid-identities-ulira32-prefix-pushes-pooled.json",
         "suffix-retrain, layer3 on for 8 epochs, over a prefix from which a tenth of U's recorded pushes was taken "
         "back: configs/evaluate/reid-identities-ulira32-prefix-pushes.yaml")),
    ("deep_identities_partial_random_1pct.json", "random_1pct"): (
        ("eval/reid-identities-ulira32-random1pct-pooled.json",
         "the table's settings: configs/evaluate/reid-identities-ulira32-random1pct.yaml"),
        ("eval/reid-identities-ulira32-random1pct-others-pooled.json",
         "the table's settings: configs/evaluate/reid-identities-ulira32-random1pct-others.yaml"),
        ("eval/reid-identities-ulira32-random1pct-tuned-pooled.json",
         "suffix-retrain, layer3 on for 8 epochs in the recipe's batches of 64, the U-LiRA criterion's choice: "
         "configs/evaluate/reid-identities-ulira32-random1pct-tuned.yaml"),
        ("eval/reid-identities-ulira32-random1pct-prefix-pushes-pooled.json",
         "the same over a prefix from which a tenth of U's recorded pushes was taken back: "
         "configs/evaluate/reid-identities-ulira32-random1pct-prefix-pushes.yaml"),
        ("eval/reid-identities-ulira32-random1pct-prefix-pushes-10ep-pooled.json",
         "0.15 of U's pushes taken back, the suffix trained for 10 epochs (a second grid on the tuning set): "
         "configs/evaluate/reid-identities-ulira32-random1pct-prefix-pushes-10ep.yaml"),
        ("eval/reid-identities-ulira32-random1pct-prefix-pushes-fifth-pooled.json",
         "a fifth of U's pushes taken back, the suffix trained for 10 epochs (a third grid, on two tuning sets: "
         "suffix-retrain-prefix-pushes-random): "
         "configs/evaluate/reid-identities-ulira32-random1pct-prefix-pushes-fifth.yaml")),
}
REFERENCE_CHECK = ("original", "retrain", "retrain-reseed")  # rows whose figures must agree between companions
# the headline table's rows in docs/RESULTS.md (its "Headline tables" section, with their sources); README.md shows
# README_ROWS of them, the other baselines folded into its best-of row
HEADLINE_ROWS = ("original", "retrain-reseed", "lfoci-newton", "lfoci-newton-recorded-run", "trajectory-refit",
                 "trajectory-refit-sampled", "trajectory-refit-sampled-orthogonal", "trajectory-refit-lean",
                 "trajectory-refit-leaner", "suffix-retrain", "salun", "finetune")
README_ROWS = ("original", "retrain-reseed", "lfoci-newton", "trajectory-refit", "trajectory-refit-sampled",
               "trajectory-refit-sampled-orthogonal", "trajectory-refit-leaner", "suffix-retrain", "salun")
# (block-gauss-newton, measured on the Fashion-MNIST class alone, 62 % served, is in docs/RESULTS.md)
# one more row: per cell, the one of these baselines with the least Avg. Gap, named (every row of every cell is in
# docs/RESULTS.md); the table stays short however many baselines a cell ran
HEADLINE_BEST_OF = ("gradient-ascent", "neggrad-plus", "random-labels", "scrub", "l1-sparse")
README_BEST_OF = ("finetune", *HEADLINE_BEST_OF)
README_DEFAULT = "lfoci-newton"
COMMAND = "python -m bench.results_page"
# The second headline table: the identities cells run on another processor, whose original differs from the
# first table's (the same command and seeds; its kernels round differently), each against that run's own Retrain;
# variants measured there stand beside each other, never beside the first table's rows
SECOND_MACHINE_CELLS = tuple((f"deep_identities_partial_{sc}_lean.json", sc)
                             for sc in ("identity", "random_1pct", "random_10pct", "subject"))
# trajectory-refit timed there at the points its refit-length sweep placed (configs/tuning/timing/: a quarter epoch on
# random 1 % and the subject, half an epoch on the identity), on the same reported sets
SECOND_MACHINE_TIMING = {"identity": "deep_identities_partial_identity_grid-trajectory-refit-scale-0.1.json",
                         "random_1pct": "deep_identities_partial_random_1pct_grid-trajectory-refit-quarter-scale-0.3.json",
                         "subject": "deep_identities_partial_subject_grid-trajectory-refit-quarter-scale-0.1.json"}
SECOND_MACHINE_COMPANIONS: dict[tuple[str, str], tuple[str, ...]] = {
    (name, sc): (f"deep_identities_partial_{sc}_lean_2x.json",
                 *((SECOND_MACHINE_TIMING[sc],) if sc in SECOND_MACHINE_TIMING else ()))
    for name, sc in SECOND_MACHINE_CELLS}
SECOND_MACHINE_ROWS = ("original", "retrain-reseed", "lfoci-newton-recorded-run-lean",
                       "lfoci-newton-recorded-run-lean-2x", "trajectory-refit")
# The third headline table: the Fashion-MNIST cells run again with trajectory-refit-sampled's brief refit beside SalUn,
# in one run on that processor (configs/tuning/brief/fmnist-cnn.yaml), each against that run's own Retrain
BRIEF_FILE = "deep_fmnist-cnn_partial_class-random_1pct-random_10pct-subject_grid-fmnist-cnn.json"
BRIEF_CELLS = tuple((BRIEF_FILE, sc) for sc in ("class", "random_1pct", "random_10pct", "subject"))
BRIEF_ROWS = ("original", "retrain-reseed", "trajectory-refit-sampled", "salun")
# The fourth headline table: the Reuters R8 cells run again (configs/tuning/brief/r8-minilm.yaml, a pair of runs of two
# scenarios each on one processor, another than the first table's: its original's numerics differ), reading the
# frozen prefix's rows on first read, every row of ours and SalUn in the same run, each request charged whole (the
# binding's check and the next version's state included), each row against its run's own Retrain
R8_BRIEF_CELLS = tuple((r8_brief_file(sc, "-whole-request"), sc) for sc in R8_BRIEF_RUNS)
R8_BRIEF_ROWS = ("original", "retrain-reseed", "trajectory-refit", "trajectory-refit-lean", "trajectory-refit-leaner",
                 "salun")


# -- small formatting helpers ---------------------------------------------------------------------
def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt(x) for x in v)
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True)
    return str(v)


def pick(d: Any, path: str) -> Any:
    """``d["a"]["b"]`` for ``path`` "a.b"; None where any key is missing."""
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def figure_table(d: dict[str, Any], rows: list[tuple[str, str]]) -> list[str]:
    """A "figure | value" table of the ``rows`` (label, dotted path) that the file holds."""
    body = [f"| {label} | {fmt(pick(d, path))} |" for label, path in rows if pick(d, path) is not None]
    return ["| figure | value |", "|---|---|", *body] if body else ["(none of the expected figures in this file)"]


# -- renderers: (JSON) -> markdown lines ----------------------------------------------------------
def render_forgetting(d: dict[str, Any]) -> list[str]:
    from bench.forgetting import render_markdown, render_summary

    full = render_markdown(d).rstrip("\n")
    full = re.sub(r"^### ", "#### ", full, flags=re.M)  # one level below this page's file heading
    return [render_summary(d).rstrip("\n"), "", "<details><summary>Full tables (UA, RA, TA, MIA, U-LiRA, seconds, "
            "ratios)</summary>", "", full, "", "</details>"]


def render_deep_forgetting(d: dict[str, Any]) -> list[str]:
    from bench.deep_forgetting import render_markdown, render_summary

    full = render_markdown(d).rstrip("\n")
    full = re.sub(r"^### ", "#### ", full, flags=re.M)
    return [render_summary(d).rstrip("\n"), "", "<details><summary>Full tables (UA, RA, TA, MIA, KL gaps, embedding "
            "metrics, U-LiRA, cost, served)</summary>", "", full, "", "</details>"]


STREAM_LOAD = [
    ("data set", "dataset"), ("training samples", "n_train"), ("requests", "requests"),
    ("clients", "clients"), ("SIGKILLs of the service", "kills_asked"),
    ("latency acknowledged -> applied p50 (s)", "latency_ack_to_applied_s.p50"),
    ("latency p95 (s)", "latency_ack_to_applied_s.p95"), ("latency p99 (s)", "latency_ack_to_applied_s.p99"),
    ("requests applied per second", "throughput.applied_per_second"),
    ("batches on the fast path", "paths.fast"), ("batches refreshed", "paths.refresh"),
    ("fast path per batch, p50 (s)", "per_request_seconds.fast_path_state_update_and_solve.p50"),
    ("whole remover per batch, p50 (s)", "per_request_seconds.remover_wall_incl_model_load.p50"),
    ("a refresh, p50 (s)", "per_request_seconds.refresh.p50"),
    ("one removal from scratch on cached head inputs (s)", "from_scratch_one_request.method_on_cached_inputs_seconds"),
    ("one removal from scratch, remove() on the model directory (s)",
     "from_scratch_one_request.remove_model_dir_seconds"),
    ("Retrain of the head (s)", "retrain_seconds"),
    ("from-scratch method / fast p50 latency", "floor.ratio_vs_method_on_cached_inputs"),
    ("remove() / fast p50 latency", "floor.ratio_vs_remove_model_dir"),
    ("layer moved by all removals", "drift.removal_moved_the_layer_by"),
    ("served layer to the exact optimum of D_r", "drift.served_to_exact"),
    ("served layer to one from-scratch removal of all", "drift.served_to_from_scratch"),
    ("largest distance bound of a published version", "drift.max_published_distance_bound"),
    ("distance threshold", "drift.threshold.distance"),
    ("test accuracy: original", "test_accuracy.original"), ("test accuracy: served", "test_accuracy.served"),
    ("test accuracy: Retrain", "test_accuracy.retrain"),
    ("requests acknowledged", "durability.audit.acknowledged"),
    ("requests applied exactly once", "durability.audit.applied_exactly_once"),
]
TRAJECTORY_PUSHES = [
    ("training samples n", "n"), ("random forget set m", "m"), ("trained parameters", "parameters"),
    ("recorded checkpoints", "checkpoints"),
    ("replay ends on the saved weights, bit for bit", "replay.bitwise_equal_to_the_saved_model"),
    ("all of D: the run's data pushes, norm", "all_of_D.exact_norm"),
    ("all of D: the trapezium over the checkpoints, norm", "all_of_D.trapezium.norm"),
    ("all of D: the trapezium's cosine with the run's", "all_of_D.trapezium.cosine"),
    ("U: exact pushes, norm", "forget_set.exact_norm"), ("U: trapezium, norm", "forget_set.trapezium.norm"),
    ("U: trapezium's cosine with the exact", "forget_set.trapezium.cosine"),
    ("U: midpoint at the epochs' mean iterates, norm", "forget_set.midpoint.norm"),
    ("U: midpoint's cosine with the exact", "forget_set.midpoint.cosine"),
]


def render_trajectory_pushes(d: dict[str, Any]) -> list[str]:
    """The figures, then the mean losses on U and on the retained probe with each estimate added back (no refit)."""
    lines = figure_table(d, TRAJECTORY_PUSHES)
    table = d.get("added_back_without_refit") or {}
    original = table.get("original") or {}
    lines += ["", "| pushes added back | scale | mean loss on U | on the retained probe |", "|---|---|---|---|",
              f"| none (the original) | - | {fmt(original.get('forget'))} | {fmt(original.get('retained_probe'))} |"]
    for label in ("exact", "midpoint", "trapezium"):
        for point in table.get(label) or []:
            lines.append(f"| {label} | {fmt(point.get('scale'))} | {fmt(point.get('forget'))} | "
                         f"{fmt(point.get('retained_probe'))} |")
    return lines


def render_rewind_curve(d: dict[str, Any]) -> list[str]:
    """The forget set's fit along the recorded run, then the recipe's later epochs on D \\ U from each checkpoint."""
    refs = d.get("references") or {}
    lines = [f"{d.get('dataset')}, {d.get('scenario')} (m = {d.get('m')} of n = {d.get('n')}, the first tuning set); "
             f"Retrain {fmt(d.get('retrain_seconds'))} s; original Avg. Gap {fmt((refs.get('original') or {}).get('AvgGap'))}, "
             f"retrain-reseed {fmt((refs.get('retrain-reseed') or {}).get('AvgGap'))}.", "",
             "| checkpoint after epoch | accuracy on U | on D \\ U (sample) | on the test set |", "|---|---|---|---|"]
    lines += [f"| {t.get('epoch')} | {fmt(t.get('forget_accuracy'))} | {fmt(t.get('retained_accuracy'))} | "
              f"{fmt(t.get('test_accuracy'))} |" for t in d.get("timeline") or []]
    lines += ["", "| rewound to epoch | UA | RA | TA | MIA | Avg. Gap | share of Retrain's seconds |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.get('epoch')} | {fmt(r.get('UA'))} | {fmt(r.get('RA'))} | {fmt(r.get('TA'))} | {fmt(r.get('MIA'))} | "
              f"{fmt(r.get('AvgGap'))} | {fmt(r.get('retrain_share'))} |" for r in d.get("rewind") or []]
    return lines


STREAM_DRIFT = [
    ("model", "model.preset"), ("dtype", "model.dtype"), ("training samples", "model.n_train"),
    ("requests", "requests"), ("batch size", "batch"), ("batches", "batches"),
    ("batches on the fast path", "paths.fast"), ("batches refreshed", "paths.refresh"),
    ("refreshes on drift", "refresh_reasons.drift"), ("distance threshold", "threshold.distance"),
    ("largest distance of a published version to the optimum", "max_stream_to_optimum.value"),
    ("every version within its own recorded bound", "every_batch_within_its_published_bound"),
    ("after the last batch: to the optimum", "final.stream_to_optimum"),
    ("after the last batch: to the chain of from-scratch removals", "final.stream_to_from_scratch"),
    ("from-scratch chain to the optimum, worst", "max_from_scratch_to_optimum"),
    ("the same stream without refreshes, to the optimum", "max_no_refresh_to_optimum"),
    ("layer moved by all removals", "removal_moved_the_layer_by"),
    ("fast batch p50 (s)", "seconds.fast_path_p50"), ("from-scratch removal p50 (s)", "seconds.from_scratch_remove_p50"),
]


def summariser(kind: str) -> Callable[[dict[str, Any]], list[str]]:
    def render(d: dict[str, Any]) -> list[str]:
        from bench import run_all

        return list(run_all.SUMMARISERS[kind](d))
    return render


# prefix of the JSON file name -> (section title, the script that writes it, renderer)
BENCHMARKS: list[tuple[str, str, str | None, Callable[[dict[str, Any]], list[str]]]] = [
    ("forgetting", "Forgetting against Retrain, full data sets", "bench/forgetting.py", render_forgetting),
    ("deep_", "Forgetting inside networks trained end to end", "bench/deep_forgetting.py", render_deep_forgetting),
    ("stream_load", "Streaming removals under load", "bench/stream_load.py",
     lambda d: figure_table(d, STREAM_LOAD)),
    ("stream_drift", "Drift of the streaming fast path", "bench/stream_drift.py",
     lambda d: figure_table(d, STREAM_DRIFT)),
    ("trajectory_pushes", "Trajectory-refit's pushes against the run's own", "bench/trajectory_pushes.py",
     render_trajectory_pushes),
    ("rewind_curve", "How early the recipe fits a forget set, and what its later epochs undo", "bench/rewind_curve.py",
     render_rewind_curve),
    ("gpu_reid", "One removal on the ResNet-50 re-ID model", "bench/bench_gpu_reid.py", summariser("gpu_reid")),
    ("gpu_check", "GPU check", None, summariser("generic")),
    ("huge_layers", "Huge layers: VGG-16 on the CPU", "bench/bench_huge_layers.py", summariser("huge_layers")),
    ("growth", "Growth of one removal", "bench/bench_growth.py", summariser("growth")),
    ("selection", "L-FOCI selection speed", "bench/bench_selection.py", summariser("selection")),
    ("scaling", "Scaling with Ray workers", "bench/bench_scaling.py", summariser("scaling")),
    ("fmnist", "Small-n protocol run: Fashion-MNIST", "bench/bench_fmnist.py", summariser("fmnist")),
    ("text_r8", "Small-n protocol run: MiniLM on Reuters R8", "bench/bench_text_r8.py", summariser("text_r8")),
]
OTHER = ("", "Other results", None, summariser("generic"))


def usage_lines(script: str | None) -> list[str]:
    """The command lines in the script's docstring (``... -m bench.<module> ...``)."""
    if script is None or not (ROOT / script).is_file():
        return []
    module = "bench." + Path(script).stem
    doc = ast.get_docstring(ast.parse((ROOT / script).read_text())) or ""
    return [line.strip() for line in doc.splitlines() if f"-m {module}" in line and "python" in line]


def command_lines(d: Any, script: str | None) -> list[str]:
    recorded = d.get("command") if isinstance(d, dict) else None
    if recorded:
        text = " ".join(recorded) if isinstance(recorded, list) else str(recorded)
        return ["Command (recorded in the file):", "", "```bash", text, "```"]
    usage = usage_lines(script)
    if usage:
        return ["Command: not recorded in the file; the script's usage (its docstring):", "", "```bash", *usage, "```"]
    return ["Command: not recorded in the file, and no script in bench/ writes it."]


def machine_line(d: Any) -> str:
    env = (d.get("environment") or d.get("machine")) if isinstance(d, dict) else None
    if not isinstance(env, dict) or not env:
        gpu = d.get("gpu") if isinstance(d, dict) else None
        return "Machine: not recorded in the file" + (f" (it names the GPU: {fmt(gpu)})." if gpu else ".")
    parts = [f"{k} {fmt([round(x, 2) for x in v] if isinstance(v, list) else v)}" for k, v in env.items()
             if not isinstance(v, dict)]
    return "Machine (the file's environment entry): " + "; ".join(parts) + "."


def file_section(path: Path, script: str | None, render: Callable[[dict[str, Any]], list[str]]) -> list[str]:
    link = f"../bench/results/{path.name}"
    lines = [f"### `{path.name}`", ""]
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return lines + [f"`{path.name}` could not be read ({type(err).__name__}: {err}).", ""]
    if not isinstance(d, dict):
        return lines + [f"`{path.name}` holds no JSON object; nothing to render.", ""]
    lines += [f"File: [{path.name}]({link})" + (f"; wall time of the run {fmt(d['wall_seconds'])} s"
                                                 if isinstance(d.get("wall_seconds"), (int, float)) else "") + ".",
              "", machine_line(d), "", *command_lines(d, script), ""]
    plot = path.with_suffix(".png")
    if plot.is_file():
        lines += [f"Plot: [{plot.name}](../bench/results/{plot.name})", ""]
    try:
        lines += render(d)
    except Exception as err:  # a file this page cannot render is named, never a crash
        lines.append(f"`{path.name}` could not be rendered ({type(err).__name__}: {err}).")
    return lines + [""]


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def build(results_dir: Path = RESULTS_DIR) -> str:
    files = sorted(results_dir.glob("*.json"))
    groups: dict[str, list[Path]] = {}
    for path in files:
        entry = next((b for b in BENCHMARKS if path.stem.startswith(b[0])), OTHER)
        groups.setdefault(entry[1], []).append(path)
    sections = [b for b in [*BENCHMARKS, OTHER] if b[1] in groups]
    lines = [
        "# Measured results", "",
        f"<!-- Generated by `{COMMAND}`: do not edit by hand. -->", "",
        f"This page is generated by `{COMMAND}` (run from the repository root with the project's `.venv`) from "
        f"the {len(files)} JSON files in `bench/results/`; do not edit it by hand: re-run the benchmark, then that "
        "command. Each section names the script that writes its files; each file, the command that produced it and "
        "the machine it ran on. Figures are as measured when each file was written: the code may have changed since "
        "(what changed, and the notes on each run, are in [NOTES.md](NOTES.md); the maths in "
        "[METHODS.md](METHODS.md)). `bench/results/summary.md` is an older summary of the same files, written by "
        "`python -m bench.run_all`.", "",
        "Contents:", "",
        f"- [{HEADLINE_TITLE}](#{slug(HEADLINE_TITLE)}) (what README.md shows, with its sources)",
        *[f"- [{title}](#{slug(title)}) ({len(groups[title])} file{'s' if len(groups[title]) > 1 else ''})"
          for _, title, _, _ in sections], "",
        *headline_tables(results_dir),
    ]
    for _, title, script, render in sections:
        lines += [f"## {title}", "", f"Script: `{script}`." if script else "Script: none in bench/.", ""]
        for path in groups[title]:
            lines += file_section(path, script, render)
    return "\n".join(lines).rstrip("\n") + "\n"


def readme_cell(agg: dict[str, Any] | None) -> str:
    """Avg. Gap to Retrain (mean) and Retrain's seconds over the removal's, cold / per request, and the share
    of requests served where any was refused; or why there is none."""
    from bench.deep_forgetting import _fmt

    if not agg:
        return "-"
    if "AvgGap" not in agg:
        return "needs retrain" if "needs_retrain" in agg else "failed" if "errors" in agg else "-"
    text = f"{agg['AvgGap']['mean']:.1f}"
    if "cold_x" in agg:
        text += f" ({_fmt(agg, 'cold_x')} / {_fmt(agg, 'request_x')})"
    served = (agg.get("served") or {}).get("mean")
    if served is not None and served < 100:
        text += f" [{served:.0f} % served]"
    return text


def best_of_cell(summary: dict[str, Any], rows: tuple[str, ...] | None = None) -> str:
    """The table cell of the one of ``rows`` (default ``HEADLINE_BEST_OF``) with the least finite mean Avg. Gap in
    ``summary``, prefixed with its name, and how many of them the cell ran; "-" where it ran none that has one."""
    rows = HEADLINE_BEST_OF if rows is None else rows
    ran = [row for row in rows if row in summary]

    def gap(row: str) -> float | None:
        value = pick(summary, f"{row}.AvgGap.mean")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return float(value) if ok else None

    scored = {row: value for row in ran if (value := gap(row)) is not None}
    if not scored:
        return "-"
    best = min(scored, key=scored.__getitem__)
    return f"{best} {readme_cell(summary[best])} (of {len(ran)} run)"


def _cell_title(d: dict[str, Any], scenario: str) -> str:
    title = f"{d['dataset_title'].split(',')[0]}, {scenario.replace('_', ' ').replace('pct', ' %')}"
    return title + (" (cannot discriminate)" if d["scenarios"][scenario].get("cannot_discriminate") else "")


def _counts(cells: list[tuple[str, dict[str, Any] | None, str]]) -> tuple[str, str]:
    """The reported forget sets and the campaign's requests of the cells, as one figure or a range."""
    def span(values: list[int]) -> str:
        return f"{min(values)}" if min(values) == max(values) else f"{min(values)}-{max(values)}"
    blocks = [d["scenarios"][sc] for _, d, sc in cells if d is not None]
    return (span([len(b.get("runs", [])) for b in blocks] or [0]),
            span([int(b.get("campaign", {}).get("requests", 0)) for b in blocks] or [0]))


def _ulira_parts(game: dict[str, Any]) -> str:
    """A U-LiRA game's rows among HEADLINE_ROWS: the attack's accuracy (95 % interval), or why a row was not played."""
    rows = game.get("rows", {})
    parts = [f"{row} {rows[row]['accuracy']:.1f} [{rows[row]['ci95'][0]:.1f}, {rows[row]['ci95'][1]:.1f}]"
             for row in HEADLINE_ROWS if isinstance(rows.get(row), dict) and "accuracy" in rows[row]]
    parts += [f"{row} not played ({', '.join(sorted(k for k in rows[row] if k != 'shadow'))} at shadow "
              f"{rows[row].get('shadow')})" for row in HEADLINE_ROWS
              if isinstance(rows.get(row), dict) and "accuracy" not in rows[row]]
    return ", ".join(parts)


def _pooled_words(game: dict[str, Any]) -> str:
    """What a game pooled over several reported sets says of itself in a line ("" for a game on one set)."""
    sets = game.get("forget_sets") or ()
    if len(sets) < 2:
        return ""
    return (f" on reported sets {', '.join(str(k) for k in sets)}, pooled ({game['rows']['original']['examples']} "
            "forget examples; the interval over the shadow pairs and examples together)")


def eval_game_sets(d: dict[str, Any], scenario: str, game: Any) -> list[tuple[int, Any]] | None:
    """(index, identity) of the cell's reported forget sets on which a pooled `unlearn eval` game (``game``: what
    ``--pool-ulira`` writes) was played, in the cell's order (identity None for a set given by its sample ids); None
    where its forget sets are not the cell's first k reported ones, each once (an identity's set named by its label,
    any other by exactly its sample ids)."""
    reported = pick(d, f"declared_sets.{scenario}.reported") or ()
    labels = [s.get("label") if isinstance(s, dict) else None for s in reported]
    ids = [sorted(s.get("sample_ids") or ()) if isinstance(s, dict) else None for s in reported]
    found: list[tuple[int, Any]] = []
    for fs in (game or {}).get("forget_sets") or ():
        fs = fs if isinstance(fs, dict) else {}
        classes, sample_ids = fs.get("classes"), fs.get("sample_ids")
        if isinstance(classes, list) and len(classes) == 1 and classes[0] in labels:
            found.append((labels.index(classes[0]), classes[0]))
        elif isinstance(sample_ids, list) and sample_ids and sorted(sample_ids) in ids:
            found.append((ids.index(sorted(sample_ids)), None))
        else:
            return None
    indices = sorted(k for k, _ in found)
    if not found or indices != list(range(len(found))):
        return None
    return sorted(found, key=lambda kv: kv[0])


def _ulira_cell(game: dict[str, Any], row: str) -> str:
    """A row's accuracy (95 % interval) in a game, "-" where the game did not play it or could not."""
    r = game.get("rows", {}).get(row)
    if not isinstance(r, dict):
        return "-"
    if "accuracy" not in r:
        return f"not played ({', '.join(sorted(k for k in r if k != 'shadow'))} at shadow {r.get('shadow')})"
    return f"{r['accuracy']:.1f} [{r['ci95'][0]:.1f}, {r['ci95'][1]:.1f}]"


def _sets_words(sets: list[int] | None) -> str:
    """A game's reported sets in a table's words: "set 0", "sets 0, 1, 2 pooled"."""
    sets = list(sets or [0])
    return f"set {sets[0]}" if len(sets) == 1 else f"sets {', '.join(str(k) for k in sets)} pooled"


def readme_ulira(cells: list[tuple[str, dict[str, Any] | None, str]],
                 again: dict[tuple[str, str], tuple[str, ...]] | None = None,
                 loaded: dict[str, dict[str, Any] | None] | None = None, link: str = "",
                 by_eval: dict[tuple[str, str], tuple[tuple[str, str], ...]] | None = None, *,
                 as_table: bool = False) -> list[str]:
    """One line per table cell that holds a U-LiRA game: the attack's accuracy (95 % interval) per row; then one per
    file ``again`` names for the cell whose game was played on the same sets (``loaded``: name -> JSON), naming it
    (``link``: the path from the page to the repository's root, "" from README.md); then one per pooled `unlearn
    eval` game ``by_eval`` names for the cell (file, what its rows were), where its sets are the cell's.
    ``as_table``: the same games as one table, a game a row and a method a column (README.md), the games left out
    as lines under it."""
    from pipeline.evaluate.lira import ATTACKABLE as ULIRA_ATTACKABLE

    lines: list[str] = []
    left_out: list[str] = []
    games: list[tuple[str, str, dict[str, Any]]] = []   # (cell, how it was played, game), for the table

    def add(line: str, cell: str, how: str, game: dict[str, Any]) -> None:
        lines.append(line)
        games.append((cell, how, game))

    for name, d, sc in cells:
        game = d["scenarios"][sc].get("ulira") if d is not None else None
        if not game:
            continue
        title = _cell_title(d, sc)
        read = ("read: the original scores at least " if game.get("attackable") else
                "not read: the original scores under ") + f"{ULIRA_ATTACKABLE:g}"
        add(f"- {title}{_pooled_words(game)}, {game['shadows']} shadow pairs ({read}): {_ulira_parts(game)}.",
            title, f"{_sets_words(game.get('forget_sets'))}, the cell's first run (its rows at that run's settings)", game)
        for other in (again or {}).get((name, sc), ()):
            o = (loaded or {}).get(other)
            replay = o["scenarios"][sc].get("ulira") if _has_summary(o, sc) else None
            why = _disagreement_or_unreadable(d, o, sc) if replay else "no U-LiRA game"
            if why is not None:
                left_out.append(f"- {title}: the game of {other} is left out, {why}.")
                lines.append(left_out[-1])
                continue
            first = other in ULIRA_FIRST_PLAYED
            how = ("played for the rows that file adds" if first
                   else "played again at the table's settings") + _pooled_words(replay)
            short = (f"{_sets_words(replay.get('forget_sets'))}, "
                     + ("the run that added its rows" if first else "at the table's settings"))
            if other in ULIRA_EARLIER_SETTINGS:
                how += f" ({ULIRA_EARLIER_SETTINGS[other]})"
                short += f"; {ULIRA_EARLIER_SETTINGS[other]}"
            add(f"- {title}, {how}, {replay['shadows']} shadow pairs ([{other}]({link}bench/results/{other})): "
                f"{_ulira_parts(replay)}.", title, short, replay)
        for other, what in (by_eval or {}).get((name, sc), ()):
            game = (loaded or {}).get(other)
            played = isinstance(game, dict) and isinstance(game.get("rows"), dict)
            sets = eval_game_sets(d, sc, game) if played else None
            if sets is None:
                left_out.append(f"- {title}: the `unlearn eval` game of {other} is left out, "
                                + ("not played on the cell's first reported sets." if played
                                   else "no pooled U-LiRA game."))
                lines.append(left_out[-1])
                continue
            read = "read" if game.get("attackable") else "not read"
            named = (f" (identities {', '.join(str(x) for _, x in sets)})" if all(x is not None for _, x in sets)
                     else "")
            add(f"- {title}, played through `unlearn eval` on reported sets "
                f"{', '.join(str(k) for k, _ in sets)}{named}, pooled "
                f"({game['rows']['original']['examples']} forget examples; the interval over the shadow pairs "
                f"and examples together), {game['shadows']} shadow pairs ({read}; {what}) "
                f"([{other}]({link}bench/results/{other})): {_ulira_parts(game)}.",
                title, f"{_sets_words([k for k, _ in sets])}, `unlearn eval` ({what})", game)
    if as_table:
        return _ulira_table(games, ULIRA_ATTACKABLE) + (["", *left_out] if left_out else [])
    if lines:
        lines = ["", "U-LiRA on the first reported forget set of a cell, or on several pooled where a line says so "
                     "(the attack's accuracy in %, its 95 % interval; 50: it cannot tell the removal from Retrain):",
                 ""] + lines
    return lines


def _ulira_table(games: list[tuple[str, str, dict[str, Any]]], attackable: float) -> list[str]:
    """The U-LiRA games as one table: a game a row (its cell, how and on which reported sets it was played, its
    shadow pairs, whether it is read), a method of ``HEADLINE_ROWS`` a column where some game played it."""
    if not games:
        return []
    columns = [row for row in HEADLINE_ROWS if any(row in g.get("rows", {}) for _, _, g in games)]
    lines = ["", "U-LiRA (the attack's accuracy in %, its 95 % interval; 50: it cannot tell the removal from Retrain; a "
                 f"game is read where the original scores at least {attackable:g}; on one set the interval is over "
                 "its examples, the models held fixed; pooled over sets, over the shadow pairs and the examples "
                 "together; a row's settings are the table's unless the game says otherwise):", "",
             "| cell | game | shadow pairs | read | " + " | ".join(columns) + " |",
             "|---|---|---|---|" + "---|" * len(columns)]
    for cell, how, game in games:
        lines.append(f"| {cell} | {how} | {game['shadows']} | {'yes' if game.get('attackable') else 'no'} | "
                     + " | ".join(_ulira_cell(game, row) for row in columns) + " |")
    return lines


def _disagreement(d: dict[str, Any], other: dict[str, Any], scenario: str) -> str | None:
    """Why ``other``'s rows of ``scenario`` cannot stand beside ``d``'s (None: they can): another data set or
    recipe, reported forget sets not recorded or not the same, or reference rows (original, Retrain,
    retrain-reseed) measured differently (the same seeds on the same data give the same figures)."""
    for key in ("dataset", "recipe"):
        if d.get(key) != other.get(key):
            return f"another {key}"
    sets = [[s.get("sample_ids") if isinstance(s, dict) else None for s in
             pick(x, f"declared_sets.{scenario}.reported") or []] for x in (d, other)]
    if not sets[0] or not all(isinstance(ids, list) and ids for ids in sets[0]):
        return "no reported forget sets' sample ids recorded"
    if sets[0] != sets[1]:
        return "other reported forget sets"
    mine, theirs = d["scenarios"][scenario]["summary"], other["scenarios"][scenario]["summary"]
    for row in REFERENCE_CHECK:
        for metric in ("UA", "RA", "TA", "MIA"):
            a, b = (pick(x, f"{row}.{metric}.mean") for x in (mine, theirs))
            if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or abs(a - b) > 1e-6:
                return f"{row}'s {metric} differs ({a} against {b})"
    return None


def _has_summary(d: Any, scenario: str) -> bool:
    """Whether ``d`` is a result with a summary of ``scenario`` (any other shape: no)."""
    block = pick(d, f"scenarios.{scenario}") if isinstance(d, dict) else None
    return isinstance(block, dict) and isinstance(block.get("summary"), dict)


def _disagreement_or_unreadable(d: dict[str, Any], other: Any, scenario: str) -> str | None:
    """``_disagreement``, with a result of an unexpected shape read as why it cannot stand beside ``d`` (never an
    exception)."""
    try:
        return _disagreement(d, other, scenario)
    except (AttributeError, TypeError, KeyError, ValueError) as err:
        return f"unreadable ({type(err).__name__}: {err})"


def merged_block(d: dict[str, Any], scenario: str, companions: dict[str, Any],
                 superseding: dict[str, tuple[str, ...]] | None = None
                 ) -> tuple[dict[str, Any], list[str], list[str]]:
    """``d``'s block of ``scenario`` with the rows its companion files add (rows ``d`` has stay ``d``'s, except
    those ``superseding`` names for a companion: that companion's figures replace them), the companions merged,
    and one note per companion left out, naming it and why (never an exception)."""
    block = dict(d["scenarios"][scenario])
    summary, merged, notes = dict(block["summary"]), [], []
    for name, other in companions.items():
        if not _has_summary(other, scenario):
            notes.append(f"{name}: missing or without {scenario}")
            continue
        why = _disagreement_or_unreadable(d, other, scenario)
        if why is not None:
            notes.append(f"{name}: not merged, {why}")
            continue
        replaced = (superseding or {}).get(name, ())
        for row, agg in other["scenarios"][scenario]["summary"].items():
            if row in replaced:
                summary[row] = agg
            else:
                summary.setdefault(row, agg)
        merged.append(name)
    block["summary"] = summary
    return block, merged, notes


HEADLINE_TITLE = "Headline tables"


def _load(results_dir: Path) -> dict[str, dict[str, Any] | None]:
    """Every file the headline tables read (cells, companions, games played again, pooled `unlearn eval` games):
    name -> JSON, None where unreadable."""
    loaded: dict[str, dict[str, Any] | None] = {}
    companions = [*README_COMPANIONS.values(), *SECOND_MACHINE_COMPANIONS.values(), *README_ULIRA_AGAIN.values(),
                  *[tuple(f for f, _ in files) for files in README_ULIRA_EVAL.values()]]
    for name in dict.fromkeys([n for n, _ in (*README_CELLS, *SECOND_MACHINE_CELLS, *BRIEF_CELLS, *R8_BRIEF_CELLS)]
                              + [c for cs in companions for c in cs]):
        try:
            loaded[name] = json.loads((results_dir / name).read_text())
        except (OSError, ValueError):
            loaded[name] = None
    return loaded


def _first_table(loaded: dict[str, dict[str, Any] | None], *, sources: bool) -> str:
    """The end-to-end benchmark's twelve cells on one processor with its U-LiRA games: ``HEADLINE_ROWS`` and the
    sources of every row (``sources``, docs/RESULTS.md), or README's ``README_ROWS`` with a pointer there."""
    rows, best_of = (HEADLINE_ROWS, HEADLINE_BEST_OF) if sources else (README_ROWS, README_BEST_OF)
    return _cells_table(loaded, README_CELLS, README_COMPANIONS, rows, best_of,
                        "Networks trained end to end (every layer the recipe trains saw the data).",
                        retimed=README_RETIMED, retimed_why=README_RETIMED_WHY, ulira_again=README_ULIRA_AGAIN,
                        sources=sources, charge_note=README_CHARGE, ulira_eval=README_ULIRA_EVAL)


def readme_table(results_dir: Path = RESULTS_DIR) -> str:
    """README.md's results: the end-to-end benchmark's cells (at most ten rows) with their U-LiRA games; the
    sources of every figure and the other headline tables are in docs/RESULTS.md (``headline_tables``). A file or
    scenario that cannot be read gets its column marked, never a crash."""
    return _first_table(_load(results_dir), sources=False)


def headline_tables(results_dir: Path = RESULTS_DIR) -> list[str]:
    """docs/RESULTS.md's first section: README's table with every row and its sources, then the second machine's
    identities cells, the Fashion-MNIST cells with a brief refit and the R8 cells run again."""
    loaded = _load(results_dir)
    return [f"## {HEADLINE_TITLE}", "",
            "The end-to-end benchmark's tables that README.md shows (the first, with fewer rows) or names, each with "
            "the files its figures come from. Each file's own tables follow in the sections below.", "",
            _first_table(loaded, sources=True), _second_machine_table(loaded), _brief_table(loaded), _r8_table(loaded)]


def _second_machine_table(loaded: dict[str, dict[str, Any] | None]) -> str:
    """The identities cells on a second processor (``SECOND_MACHINE_CELLS``), each row against that run's Retrain."""
    accuracy = [_original_test_accuracy(loaded[cells[-1][0]])
                for cells in (README_CELLS, SECOND_MACHINE_CELLS)]   # the identities cells of each table
    return _cells_table(loaded, SECOND_MACHINE_CELLS, SECOND_MACHINE_COMPANIONS, SECOND_MACHINE_ROWS, (),
                        "The identities benchmark on a second processor, whose original differs from the table's "
                        f"above (the same command and seeds; test accuracy {accuracy[1]} against {accuracy[0]}), "
                        "each row against that run's own Retrain; trajectory-refit there at the points its "
                        "refit-length sweep on the tuning sets placed (a quarter epoch at scale 0.3 on random 1 % "
                        "and 0.1 on the subject, half an epoch at 0.1 on the identity), with its later request "
                        "costs (docs/FINDINGS.md).", with_ulira=False)


def _brief_table(loaded: dict[str, dict[str, Any] | None]) -> str:
    """The Fashion-MNIST cells with trajectory-refit-sampled's brief refit beside SalUn (``BRIEF_CELLS``)."""
    return _cells_table(loaded, BRIEF_CELLS, {}, BRIEF_ROWS, (),
                        "The Fashion-MNIST cells run again, trajectory-refit-sampled with the refit its sweep on the "
                        "tuning sets placed (none, a 64th or a 16th of the recipe's 4 epochs, tuned per scenario) "
                        f"beside SalUn in the same run, on a processor whose original differs from the first table's "
                        f"(test accuracy {_original_test_accuracy(loaded[BRIEF_FILE])} against "
                        f"{_original_test_accuracy(loaded[README_CELLS[0][0]])}), each row against that run's own "
                        "Retrain.", with_ulira=False)


def _r8_table(loaded: dict[str, dict[str, Any] | None]) -> str:
    """The Reuters R8 cells run again (``R8_BRIEF_CELLS``: every row from the same pair of runs)."""
    return _cells_table(loaded, R8_BRIEF_CELLS, {}, R8_BRIEF_ROWS, (),
                        "The Reuters R8 cells run again with each request charged whole (the check that the kept "
                        "state holds and the next version's state included, which the first table's default and "
                        "baseline rows' R8 costs leave out: about 0.1 s of a cold request and 0.5 s of a later one "
                        "that keeps state): trajectory-refit, "
                        "trajectory-refit-lean (few samples everywhere, a refit of 0.03 of the recipe's one epoch) and "
                        "trajectory-refit-leaner (about half its samples, a refit of 0.02), paying MiniLM's frozen "
                        "layers only for the documents a request reads, beside SalUn, in two runs of two scenarios "
                        "each on another processor than the first table's, whose original computes differently in the "
                        "last digits (the same command and seeds; test accuracy "
                        f"{_original_test_accuracy(loaded[R8_BRIEF_CELLS[0][0]])} in both), each row against its "
                        "run's own Retrain.", with_ulira=False)


def _original_test_accuracy(d: dict[str, Any] | None) -> str:
    """The original's test accuracy a result records, as "77.0 %" ("unknown" where it has none)."""
    try:
        return f"{float(d['original_accuracy']['test']):.1f} %"  # type: ignore[index]
    except (ValueError, KeyError, TypeError):
        return "unknown"


def _cells_table(loaded: dict[str, dict[str, Any] | None], cell_files: tuple[tuple[str, str], ...],
                 companions: dict[tuple[str, str], tuple[str, ...]], rows: tuple[str, ...],
                 best_of: tuple[str, ...], lead: str, *, with_ulira: bool = True,
                 retimed: dict[tuple[str, str], tuple[str, tuple[str, ...]]] | None = None,
                 retimed_why: str = "",
                 ulira_again: dict[tuple[str, str], tuple[str, ...]] | None = None, sources: bool = True,
                 charge_note: str = "",
                 ulira_eval: dict[tuple[str, str], tuple[tuple[str, str], ...]] | None = None) -> str:
    """One headline table from the ``loaded`` results (name -> JSON, None where unreadable): the ``rows`` of
    ``cell_files``' cells with their ``companions``' rows merged (checked: the same sets and reference rows), a
    best-of row over ``best_of`` (none where empty), the notes of companions left out and, ``with_ulira``, the
    cells' U-LiRA games. ``retimed``: per cell, a companion and the rows of it that replace the cell file's
    (``retimed_why`` says what they are; the lead names the cells where they did). ``ulira_again``: per cell, files
    whose U-LiRA games follow the cell's own, and ``ulira_eval``'s pooled `unlearn eval` games after them
    (``readme_ulira``). ``sources``: the lead names every file behind the table (docs/RESULTS.md's headline tables,
    its links from docs/); False: none, pointing there (README.md), and ``charge_note`` (what a request was charged,
    which ``retimed_why`` says where the sources are named)."""
    link = "../" if sources else ""
    cells: list[tuple[str, dict[str, Any] | None, str]] = []
    blocks: list[dict[str, Any] | None] = []
    notes: list[str] = []
    merged_in: list[str] = []
    replaced: list[str] = []  # "row on cell from companion", where a retimed companion's rows replaced the file's
    for name, sc in cell_files:
        d = loaded[name]
        ok = isinstance(d, dict) and "dataset_title" in d and _has_summary(d, sc)
        cells.append((name, d if ok else None, sc))
        if not ok:
            blocks.append(None)
            continue
        again = (retimed or {}).get((name, sc))
        block, joined, left_out = merged_block(d, sc, {c: loaded[c] for c in companions.get((name, sc), ())},
                                               None if again is None else {again[0]: again[1]})
        blocks.append(block)
        merged_in += [c for c in joined if c not in merged_in]
        if again is not None and again[0] in joined:
            replaced.append(f"{', '.join(again[1])} (where a row is there) on {_cell_title(d, sc)} from "
                            f"[{again[0]}]({link}bench/results/{again[0]})")
        notes += [f"- {_cell_title(d, sc)}: the rows of {note}." for note in left_out]
    sets, requests = _counts(cells)
    primary = dict.fromkeys(n for n, _ in cell_files)
    if sources:
        where = (" From " + ", ".join(f"[{name}]({link}bench/results/{name})" for name in primary)
                 + ("; the rows a cell's file lacks from " + ", ".join(f"[{name}]({link}bench/results/{name})"
                                                                       for name in merged_in)
                    + " (run on the same reported forget sets; checked: the same sample ids and reference rows)"
                    if merged_in else "")
                 + (f"; in place of the cell file's own rows, {'; '.join(replaced)} ({retimed_why})" if replaced else "")
                 + ". Every table of each file (UA, RA, TA, MIA, KL, rank-1 / mAP, seconds), with its command and "
                 "machine, is in the sections below.")
    else:
        where = ((" Some rows come from later runs on the same original and forget sets." if merged_in or replaced
                  else "")
                 + (f" {charge_note}." if charge_note and replaced else "")
                 + f" Sources, the rows left out, three more tables and every metric (UA, RA, TA, MIA, KL, rank-1 / "
                 f"mAP, seconds) with its command: [docs/RESULTS.md](docs/RESULTS.md#{slug(HEADLINE_TITLE)}) "
                 f"(`{COMMAND}`).")
    lines = [f"{lead} Avg. Gap to Retrain in "
             f"points (SalUn's; lower is better; mean over {sets} reported forget sets, settings chosen on disjoint "
             "tuning sets) and, in brackets, Retrain's seconds over the removal's: cold (everything the request "
             f"needs, its preparation included) / per request over a campaign of {requests} requests; `-`: not run "
             f"in that cell.{f' {README_DEFAULT} is the default.' if README_DEFAULT in rows else ''}"
             + (f" Best other baseline: the one of {', '.join(best_of)} with the least Avg. Gap in the cell (and how "
                "many of them it ran)." if best_of else "") + where,
             "", "| method | " + " | ".join(_cell_title(d, sc) if d is not None else f"{name}: {sc} (missing)"
                                            for name, d, sc in cells) + " |",
             "|---|" + "---|" * len(cells)]
    for row in rows:
        label = f"{row} (default)" if row == README_DEFAULT else row
        lines.append(f"| {label} | " + " | ".join(readme_cell(block["summary"].get(row)) if block is not None else "-"
                                                  for block in blocks) + " |")
    if best_of:
        lines.append("| best other baseline | " + " | ".join(
            best_of_cell(block["summary"], best_of) if block is not None else "-" for block in blocks) + " |")
    return "\n".join(lines + (["", *notes] if notes else [])
                     + (readme_ulira(cells, ulira_again, loaded, link, ulira_eval, as_table=not sources)
                        if with_ulira else [])) + "\n"


def with_readme_table(text: str, table: str) -> str:
    """``text`` with the part between the README markers replaced by ``table``."""
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"README has no {README_START} ... {README_END} markers")
    return text[:start + len(README_START)] + "\n" + table + text[end:]


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="folder of the benchmark JSON files")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="page to write (default docs/RESULTS.md)")
    parser.add_argument("--readme", type=Path, default=None,
                        help="README whose results table to rewrite (default README.md, unless --out or --results is given)")
    args = parser.parse_args(argv)
    write_atomic(args.out, build(args.results))
    print(f"wrote {args.out}")
    readme = args.readme or (README if args.out == DEFAULT_OUT and args.results == RESULTS_DIR else None)
    if readme is not None:
        write_atomic(readme, with_readme_table(readme.read_text(), readme_table(args.results)))
        print(f"wrote the results table of {readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
