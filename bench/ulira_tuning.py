"""A removal's settings chosen by the U-LiRA game on a declared tuning set, never on a reported one.

    python -m bench.ulira_tuning --grid configs/evaluate/tuning/identities-suffix-ulira.yaml
    python -m bench.ulira_tuning --grid FILE --tuning-set 1 --cache-dir runs/cache/baselines --out B.json
    python -m bench.ulira_tuning --combine A.json --combine B.json --out C.json   # the choice over both sets

For each point of the grid file's ``grid`` (the method's ``base`` settings + the point), one ``unlearn eval``
(``pipeline.evaluate.protocol.evaluate``, the same code and the same shadow-model cache) plays the U-LiRA game with
``ulira_shadows`` pairs on the tuning set, and on ``ulira_controls`` retained members and test samples the removal
was not asked about. The tuning set is the scenario's ``tuning_set``-th declared tuning set, drawn as the deep
forgetting benchmark draws its sets (``bench.deep_forgetting.draw_forget_sets``: disjoint from every reported set
in samples and labels; checked here again). Criterion: the least worst reading, max(the game on U, on the retained
members, on the test samples): a setting that reads 50 on U only because it differs from Retrain on every sample
in a way that offsets what it left of U (e.g. a suffix trained too briefly, under-confident everywhere) reads above
50 on its controls and is not chosen. Ties: the grid's order. Runs on several tuning sets combine: the least mean
over the sets of the worst reading. This is a measurement harness: the removal is the
registered method, run by the evaluation as a user runs it. Writes one JSON: every point's readings, seconds, Avg.
Gap and the choice.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, write_json

CONTROL_SETS = ("retained", "test")


def control_rows(ulira: dict[str, Any], key: str) -> dict[str, Any]:
    """Every row's game on control set ``key`` ({} where it was not played)."""
    return ulira.get("controls", {}).get(key, {}).get("rows", {})


def worst_reading(ulira: dict[str, Any], row: str) -> float | None:
    """max of ``row``'s game on U and on every control set (None where it has no game on one of them)."""
    readings = [ulira["rows"].get(row, {}).get("accuracy")]
    readings += [control_rows(ulira, key).get(row, {}).get("accuracy") for key in CONTROL_SETS]
    return None if any(r is None for r in readings) else float(max(readings))


def choose(points: list[dict[str, Any]]) -> int | None:
    """The index of the point with the least worst reading (the first of equals); None when none was played."""
    played = [(p["worst"], i) for i, p in enumerate(points) if p.get("worst") is not None]
    return min(played)[1] if played else None


