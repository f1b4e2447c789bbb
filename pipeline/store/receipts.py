"""Deletion receipts: one signed statement per applied request that anyone can check.

Unlearning cannot be verified from the weights alone; what can be audited is that a given
algorithm ran on given data and produced given versions. A receipt binds

    request -> removed sample ids (salted hashes) -> version before / after (manifest sha256)
            -> method, settings, guarantee -> verification checks

and is signed with Ed25519. Its JSON shape::

    {"body": {...}, "signature": "<hex, 64 bytes>", "public_key": "<hex, 32 raw bytes>"}

The signature is Ed25519 over the *canonical* JSON of ``body``: ``json.dumps(body,
sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)`` encoded as UTF-8
(``canonical_bytes``). The body is strict JSON (non-finite numbers are null), so any JSON
parser that keeps numbers as Python does can re-create those bytes.

Hashing, so that a data subject who knows their sample ids can check them and nobody else reads
them off the receipt (``sample_hash`` / ``subject_hash``; ``salt`` is hex, 32 fresh random bytes
per receipt)::

    sample hash  = SHA-256( bytes.fromhex(salt) || ASCII decimal of the sample id )   e.g. b"1234"
    subject hash = SHA-256( bytes.fromhex(salt) || b"subject:" || UTF-8 of the subject )

The removed samples' hashes are listed sorted (their order says nothing about the ids). The
subject (a name, an e-mail, an account: personal data) is never written in clear, only its
salted hash. Limitation: the salt is in the receipt, so a reader who guesses candidate ids can
test them (sample ids are usually small integers); the hashes stop casual reading and linking
receipts to each other (fresh salt each), not enumeration. Hand a receipt to its data subject
and auditors, not to the public, when the ids themselves are sensitive.

Never anything derived from the privacy noise: the body is built from whitelisted fields only
(the removal record is never copied; its ``noise_norm`` / ``step_norm`` and the like cannot
appear), and ``build_body`` refuses a body that holds any key in ``FORBIDDEN_KEYS``.

Keys (like the store's HMAC key): ``UNLEARN_RECEIPT_KEY`` holds the 32-byte Ed25519 private
seed as 64 hex characters, else ``UNLEARN_RECEIPT_KEY_FILE`` names a file holding a PEM PKCS#8
Ed25519 private key (what ``generate_key_file`` writes) or the hex seed. The public key's
fingerprint is the SHA-256 (hex) of its 32 raw bytes.

Verification (``verify``): offline, with the public key alone, the signature over the body
(tampering with any byte of the body or the signature fails); with a version store also that the
model and both versions exist, each manifest file still has the sha256 in the receipt and its
files their manifest's hashes, the after version's parent chain reaches the before version, and
the after version is still in the history (ancestors) of CURRENT. A version rolled back since is
``rolled_back``, a status of its own; anything else that does not hold is ``invalid``.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pipeline.checkpoint import fsync_path, sha256_of
from pipeline.jsonio import jsonable
from pipeline.models.card import CARD_FILE, WEIGHTS_FILE
from pipeline.store.ledger import Ledger
from pipeline.store.versions import MANIFEST_FILE, VersionStore, VersionStoreError

FORMAT = "unlearn-receipt/1"
KEY_ENV = "UNLEARN_RECEIPT_KEY"
KEY_FILE_ENV = "UNLEARN_RECEIPT_KEY_FILE"
SALT_BYTES = 32
SEED_BYTES = 32
HASHING = ("sample: sha256(bytes.fromhex(salt) + ascii(decimal sample id)); "
           "subject: sha256(bytes.fromhex(salt) + b'subject:' + utf8(subject)); hex digests, samples sorted")
BODY_KEYS = ("format", "issued_at", "request_id", "subject", "salt", "hashing", "removed_samples", "model",
             "version_before", "version_after", "batch", "method", "guarantee", "checks", "times", "signer")
# Keys of a removal record that come from the secret noise (or from the step it was added to):
# never in a receipt, at any depth.
FORBIDDEN_KEYS = frozenset({"noise_norm", "step_norm", "step_norm_outside_block", "noise", "noise_sample",
                            "noise_vector"})
# The verification results a receipt carries: the accuracy checks and the counts around them.
_CHECK_KEY = re.compile(r"^[a-z_]+_accuracy(_before|_drop)?$")
_CHECK_COUNTS = ("n_train", "n_removed_total", "batch_samples")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


class ReceiptError(ValueError):
    """A receipt cannot be built, signed or read as asked; the message says what to do."""


class ReceiptKeyError(ReceiptError):
    """The signing key is missing or malformed (names the variable to set)."""


class ReceiptRefused(ReceiptError):
    """The request has no receipt: it is not applied (or not in this ledger / model)."""


class ReceiptStatus(str, Enum):
    OK = "ok"                    # signature valid; with a store, both versions intact and after still current
    ROLLED_BACK = "rolled_back"  # signature and hashes valid, but the after version was rolled back
    INVALID = "invalid"          # the signature, a hash, a version or the chain does not hold


@dataclass(frozen=True)
class VerifyResult:
    status: ReceiptStatus
    checked: list[str] = field(default_factory=list)   # what was checked and holds
    reasons: list[str] = field(default_factory=list)   # why it is not ok (empty when ok)

    @property
    def ok(self) -> bool:
        return self.status is ReceiptStatus.OK

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status.value, "checked": list(self.checked), "reasons": list(self.reasons)}


# -- canonical form and hashes -----------------------------------------------------------------
def canonical_bytes(body: Mapping[str, Any]) -> bytes:
    """The exact bytes the signature covers (see the module docstring)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("utf-8")


