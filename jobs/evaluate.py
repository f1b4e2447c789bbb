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
@click.option("--method", "methods", multiple=True, help="removal method (repeatable); settings via --config")
@click.option("--lira-shadows", type=int, default=None, help="train this many shadow models for LiRA (even; 0 = off)")
@click.option("--ulira-shadows", type=int, default=None,
              help="U-LiRA distinguishing game with this many shadow pairs (an original on D and a Retrain on D_r "
                   "per seed; at least 3, 16 for a reading; 0 = off)")
@click.option("--seed", type=int, default=None)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="JSON result file")
@click.option("--plots", type=click.Path(file_okay=False, path_type=Path), default=None, help="folder for PNG plots")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@user_errors
def command(model_dir: Path | None, config_path: Path | None, scenario: str | None, fraction: float | None,
            count: int | None, classes: str | None, ids: str | None, methods: tuple[str, ...],
            lira_shadows: int | None, ulira_shadows: int | None, seed: int | None, out: Path | None,
            plots: Path | None, cache_dir: Path | None) -> None:
    """Evaluate removal methods on MODEL_DIR against Retrain and fine-tune (UA/RA/TA/MIA/Avg. Gap)."""
    raw: dict[str, Any] = load_yaml(config_path, "evaluation config") if config_path else {}
    if model_dir is not None:
        raw["model_dir"] = str(model_dir)
    forget = dict(raw.get("forget") or {})
    for key, value in (("scenario", scenario), ("fraction", fraction), ("count", count), ("seed", seed)):
        if value is not None:
            forget[key] = value
    if classes:
        forget["classes"] = [int(c) for c in classes.split(",")]
    if ids:
        forget["sample_ids"] = [int(i) for i in ids.split(",")]
    if forget:
        raw["forget"] = forget
    if methods:
        given = raw.get("methods") or {}
        raw["methods"] = {m: given.get(m, {}) for m in methods}
    for key, value in (("lira_shadows", lira_shadows), ("ulira_shadows", ulira_shadows), ("seed", seed), ("out", out),
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


def ulira_lines(cell: dict[str, Any] | None) -> list[str]:
    """The U-LiRA game's result, a line per row: the attack's accuracy and its 95 % interval, or why not played."""
    if not cell:
        return []
    lines = [f"U-LiRA, {cell['shadows']} shadow pairs ({cell['note']}):"]
    for name, row in cell["rows"].items():
        if "accuracy" in row:
            low, high = row.get("ci95") or (float("nan"), float("nan"))
            lines.append(f"  {name}: {row['accuracy']:.1f} [{low:.1f}, {high:.1f}]")
        else:
            why = row.get("needs_retrain") or row.get("error")
            lines.append(f"  {name}: no game (shadow pair {row.get('shadow')}: {why})")
    return lines
