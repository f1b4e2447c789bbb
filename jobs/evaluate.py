"""``unlearn eval``: judge removal methods against Retrain on one forget set; JSON + PNG out.

The protocol itself (``EvalConfig``, ``evaluate``) is ``pipeline.evaluate.protocol``; this
module reads the YAML (``pipeline.config``), applies the command-line overrides and turns the
protocol's errors into a clear message and exit status 1.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from jobs.usererrors import user_errors
from pipeline.config import load_yaml, parse
from pipeline.evaluate.protocol import EvalConfig, evaluate


@click.command("eval")
@click.argument("model_dir", type=click.Path(file_okay=False, path_type=Path), required=False)
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="YAML with any EvalConfig fields; command-line options override it")
@click.option("--scenario", type=click.Choice(["random", "class", "ids"]), default=None)
@click.option("--fraction", type=float, default=None, help="random scenario: share of the training set")
@click.option("--count", type=int, default=None, help="random scenario: number of samples")
@click.option("--classes", type=str, default=None, help="class scenario: comma-separated labels, e.g. 3 or 1,4")
@click.option("--ids", type=str, default=None, help="ids scenario: comma-separated sample ids (forget.sample_ids)")
@click.option("--ids-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="ids scenario: a file of sample ids, one a line or CSV with sample_id first (forget.ids_file)")
@click.option("--method", "methods", multiple=True, help="removal method (repeatable); settings via --config")
@click.option("--lira-shadows", type=int, default=None, help="train this many shadow models for LiRA (even; 0 = off)")
@click.option("--ulira-shadows", type=int, default=None,
              help="U-LiRA distinguishing game with this many shadow pairs (an original on D and a Retrain on D_r "
                   "per seed; at least 3, 16 for a reading; 0 = off)")
@click.option("--pool-ulira", "pool", multiple=True, type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="pool the U-LiRA games of earlier results (JSON written by --out, each on its own forget set of one "
                   "model) per row instead of evaluating (repeat it for each file; --out writes the pooled game)")
@click.option("--ulira-controls", type=int, default=None,
              help="U-LiRA: also play the game on this many retained and this many test samples, which the removal "
                   "was not asked about (0 = off)")
@click.option("--seed", type=int, default=None)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="JSON result file")
@click.option("--plots", type=click.Path(file_okay=False, path_type=Path), default=None, help="folder for PNG plots")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@user_errors
def command(model_dir: Path | None, config_path: Path | None, scenario: str | None, fraction: float | None,
            count: int | None, classes: str | None, ids: str | None, ids_file: Path | None, methods: tuple[str, ...],
            lira_shadows: int | None, ulira_shadows: int | None, ulira_controls: int | None, pool: tuple[Path, ...],
            seed: int | None,
            out: Path | None, plots: Path | None, cache_dir: Path | None) -> None:
    """Evaluate removal methods on MODEL_DIR against Retrain and fine-tune (UA/RA/TA/MIA/Avg. Gap)."""
    if pool:
        return pool_results(pool, out)
    raw: dict[str, Any] = load_yaml(config_path, "evaluation config") if config_path else {}
    if model_dir is not None:
        raw["model_dir"] = str(model_dir)
    forget = dict(raw.get("forget") or {})
    for key, value in (("scenario", scenario), ("fraction", fraction), ("count", count), ("seed", seed)):
        if value is not None:
            forget[key] = value
    if classes:
        forget["classes"] = [int(c) for c in classes.split(",")]
    if ids and ids_file:
        raise click.UsageError("give --ids or --ids-file, not both")
    if ids or ids_file:   # the command line's set replaces the config's
        forget.pop("sample_ids", None)
        forget.pop("ids_file", None)
    if ids:
        forget["sample_ids"] = [int(i) for i in ids.split(",")]
    if ids_file:
        forget["ids_file"] = str(ids_file.resolve())
    if forget:
        raw["forget"] = forget
    raw = with_ids_file_read(raw, config_path.resolve().parent if config_path else Path.cwd())
    if methods:
        given = raw.get("methods") or {}
        raw["methods"] = {m: given.get(m, {}) for m in methods}
    for key, value in (("lira_shadows", lira_shadows), ("ulira_shadows", ulira_shadows),
                       ("ulira_controls", ulira_controls), ("seed", seed), ("out", out),
                       ("plots", plots), ("cache_dir", cache_dir)):
        if value is not None:
            raw[key] = str(value) if isinstance(value, Path) else value
    config = parse(EvalConfig, raw, f"evaluation config {config_path or '(command line)'}")
    result = evaluate(config)
    click.echo(result["table"])
    for line in ulira_lines(result.get("ulira")):
        click.echo(line)
    for name, refused in result["needs_retrain"].items():
        click.echo(f"{name}: needs retrain (the method refused this removal): {refused['reason']}")
    if config.out:
        click.echo(f"wrote {config.out}")


def with_ids_file_read(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """An evaluation config's fields ``raw`` with ``forget.ids_file`` read into ``forget.sample_ids`` (the ids
    scenario), as `unlearn forget` reads its own: one id a line or CSV with sample_id first, a relative path from
    ``base`` (the config's folder). Errors name the field; ``raw`` itself is left as it was."""
    from jobs.forget import ForgetSet
    from pipeline.config import ConfigError

    forget = raw.get("forget")
    if not isinstance(forget, dict) or forget.get("ids_file") is None:
        return raw
    forget = dict(forget)
    if forget.get("sample_ids") is not None:
        raise ConfigError("forget: give forget.sample_ids or forget.ids_file, not both")
    if forget.setdefault("scenario", "ids") != "ids":
        raise ConfigError(f"forget.ids_file names the samples of the ids scenario, not of forget.scenario "
                          f"'{forget['scenario']}': set forget.scenario to ids or drop forget.ids_file")
    forget["sample_ids"] = ForgetSet(ids_file=Path(forget.pop("ids_file"))).resolve(base)
    if not forget["sample_ids"]:
        raise ConfigError(f"forget.ids_file {raw['forget']['ids_file']} holds no sample id")
    return {**raw, "forget": forget}


def pool_results(files: tuple[Path, ...], out: Path | None) -> None:
    """``--pool-ulira``: the games of earlier results pooled per row, printed and written to ``out``."""
    import json

    from pipeline.evaluate.protocol import EvaluationError, pool_ulira_results
    from pipeline.jsonio import write_json

    results = []
    for path in files:
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            raise EvaluationError(f"--pool-ulira {path}: not a readable JSON result ({err})") from None
    pooled = pool_ulira_results(results, [str(p) for p in files])
    for line in ulira_lines(pooled):
        click.echo(line)
    if out is not None:
        write_json(out, pooled)
        click.echo(f"wrote {out}")


def ulira_lines(cell: dict[str, Any] | None) -> list[str]:
    """The U-LiRA game's result, a line per row: the attack's accuracy and its 95 % interval, or why not played."""
    if not cell:
        return []
    lines = [f"U-LiRA, {cell['shadows']} shadow pairs ({cell['note']}):"]
    for name, row in cell["rows"].items():
        if "accuracy" in row:
            low, high = row.get("ci95") or (float("nan"), float("nan"))
            lines.append(f"  {name}: {row['accuracy']:.1f} [{low:.1f}, {high:.1f}]"
                         + (f" over {row['examples']} examples of {len(row['per_set'])} sets" if "per_set" in row else ""))
        else:
            why = row.get("needs_retrain") or row.get("error")
            where = row.get("not_pooled") or f"shadow pair {row.get('shadow')}"
            lines.append(f"  {name}: no game ({where}" + (f": {why})" if why else ")"))
    for key, control in (cell.get("controls") or {}).items():
        played = {name: row for name, row in control["rows"].items() if "accuracy" in row}
        lines.append(f"  control, {len(control['sample_ids'])} {key} samples (not asked about): "
                     + ", ".join(f"{name} {row['accuracy']:.1f} [{row['ci95'][0]:.1f}, {row['ci95'][1]:.1f}]"
                                 for name, row in played.items()))
    return lines