def _salt_bytes(salt: str) -> bytes:
    try:
        raw = bytes.fromhex(salt)
    except (TypeError, ValueError):
        raise ReceiptError(f"salt {salt!r} is not hex") from None
    if len(raw) < 16:
        raise ReceiptError(f"salt has {len(raw)} bytes; a receipt salt has at least 16")
    return raw


def sample_hash(salt: str, sample_id: int) -> str:
    """SHA-256(salt bytes || ASCII decimal of the id), hex: what a data subject recomputes."""
    if isinstance(sample_id, bool) or not isinstance(sample_id, int):
        raise ReceiptError(f"sample id {sample_id!r} is not an integer")
    return hashlib.sha256(_salt_bytes(salt) + str(int(sample_id)).encode("ascii")).hexdigest()


def subject_hash(salt: str, subject: str) -> str:
    """SHA-256(salt bytes || b"subject:" || UTF-8 subject), hex (never equal to a sample hash:
    a sample id's decimal digits never start with "subject:")."""
    return hashlib.sha256(_salt_bytes(salt) + b"subject:" + subject.encode("utf-8")).hexdigest()


def covers_samples(receipt_or_body: Mapping[str, Any], sample_ids: Iterable[int]) -> dict[int, bool]:
    """For each id, whether its salted hash is among the receipt's removed samples (the data
    subject's check; it says nothing about the signature, see ``verify``)."""
    body = receipt_or_body.get("body", receipt_or_body)
    listed = set((body.get("removed_samples") or {}).get("salted_sha256") or [])
    return {int(i): sample_hash(body["salt"], int(i)) in listed for i in sample_ids}


def covers_subject(receipt_or_body: Mapping[str, Any], subject: str) -> bool:
    body = receipt_or_body.get("body", receipt_or_body)
    return subject_hash(body["salt"], subject) == (body.get("subject") or {}).get("salted_sha256")


