"""`unlearn receipt`: signed deletion receipts (one per applied request), their keys and their
verification. The receipt format, hashing and checks: pipeline/store/receipts.py.

Exit status of `verify`: 0 valid (and, with --store, still current), 3 rolled back, 4 invalid;
1 for a user error (unreadable key, missing store option value ...), 2 for a usage error."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import click

from jobs.usererrors import user_errors

EXIT_OK = 0
EXIT_ROLLED_BACK = 3
EXIT_INVALID = 4

store_option = click.option("--store", required=True, type=click.Path(file_okay=False),
                            help="Folder of the version store.")
model_option = click.option("--model", "model", required=True, help="Model name in the store.")
ledger_option = click.option("--ledger", "ledger_path", default=None, type=click.Path(dir_okay=False),
                             help="Ledger file (default: <store>/ledger.sqlite3).")


def _open(store: str, ledger_path: str | None):
    from jobs.specs import LEDGER_FILE
    from pipeline.store.ledger import Ledger
    from pipeline.store.versions import VersionStore

    vs = VersionStore(store)
    path = Path(ledger_path) if ledger_path else Path(store) / LEDGER_FILE
    return vs, Ledger(path, create=False)


def _issue(store: str, model: str, request_id: str, ledger_path: str | None) -> dict:
    from pipeline.store import receipts

    key = receipts.signing_key_from_env()  # before anything is read: a missing key names the variable
    vs, ledger = _open(store, ledger_path)
    try:
        return receipts.issue(vs, ledger, model, request_id, key)
    finally:
        ledger.close()


@click.group("receipt")
def command() -> None:
    """Signed deletion receipts: request -> removed samples (salted hashes) -> versions before and
    after (manifest sha256) -> method, settings, guarantee -> checks, signed with Ed25519.

    The signing key comes from UNLEARN_RECEIPT_KEY (the 32-byte Ed25519 seed, hex) or
    UNLEARN_RECEIPT_KEY_FILE (a PEM PKCS#8 key file; `unlearn receipt keygen` writes one)."""


@command.command("show")
@store_option
@model_option
@click.option("--request-id", "request_id", required=True, help="The applied request.")
@ledger_option
@user_errors
def show(store: str, model: str, request_id: str, ledger_path: str | None) -> None:
    """Print the signed receipt of one applied request (JSON)."""
    from pipeline.store.receipts import dumps

    click.echo(dumps(_issue(store, model, request_id, ledger_path)), nl=False)


def _write_folder(out: Path, files: dict[str, str]) -> None:
    """Write every file into a new folder that appears whole (built beside it, then renamed)."""
    from pipeline.checkpoint import fsync_path
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise click.ClickException(f"{out} exists and is not an empty folder; name a new folder for the receipts")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, text in files.items():
            with open(staging / name, "w") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(staging, 0o755)
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_path(out.parent)


@command.command("export")
@store_option
@model_option
@click.option("--request-id", "request_id", default=None, help="One applied request (or --all).")
@click.option("--all", "all_", is_flag=True, help="Every applied request of the model, one file each in --out.")
@click.option("--out", required=True, type=click.Path(), help="Receipt file (one request) or a new folder (--all).")
@click.option("--force", is_flag=True, help="Replace an existing receipt file (one request).")
@ledger_option
@user_errors
def export(store: str, model: str, request_id: str | None, all_: bool, out: str, force: bool, ledger_path: str | None) -> None:
    """Write the signed receipt of one applied request to a file, or with --all every applied
    request's receipt (<request_id>.receipt.json) into a new folder. Written atomically; nothing
    is written when any receipt cannot be issued."""
    from pipeline.checkpoint import atomic_write_bytes
    from pipeline.store import receipts

    if bool(request_id) == all_:
        raise click.UsageError("give either --request-id R or --all")
    target = Path(out)
    if request_id:
        if target.is_dir():
            raise click.ClickException(f"{target} is a folder; name the receipt file to write")
        if target.exists() and not force:
            raise click.ClickException(f"{target} exists; use --force to replace it")
        receipt = _issue(store, model, request_id, ledger_path)
        atomic_write_bytes(target, receipts.dumps(receipt).encode())
        click.echo(f"wrote the receipt of request '{request_id}' (v{receipt['body']['version_before']['version']} -> "
                   f"v{receipt['body']['version_after']['version']}) to {target}")
        return
    key = receipts.signing_key_from_env()
    vs, ledger = _open(store, ledger_path)
    try:
        vs.require_model(model)
        ids = receipts.applied_request_ids(ledger, model)
        files = {f"{rid}.receipt.json": receipts.dumps(receipts.issue(vs, ledger, model, rid, key)) for rid in ids}
    finally:
        ledger.close()
    _write_folder(target, files)
    click.echo(f"wrote {len(files)} receipt(s) of model '{model}' to {target}")


@command.command("verify")
@click.argument("receipt_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--public-key", "public_key", required=True, type=click.Path(exists=True, dir_okay=False),
              help="The signer's public key (PEM, or 64 hex characters).")
@click.option("--store", default=None, type=click.Path(file_okay=False),
              help="Also check the versions in this store (exist, unchanged, chain, still current).")
@click.option("--sample-id", "sample_ids", multiple=True, type=int,
              help="A data subject's check: this id must be among the removed samples (repeatable).")
@click.option("--subject", default=None, help="A data subject's check: the receipt must be about this subject.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@user_errors
def verify(receipt_file: str, public_key: str, store: str | None, sample_ids: tuple[int, ...], subject: str | None,
           as_json: bool) -> None:
    """Verify RECEIPT_FILE: the signature with the public key alone; with --store the versions.
    Exit 0 valid (and current), 3 rolled back, 4 invalid."""
    from pipeline.store import receipts
    from pipeline.store.receipts import ReceiptError, ReceiptStatus, VerifyResult

    key = receipts.load_public_key(Path(public_key).read_bytes(), f"--public-key {public_key}")
    try:
        receipt = receipts.read_receipt(receipt_file)
    except ReceiptError as err:
        result = VerifyResult(ReceiptStatus.INVALID, [], [str(err)])
    else:
        result = receipts.verify(receipt, key, store)
    if result.status is not ReceiptStatus.INVALID and (sample_ids or subject is not None):
        reasons, checked = list(result.reasons), list(result.checked)
        for sid, covered in receipts.covers_samples(receipt, sample_ids).items():
            (checked.append(f"sample id {sid}: its salted hash is among the removed samples") if covered else
             reasons.append(f"sample id {sid} is not among the removed samples of this receipt"))
        if subject is not None:
            (checked.append("subject: its salted hash matches") if receipts.covers_subject(receipt, subject) else
             reasons.append("the receipt is not about this subject (salted hash differs)"))
        missing = len(reasons) > len(result.reasons)
        result = VerifyResult(ReceiptStatus.INVALID if missing else result.status, checked, reasons)
    if as_json:
        click.echo(json.dumps({"receipt": receipt_file, **result.to_json()}, indent=2))
    else:
        for line in result.checked:
            click.echo(f"ok: {line}")
        for line in result.reasons:
            click.echo(f"{'ROLLED BACK' if result.status is ReceiptStatus.ROLLED_BACK else 'INVALID'}: {line}")
        click.echo(f"{receipt_file}: {result.status.value}" + ("" if store else " (signature only; no --store given)"))
    code = {ReceiptStatus.OK: EXIT_OK, ReceiptStatus.ROLLED_BACK: EXIT_ROLLED_BACK,
            ReceiptStatus.INVALID: EXIT_INVALID}[result.status]
    if code:
        raise click.exceptions.Exit(code)


@command.command("keygen")
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="Private key file to create (PEM PKCS#8, mode 0600; never overwritten).")
@user_errors
def keygen(out: str) -> None:
    """Create a new Ed25519 receipt signing key. Point UNLEARN_RECEIPT_KEY_FILE at it."""
    from pipeline.store import receipts

    key = receipts.generate_key_file(out)
    click.echo(f"wrote an Ed25519 private key to {out} (mode 0600); public key sha256 {receipts.fingerprint(key)}; "
               f"export UNLEARN_RECEIPT_KEY_FILE={Path(out).resolve()}")


@command.command("public-key")
@click.option("--format", "fmt", type=click.Choice(["pem", "hex"]), default="pem", show_default=True,
              help="PEM SubjectPublicKeyInfo, or the 32 raw bytes in hex.")
@click.option("--key-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Private key file (default: the configured UNLEARN_RECEIPT_KEY / UNLEARN_RECEIPT_KEY_FILE).")
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Write to this file (default: stdout).")
@user_errors
def public_key(fmt: str, key_file: str | None, out: str | None) -> None:
    """Print (or write) the public key that verifies the receipts signed with the configured key."""
    from pipeline.checkpoint import atomic_write_bytes
    from pipeline.store import receipts

    key = (receipts.private_key_from_text(Path(key_file).read_bytes(), f"--key-file {key_file}") if key_file
           else receipts.signing_key_from_env())
    text = receipts.public_key_text(key, fmt)
    if out:
        atomic_write_bytes(out, text.encode())
        click.echo(f"wrote the public key (sha256 {receipts.fingerprint(key)}) to {out}")
    else:
        click.echo(text, nl=False)


if __name__ == "__main__":
    command()