def combine(results: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Several runs of one grid, each on its own declared tuning set, into one choice: per point the mean over the
    sets of its worst reading (no reading where a set has none), the least chosen (``choose``)."""
    if len(results) < 2:
        raise ValueError("--combine needs at least two results")
    first = results[0]
    for name, result in zip(names, results):
        for key in ("method", "model_dir", "ulira_shadows", "ulira_controls"):
            if result.get(key) != first.get(key):
                raise ValueError(f"{name}: {key} is {result.get(key)!r}, not {first.get(key)!r} as in {names[0]}")
        if [p["settings"] for p in result["points"]] != [p["settings"] for p in first["points"]]:
            raise ValueError(f"{name}: another grid than {names[0]}'s")
        if result["tuning_set"].get("scenario") != first["tuning_set"].get("scenario"):
            raise ValueError(f"{name}: scenario {result['tuning_set'].get('scenario')!r}, not "
                             f"{first['tuning_set'].get('scenario')!r} as in {names[0]}")
    sets = [r["tuning_set"]["index"] for r in results]
    if len(set(sets)) != len(sets):
        raise ValueError(f"the results play tuning sets {sets}: each set once")
    points = []
    for i, point in enumerate(first["points"]):
        worst = [r["points"][i]["worst"] for r in results]
        points.append({"settings": point["settings"], "worst_per_set": worst,
                       "worst": None if any(w is None for w in worst) else sum(worst) / len(worst)})
    best = choose(points)
    return {"benchmark": "ulira_tuning", "combined": names, "method": first["method"],
            "model_dir": first["model_dir"], "tuning_sets": [r["tuning_set"] for r in results],
            "ulira_shadows": first["ulira_shadows"], "ulira_controls": first["ulira_controls"],
            "criterion": "least mean over the tuning sets of max(U-LiRA on U, on the retained controls, on the test "
                         "controls); ties: grid order",
            "points": points, "chosen": best, "chosen_settings": None if best is None else points[best]["settings"]}


def tuning_set(grid: dict[str, Any], card: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The eval ``forget`` section of the declared tuning set, and its description (sample ids, label)."""
    from bench.deep_forgetting import class_count, draw_forget_sets
    from pipeline.removal import training_set

    train = training_set(card)
    k = class_count(card.options, train)
    scenario = str(grid["scenario"])
    reported, tuning = draw_forget_sets(scenario, train, k, int(grid["reported_sets"]), int(grid["tuning_sets"]),
                                        seed=int(grid.get("seed", 0)))
    index = int(grid["tuning_set"])
    if not 0 <= index < len(tuning):
        raise ValueError(f"tuning_set: {index} is not one of the {len(tuning)} declared tuning sets")
    chosen = tuning[index]
    ids = set(chosen.ids)
    for fs in reported:  # draw_forget_sets promises it; a change there must not let a reported set in
        if ids & set(fs.ids) or (chosen.label is not None and chosen.label == fs.label):
            raise ValueError(f"tuning set {index} shares samples or its label with reported set {fs.index}")
    described = {**chosen.describe(), "reported_labels": [fs.label for fs in reported]}
    if scenario in ("identity", "class"):
        return {"scenario": "class", "classes": [int(chosen.label)]}, described
    return {"scenario": "ids", "sample_ids": list(chosen.ids)}, described


GRID_FIELDS = ("model_dir", "scenario", "reported_sets", "tuning_sets", "tuning_set", "method", "grid",
               "ulira_shadows", "ulira_controls")


def read_grid(path: Path, tuning_set: int | None = None) -> dict[str, Any]:
    """The grid file, its fields checked (``tuning_set`` given: that declared tuning set instead of the file's)."""
    from pipeline.config import load_yaml

    grid = dict(load_yaml(path, "U-LiRA tuning grid"))
    missing = [key for key in GRID_FIELDS if key not in grid]
    if missing:
        raise ValueError(f"missing field '{missing[0]}'")
    if not isinstance(grid["grid"], list) or not grid["grid"]:
        raise ValueError("grid: a list of at least one point (settings on top of base)")
    if tuning_set is not None:
        grid["tuning_set"] = tuning_set
    return grid


def point_settings(grid: dict[str, Any], i: int) -> dict[str, Any]:
    """The i-th point's settings: the grid's base with the point on top."""
    return {**dict(grid.get("base") or {}), **dict(grid["grid"][i])}


def grid_configs(grid: dict[str, Any], forget: dict[str, Any], cache_dir: str) -> list[Any]:
    """One evaluation config per point (base + point), all built, and so checked as the method's settings, before
    any is run: a point no removal can take fails here, named, not after the points before it ran."""
    from pipeline.evaluate.protocol import EvalConfig

    configs = []
    for i, point in enumerate(grid["grid"]):
        settings = point_settings(grid, i)
        try:
            configs.append(EvalConfig(model_dir=grid["model_dir"], forget=forget, methods={grid["method"]: settings},
                                      baselines=["retrain"], ulira_shadows=int(grid["ulira_shadows"]),
                                      ulira_controls=int(grid["ulira_controls"]), residual_gradient=False,
                                      cache_dir=cache_dir, out=None))
        except ValueError as err:
            raise ValueError(f"grid[{i}] ({point}) is not valid settings of {grid['method']}: {err}") from None
    return configs


def main(argv: list[str] | None = None) -> int:
    from pipeline.evaluate.protocol import evaluate
    from pipeline.models.card import load_model_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", type=Path, default=None, help="the grid file (configs/evaluate/tuning/...)")
    parser.add_argument("--combine", type=Path, action="append", default=[],
                        help="instead of playing: choose over earlier results of one grid on other tuning sets "
                             "(repeat it; --out writes the choice)")
    parser.add_argument("--cache-dir", default="runs/cache/baselines", help="the shadow models' cache")
    parser.add_argument("--tuning-set", type=int, default=None, help="play this declared tuning set instead of the "
                                                                     "file's tuning_set")
    parser.add_argument("--out", type=Path, default=None, help="the JSON (default: bench/results/eval/<grid>.json)")
    args = parser.parse_args(argv)
    if args.combine:
        import json

        try:
            chosen = combine([json.loads(p.read_text()) for p in args.combine], [str(p) for p in args.combine])
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"--combine: {err}", file=sys.stderr)
            return 1
        for i, p in enumerate(chosen["points"]):
            print(f"{'*' if i == chosen['chosen'] else ' '} {p['settings']}: worst {p['worst_per_set']}, mean {p['worst']}")
        if args.out is not None:
            write_json(args.out, chosen)
            print(f"wrote {args.out}")
        return 0
    if args.grid is None:
        parser.error("--grid is needed (or --combine)")
    try:
        grid = read_grid(args.grid, args.tuning_set)
        _, _, card = load_model_dir(grid["model_dir"])
        forget, described = tuning_set(grid, card)
        configs = grid_configs(grid, forget, args.cache_dir)
    except (OSError, ValueError) as err:   # pydantic's ValidationError is a ValueError
        print(f"{args.grid}: {err}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    points: list[dict[str, Any]] = []
    originals: dict[str, Any] | None = None  # the untouched originals on the controls: the same at every point
    for i, config in enumerate(configs):
        settings, point = point_settings(grid, i), grid["grid"][i]
        print(f"[{i + 1}/{len(grid['grid'])}] {grid['method']} {settings}", file=sys.stderr, flush=True)
        result = evaluate(config)
        ulira, row = result["ulira"], result["rows"].get(grid["method"], {})
        entry = {"point": point, "settings": settings, "worst": worst_reading(ulira, grid["method"]),
                 "on_U": ulira["rows"].get(grid["method"]),
                 "controls": {key: control_rows(ulira, key) for key in CONTROL_SETS},
                 "metrics": {k: row.get(k) for k in ("AvgGap", "KL_forget_vs_retrain", "TA", "RA", "rank1", "mAP",
                                                     "seconds")},
                 "scope": (result.get("method_records", {}).get(grid["method"]) or {}).get("scope"),
                 "error": result.get("method_errors", {}).get(grid["method"]),
                 "needs_retrain": result.get("needs_retrain", {}).get(grid["method"])}
        points.append(entry)
        originals = {key: control_rows(ulira, key).get("original") for key in CONTROL_SETS}
        worst = entry["worst"]
        on_u = (entry["on_U"] or {}).get("accuracy")
        print(f"  on U {on_u if on_u is None else round(on_u, 1)}, worst {worst if worst is None else round(worst, 1)}",
              file=sys.stderr, flush=True)
    best = choose(points)
    out = {"benchmark": "ulira_tuning", "grid_file": str(args.grid), "model_dir": grid["model_dir"],
           "method": grid["method"], "tuning_set": described, "ulira_shadows": grid["ulira_shadows"],
           "ulira_controls": grid["ulira_controls"],
           "criterion": "least max(U-LiRA on U, on the retained controls, on the test controls); ties: grid order",
           "points": points, "chosen": best, "chosen_settings": None if best is None else points[best]["settings"],
           "original_on_controls": originals,
           "wall_seconds": time.perf_counter() - started}
    path = args.out or ROOT / "bench" / "results" / "eval" / f"{args.grid.stem}.json"
    write_json(path, out)
    for i, p in enumerate(points):
        print(f"{'*' if i == best else ' '} {p['settings']}: worst {p['worst']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
