"""`unlearn versions`: import, list, show, verify, roll back and prune model versions, and drop old versions'
copies of the recorded training run."""
from __future__ import annotations

import json
from pathlib import Path

import click

from jobs.usererrors import user_errors

store_option = click.option("--store", required=True, type=click.Path(file_okay=False),
                            help="Folder of the version store.")
model_option = click.option("--model", "model", required=True, help="Model name in the store.")


def _store(store: str, create: bool = False):
    from pipeline.store.versions import VersionStore

    return VersionStore(store, create=create)


@click.group("versions")
def command() -> None:
    """Model versions: every removal publishes a new verified version (safetensors + manifest)."""


@command.command("import")
@store_option
@model_option
@click.argument("model_dir", type=click.Path(file_okay=False))
@click.option("--note", default=None, help="Free text recorded with version 0.")
@click.option("--with-recorded-run", is_flag=True,
              help="MODEL_DIR is a later version that refers to its original's recorded training run: copy that run "
                   "into version 0 (it holds the original's weights until a removal and a prune follow).")
@user_errors
def import_(store: str, model: str, model_dir: str, note: str | None, with_recorded_run: bool) -> None:
    """Import MODEL_DIR (model.safetensors + model.json) as version 0 of a new model. A directory `unlearn train`
    wrote brings its recorded training run; a later version's reference to its original's run is dropped unless
    --with-recorded-run (then trajectory-refit and the emptied-class replay go without it)."""
    from pipeline.models.card import load_model_dir

    if not Path(model_dir).is_dir():
        raise click.ClickException(f"model directory {model_dir} does not exist")
    load_model_dir(model_dir)  # a directory whose weights do not fit its card is refused before anything is written
    vs = _store(store, create=True)
    vs.model_dir(model)  # validates the name
    with vs.lock(model, create=True):
        info = vs.import_model_dir(model, model_dir, note=note, with_recorded_run=with_recorded_run)
    from pipeline.trajectory import TRAJECTORY_FILE, TRAJECTORY_REFERENCE
    from pipeline.models.card import read_card

    dropped = TRAJECTORY_REFERENCE in read_card(model_dir).training.extra and not (info.path / TRAJECTORY_FILE).exists()
    click.echo(f"imported {model_dir} as version {info.version} of '{model}' in {vs.root}"
               + ("; without the recorded training run its card referred to (--with-recorded-run brings it)"
                  if dropped else ""))


@command.command("list")
@store_option
@model_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors
def list_(store: str, model: str, as_json: bool) -> None:
    """List the versions of a model (the current one is marked *)."""
    vs = _store(store)
    current = vs.current(model)
    rows = [vs.info(model, v).summary(current) for v in vs.versions(model)]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        mark = "*" if r["current"] else " "
        click.echo(f"{mark} v{r['version']:<5} parent={r['parent']!s:<5} {r['kind']:<8} {r['created_at']}  "
                   f"requests={r['requests']:<4} method={r['method'] or '-'} epsilon={r['epsilon']} "
                   f"epsilon_total={r['epsilon_total']}" + ("  (pruned)" if r["pruned"] else ""))


@command.command("show")
@store_option
@model_option
@click.argument("version", type=int, required=False)
@user_errors
def show(store: str, model: str, version: int | None) -> None:
    """Print the manifest of VERSION (default: the current version)."""
    vs = _store(store)
    click.echo(json.dumps(vs.manifest(model, vs.current(model) if version is None else version), indent=2))


@command.command("verify")
@store_option
@model_option
@click.argument("version", type=int, required=False)
@user_errors
def verify(store: str, model: str, version: int | None) -> None:
    """Check the sha256 of every file of VERSION (default: all versions); exit 1 on any mismatch."""
    vs = _store(store)
    vs.require_model(model)
    if version is not None:
        info = vs.verify(model, version)  # raises (exit 1) with the reason
        click.echo(f"v{version}: {'ok (pruned: its manifest only)' if info.pruned else 'ok'}")
        return
    results = vs.verify_all(model)
    bad = [(v, e) for v, e in results if e]
    for v, e in results:
        state = "ok (pruned: its manifest only)" if e is None and vs.info(model, v).pruned else "ok"
        bad_as = ("PRUNE INTERRUPTED: " if e is not None and "pruning was interrupted" in e else
                  "DROP INTERRUPTED: " if e is not None and "was interrupted; run `unlearn versions drop-run" in e
                  else "TAMPERED: ")
        click.echo(f"v{v}: {state if e is None else bad_as + e}")
    if bad:
        raise click.ClickException(f"{len(bad)} version(s) of '{model}' failed verification")


@command.command("rollback")
@store_option
@model_option
@click.argument("version", type=int)
@click.option("--reason", required=True, help="Why (recorded in the pointer history and the ledger).")
@click.option("--ledger", "ledger_path", default=None, type=click.Path(dir_okay=False),
              help="Ledger file (default: every ledger recorded for the model, and <store>/ledger.sqlite3).")