# -- keys --------------------------------------------------------------------------------------
def public_key_raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def fingerprint(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """SHA-256 (hex) of the 32 raw public key bytes."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return hashlib.sha256(public_key_raw(public)).hexdigest()


def _seed_key(text: str, where: str) -> Ed25519PrivateKey:
    text = text.strip()
    if not _HEX64.fullmatch(text):
        shape = f"{len(text)} characters" if re.fullmatch(r"[0-9a-fA-F]*", text) else "characters that are not hex"
        raise ReceiptKeyError(
            f"{where} must be the 32-byte Ed25519 private seed as 64 hex characters (or, for {KEY_FILE_ENV}, a PEM "
            f"PKCS#8 private key); it has {shape}. Create a key with `unlearn receipt keygen --out FILE` and set "
            f"{KEY_FILE_ENV}=FILE")
    return Ed25519PrivateKey.from_private_bytes(bytes.fromhex(text))


def private_key_from_text(data: bytes, where: str) -> Ed25519PrivateKey:
    """A PEM PKCS#8 Ed25519 private key, or the 64-hex-character seed."""
    if data.lstrip().startswith(b"-----BEGIN"):
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as err:
            raise ReceiptKeyError(f"{where} is not a readable unencrypted PEM PKCS#8 private key ({err}); create one "
                                  "with `unlearn receipt keygen --out FILE`") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ReceiptKeyError(f"{where} holds a {type(key).__name__.lstrip('_')}, not an Ed25519 private key; "
                                  "create one with `unlearn receipt keygen --out FILE`")
        return key
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        text = "\x00"  # not hex: reported as such below
    return _seed_key(text, where)


def signing_key_from_env(environ: Mapping[str, str] | None = None) -> Ed25519PrivateKey:
    """UNLEARN_RECEIPT_KEY (hex seed), else the file UNLEARN_RECEIPT_KEY_FILE names."""
    env = os.environ if environ is None else environ
    raw = env.get(KEY_ENV)
    if raw:
        return _seed_key(raw, KEY_ENV)
    path_text = env.get(KEY_FILE_ENV)
    if path_text:
        path = Path(path_text)
        if not path.is_file():
            raise ReceiptKeyError(f"{KEY_FILE_ENV} names {path}, which is not a file; point it at the receipt key "
                                  "file (`unlearn receipt keygen --out FILE` creates one)")
        return private_key_from_text(path.read_bytes(), f"{KEY_FILE_ENV} ({path})")
    raise ReceiptKeyError(
        f"no receipt signing key: set {KEY_ENV} to the 32-byte Ed25519 seed in hex, or {KEY_FILE_ENV} to a key file "
        "(`unlearn receipt keygen --out FILE` creates one)")


def load_public_key(data: bytes | str | Ed25519PublicKey, where: str = "the public key") -> Ed25519PublicKey:
    """A PEM SubjectPublicKeyInfo Ed25519 public key, or its 32 raw bytes as 64 hex characters."""
    if isinstance(data, Ed25519PublicKey):
        return data
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if raw.lstrip().startswith(b"-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(raw)
        except (ValueError, TypeError) as err:
            raise ReceiptError(f"{where} is not a readable PEM public key ({err})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ReceiptError(f"{where} is not an Ed25519 public key")
        return key
    text = raw.decode("ascii", errors="replace").strip()
    if not _HEX64.fullmatch(text):
        raise ReceiptError(f"{where} is neither a PEM Ed25519 public key nor 64 hex characters (32 raw bytes); "
                           "export it with `unlearn receipt public-key`")
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(text))


def public_key_text(key: Ed25519PublicKey | Ed25519PrivateKey, fmt: str = "pem") -> str:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    if fmt == "hex":
        return public_key_raw(public).hex() + "\n"
    if fmt == "pem":
        return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    raise ValueError(f"public key format must be 'pem' or 'hex', got {fmt!r}")


def generate_key_file(out: str | Path) -> Ed25519PrivateKey:
    """A new Ed25519 key written as unencrypted PEM PKCS#8 to ``out``, mode 0600; refuses an
    existing path (the file appears whole or not at all: a temporary file is linked into place)."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise ReceiptError(f"{out} already exists; a receipt key is never overwritten (the receipts it signed are "
                           "verified with its public key) - choose another path")
    if not out.parent.is_dir():
        raise ReceiptError(f"folder {out.parent} does not exist; create it first")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)  # mode 0600
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, out)  # atomic, and fails if ``out`` appeared meanwhile
        except FileExistsError:
            raise ReceiptError(f"{out} already exists; a receipt key is never overwritten - choose another path") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    fsync_path(out.parent)
    return key


# -- building ----------------------------------------------------------------------------------
def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _strip_forbidden(obj: Any) -> Any:
    """A copy without any key in FORBIDDEN_KEYS (or naming noise), at any depth."""
    if isinstance(obj, dict):
        return {k: _strip_forbidden(v) for k, v in obj.items()
                if k not in FORBIDDEN_KEYS and "noise" not in str(k).lower()}
    if isinstance(obj, list):
        return [_strip_forbidden(v) for v in obj]
    return obj


def _forbidden_paths(obj: Any, path: str = "body") -> list[str]:
    if isinstance(obj, dict):
        out = [f"{path}.{k}" for k in obj if k in FORBIDDEN_KEYS]
        for k, v in obj.items():
            out += _forbidden_paths(v, f"{path}.{k}")
        return out
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _forbidden_paths(v, f"{path}[{i}]")]
    return []


def _checks(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    """The manifest's verification metrics, whitelisted: accuracies (after, before, drop) and counts."""
    out: dict[str, Any] = {}
    for key, value in (metrics or {}).items():
        if (_CHECK_KEY.fullmatch(key) or key in _CHECK_COUNTS) and (value is None or isinstance(value, (int, float))):
            out[key] = value
    return out


def _guarantee(privacy: Mapping[str, Any] | None) -> dict[str, Any]:
    privacy = privacy or {}
    release = privacy.get("release") or {}
    spent = privacy.get("spent_after") or {}
    return {
        "kind": release.get("guarantee", privacy.get("guarantee")),
        "mechanism": release.get("mechanism"),
        "epsilon": release.get("epsilon"),
        "delta": release.get("delta"),
        "calibration": release.get("calibration"),
        "reasons": [str(r) for r in release.get("reasons") or []],
        "composed_after": {"epsilon": spent.get("epsilon"), "delta": spent.get("delta")},
    }


def _version_entry(store: VersionStore, model: str, version: int) -> dict[str, Any]:
    manifest = store.manifest(model, version)
    files = manifest.get("files") or {}
    return {
        "version": version,
        "manifest_sha256": sha256_of(store.version_dir(model, version) / MANIFEST_FILE),
        "weights_sha256": files.get(WEIGHTS_FILE),
        "card_sha256": files.get(CARD_FILE),
        "kind": manifest.get("kind"),
        "parent": manifest.get("parent"),
    }


def build_body(store: VersionStore, ledger: Ledger, model: str, request_id: str, *, signer_fingerprint: str,
               salt: str | None = None, issued_at: str | None = None) -> dict[str, Any]:
    """The receipt body of one applied request (unsigned). Refuses (``ReceiptRefused``) a request
    that is not in the ledger, of another model, or not applied; refuses a version that does not
    verify, whose manifest disagrees with the ledger, or that is no longer in CURRENT's history."""
    row = ledger.get_request(request_id)
    if row is None:
        raise ReceiptRefused(f"request '{request_id}' is not in the ledger {ledger.path}; no receipt")
    if row.model != model:
        raise ReceiptRefused(f"request '{request_id}' is a request of model '{row.model}', not '{model}'; no receipt")
    if row.state != "applied":
        why = f" ({row.error})" if row.error else ""
        raise ReceiptRefused(f"request '{request_id}' is {row.state}{why}, not applied: only an applied request has "
                             "a receipt; nothing was written")
    batch = ledger.get_batch(row.batch_key) if row.batch_key else None
    if batch is None or batch.state != "applied" or batch.version != row.version or row.version is None:
        raise ReceiptError(f"request '{request_id}' is applied but its batch '{row.batch_key}' is not applied at version "
                           f"{row.version} in {ledger.path}; the ledger is inconsistent - no receipt")
    after, before = int(row.version), int(batch.parent_version)
    store.require_model(model)
    for v in (before, after):
        store.verify(model, v)  # refuses a version whose files, seal or parent chain changed
    manifest = store.manifest(model, after)
    meta = manifest.get("batch") or {}
    if (manifest.get("parent") != before or request_id not in (meta.get("request_ids") or [])
            or not set(row.sample_ids) <= set(meta.get("sample_ids") or [])):
        raise ReceiptError(f"version {after} of '{model}' does not record request '{request_id}' and its samples on "
                           f"parent {before} as the ledger does; no receipt")
    current = store.current(model)
    if after not in store.ancestors(model, current):
        raise ReceiptRefused(f"request '{request_id}': version {after} is no longer in the history of CURRENT "
                             f"(current {current}); finish the rollback with `unlearn versions rollback` - no receipt")
    salt = salt or secrets.token_bytes(SALT_BYTES).hex()
    record = manifest.get("record") or {}
    preparation = record.get("preparation") if isinstance(record, dict) else None
    body = jsonable({
        "format": FORMAT,
        "issued_at": issued_at or _now(),
        "request_id": request_id,
        "subject": {"salted_sha256": subject_hash(salt, row.subject)},
        "salt": salt,
        "hashing": HASHING,
        "removed_samples": {"count": len(row.sample_ids),
                            "salted_sha256": sorted(sample_hash(salt, int(i)) for i in row.sample_ids)},
        "model": model,
        "version_before": _version_entry(store, model, before),
        "version_after": _version_entry(store, model, after),
        "batch": {"key": batch.batch_key, "seed": batch.seed, "requests": len(batch.request_ids),
                  "samples": len(batch.sample_ids)},
        "method": {"name": manifest.get("method"), "settings": manifest.get("settings"),
                   "preparation": _strip_forbidden(preparation) if preparation is not None else None},
        "guarantee": _guarantee(manifest.get("privacy")),
        "checks": _checks(manifest.get("metrics")),
        "times": {"received_at": row.received_at, "published_at": manifest.get("created_at"),
                  "applied_at": row.updated_at},
        "signer": {"algorithm": "Ed25519", "public_key_sha256": signer_fingerprint},
    })
    leaked = _forbidden_paths(body)
    if leaked:  # unreachable with the whitelist above; a guard against a later edit
        raise ReceiptError(f"refusing to issue a receipt holding noise-derived fields: {leaked}")
    return body


def sign(body: Mapping[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    """The receipt: body, Ed25519 signature over its canonical bytes (hex), public key (raw hex)."""
    return {"body": dict(body), "signature": key.sign(canonical_bytes(body)).hex(),
            "public_key": public_key_raw(key.public_key()).hex()}


def issue(store: VersionStore, ledger: Ledger, model: str, request_id: str, key: Ed25519PrivateKey, *,
          salt: str | None = None) -> dict[str, Any]:
    """Build and sign the receipt of one applied request."""
    return sign(build_body(store, ledger, model, request_id, signer_fingerprint=fingerprint(key), salt=salt), key)


def applied_request_ids(ledger: Ledger, model: str) -> list[str]:
    return [r.request_id for r in ledger.requests(model=model, state="applied")]


def dumps(receipt: Mapping[str, Any]) -> str:
    """The receipt as a file (indented; the signature covers the canonical body, not this text)."""
    return json.dumps(receipt, indent=2, sort_keys=True, allow_nan=False) + "\n"


# -- verifying ---------------------------------------------------------------------------------
def _invalid(checked: list[str], *reasons: str) -> VerifyResult:
    return VerifyResult(ReceiptStatus.INVALID, checked, list(reasons))


def verify(receipt: Any, public_key: bytes | str | Ed25519PublicKey, store: VersionStore | str | Path | None = None) -> VerifyResult:
    """Check a receipt against a trusted public key (offline), and against a store when given.
    Never raises for a bad receipt: returns ``invalid`` with the reasons."""
    key = load_public_key(public_key)
    checked: list[str] = []
    if not isinstance(receipt, dict) or set(receipt) != {"body", "signature", "public_key"} \
            or not isinstance(receipt.get("body"), dict):
        return _invalid(checked, "not a receipt: expected a JSON object with exactly 'body', 'signature' and 'public_key'")
    body, signature = receipt["body"], receipt["signature"]
    try:
        message = canonical_bytes(body)
    except ValueError as err:
        return _invalid(checked, f"the body is not strict JSON ({err})")
    try:
        sig = bytes.fromhex(signature) if isinstance(signature, str) else b""
    except ValueError:
        sig = b""
    try:
        key.verify(sig, message)
    except InvalidSignature:
        reasons = ["the Ed25519 signature does not verify with the given public key (sha256 "
                   f"{fingerprint(key)[:16]}...): the body or the signature was changed, or another key signed it"]
        if receipt.get("public_key") != public_key_raw(key).hex():
            reasons.append("the receipt names another public key than the one given")
        return _invalid(checked, *reasons)
    checked.append(f"signature: Ed25519 over the canonical body, public key sha256 {fingerprint(key)}")
    problems: list[str] = []
    if receipt.get("public_key") != public_key_raw(key).hex():
        problems.append("the receipt's public_key field is not the key that signed it")
    if body.get("format") != FORMAT:
        problems.append(f"format is {body.get('format')!r}, not {FORMAT!r}")
    if (body.get("signer") or {}).get("public_key_sha256") != fingerprint(key):
        problems.append("the body's signer fingerprint is not the signing key's")
    missing = [k for k in BODY_KEYS if k not in body]
    if missing:
        problems.append(f"the body lacks {missing}")
    if problems:
        return _invalid(checked, *problems)
    checked.append(f"format {FORMAT}; signer fingerprint matches")
    if store is None:
        return VerifyResult(ReceiptStatus.OK, checked, [])
    return _verify_in_store(body, store if isinstance(store, VersionStore) else None, store, checked)


def _verify_in_store(body: dict[str, Any], opened: VersionStore | None, where: Any, checked: list[str]) -> VerifyResult:
    model = body["model"]
    try:
        store = opened or VersionStore(where)
        store.require_model(model)
    except VersionStoreError as err:
        return _invalid(checked, f"store: {err}")
    checked.append(f"store {store.root}: model '{model}' exists")
    problems: list[str] = []
    entries = {"before": body.get("version_before") or {}, "after": body.get("version_after") or {}}
    present = set(store.versions(model))
    for name, entry in entries.items():
        v = entry.get("version")
        if not isinstance(v, int) or v not in present:
            problems.append(f"version {v} ({name}) of '{model}' is missing from the store")
            continue
        actual = sha256_of(store.version_dir(model, v) / MANIFEST_FILE)
        if actual != entry.get("manifest_sha256"):
            problems.append(f"version {v} ({name}): its manifest has sha256 {actual[:16]}... but the receipt says "
                            f"{str(entry.get('manifest_sha256'))[:16]}...; the manifest changed after the receipt was issued")
            continue
        try:
            info = store.verify(model, v)
        except VersionStoreError as err:
            problems.append(f"version {v} ({name}): {err}")
            continue
        if (info.manifest.get("files") or {}).get(WEIGHTS_FILE) != entry.get("weights_sha256"):
            problems.append(f"version {v} ({name}): the weights' sha256 differs from the receipt's")
            continue
        checked.append(f"version {v} ({name}): manifest sha256 matches, " + (
            "its files were pruned (its manifest, with the weights' sha256, is kept)" if info.pruned
            else "weights and card match the manifest"))
    if problems:
        return _invalid(checked, *problems)
    before, after = entries["before"]["version"], entries["after"]["version"]
    try:
        chain = store.ancestors(model, after)
        current = store.current(model)
        alive = store.ancestors(model, current)
    except VersionStoreError as err:
        return _invalid(checked, f"store: {err}")
    if before not in chain:
        return _invalid(checked, f"version {before} is not an ancestor of version {after} (chain {chain})")
    checked.append(f"version {after}'s parent chain reaches version {before}")
    if after not in alive:
        return VerifyResult(ReceiptStatus.ROLLED_BACK, checked,
                            [f"rolled back: version {after} is no longer in the history of CURRENT (current {current})"])
    checked.append(f"version {after} is in the history of CURRENT (current {current})")
    return VerifyResult(ReceiptStatus.OK, checked, [])


def read_receipt(path: str | Path) -> Any:
    """The parsed receipt file (any JSON; ``verify`` judges its shape). Raises ``ReceiptError``
    for a file that is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (UnicodeDecodeError, ValueError) as err:
        raise ReceiptError(f"{path} is not a JSON receipt ({err})") from None