@user_errors
def rollback(store: str, model: str, version: int, reason: str, ledger_path: str | None) -> None:
    """Point the model's CURRENT at an older VERSION. Nothing is deleted; requests applied by the
    versions left behind move to needs_retrain in the ledger(s). Every ledger is opened and checked
    before CURRENT moves; naming the current version finishes a rollback that was interrupted."""
    from jobs.exactly_once import ledgers_for, rollback as roll_back

    vs = _store(store)
    vs.require_model(model)  # before the lock: an unknown model leaves nothing behind
    with vs.lock(model):
        paths = ledgers_for(vs, model, ledger_path)
        old, new, moved = roll_back(vs, model, version, reason, paths)
    where = ", ".join(str(p) for p in paths) or "no ledger"
    click.echo(f"'{model}': CURRENT moved from v{old} to v{new}; {len(moved)} request(s) now need_retrain ({where})")


@command.command("prune")
@store_option
@model_option
@click.option("--before", type=int, required=True,
              help="Prune every version numbered below this one (at most the current version, which is never pruned).")
@click.option("--reason", required=True, help="Why (recorded in each pruned version's tombstone).")
@click.option("--yes", is_flag=True, help="Delete: without it, only the versions that would be pruned are printed.")
@click.option("--include-damaged", is_flag=True,
              help="Prune versions that fail verification too (each tombstone records the error); by default a "
                   "damaged version stops the prune before anything is deleted.")
@user_errors
def prune(store: str, model: str, before: int, reason: str, yes: bool, include_damaged: bool) -> None:
    """Delete the weights, card and recorded training run of the versions older than --before. They hold the
    samples later versions removed (version 0 is the original model). Each keeps its manifest and a tombstone
    (sealed with the store key where the store has one), so the chain and the receipts still verify; they can no
    longer be loaded or rolled back to. Once version 0 is gone trajectory-refit refuses, the recorded-run variants of
    lfoci-newton use U's gradient at the trained weights instead and the emptied-class replay is skipped (each
    record says so). A version that fails verification stops the prune unless --include-damaged."""
    vs = _store(store)
    vs.require_model(model)
    if not yes:
        targets, damaged = vs.prune_plan(model, before)
        click.echo(f"would prune {targets or 'nothing'} of '{model}' (current v{vs.current(model)}); pass --yes to delete"
                   + (f"; {sorted(damaged)} fail verification (--include-damaged prunes them too)" if damaged else ""))
    else:
        with vs.lock(model):
            done = vs.prune(model, before, reason, include_damaged=include_damaged)
        click.echo(f"'{model}': pruned {done or 'nothing'}; their manifests and tombstones are kept")
    holding = [v for v in vs.holding_run(model) if not (v < before and not yes)]
    if holding:
        said = []
        if 0 in holding:
            said.append("v0, the imported model, is CURRENT: it goes once a later version is current and a prune runs "
                        "past it" if vs.current(model) == 0 else "v0 is the original: a prune --before past it deletes it")
        later = [v for v in holding if v > 0]
        if later:
            said.append(f"`unlearn versions drop-run-copies` deletes the copies of {later} (published before versions "
                        "referred to v0's run) and keeps the versions")
        click.echo(f"note: versions {holding} hold a copy of the recorded training run, whose last checkpoint is the "
                   "original's weights; " + "; ".join(said), err=True)


@command.command("drop-run-copies")
@store_option
@model_option
@click.option("--reason", required=True, help="Why (recorded with each version).")
@click.option("--yes", is_flag=True, help="Delete: without it, only the versions that would lose their copy are printed.")
@user_errors
def drop_run_copies(store: str, model: str, reason: str, yes: bool) -> None:
    """Delete the copy of the recorded training run (its last checkpoint is the original's weights) that versions
    after v0 hold, where they were published before versions referred to v0's run instead. Each keeps its manifest,
    weights and card, and gains a record (sealed with the store key where the store has one) of the file deleted and
    where the same run is still kept (v0), so it still verifies and loads, its receipts verify, and its removals read
    the run from v0. A version that fails verification stops it before anything is deleted."""
    vs = _store(store)
    vs.require_model(model)
    if not yes:
        from pipeline.trajectory import TRAJECTORY_FILE

        targets, damaged = vs.run_copies_plan(model)
        kept = vs.kept_run(model) if targets else None
        alone = [v for v in targets if vs.manifest(model, v)["files"].get(TRAJECTORY_FILE) != kept]
        click.echo(f"would drop the run copies of {targets or 'no version'} of '{model}'; pass --yes to delete"
                   + (f"; {sorted(damaged)} fail verification and would stop it" if damaged else "")
                   + (f"; v0 keeps no copy of the run {alone} hold: their removals would go without it" if alone else ""))
        return
    with vs.lock(model):
        done = vs.drop_run_copies(model, reason)
    click.echo(f"'{model}': dropped the run copies of {done or 'no version'}; each keeps a record of the file deleted")


if __name__ == "__main__":
    command()
