"""The model version store: every removal publishes a new, immutable version directory.

Layout under the store root::

    <model>/versions/000000/   model.safetensors, model.json (card), manifest.json
    <model>/versions/000001/   ...
    <model>/CURRENT            JSON pointer: current version, its manifest's sha256, history
    <model>/.lock              advisory lock held by the one process that writes this model
    <model>/.staging/          half-built versions (removed when the lock is next taken)
    <model>/LEDGERS            JSON list of the ledger files that recorded work on this model

With a key in ``UNLEARN_STORE_HMAC_KEY`` (or a file named by ``UNLEARN_STORE_HMAC_KEY_FILE``)
every manifest and ``CURRENT`` carry an HMAC-SHA256 over their content, and reading refuses
one whose seal is missing or wrong: a consistent rewrite of weights + manifest + CURRENT by
someone without the key is detected (without a key the hash chain only detects accidents).

A version is built in ``.staging``, every file fsynced, the manifest (sha256 of every file, the
parent version and the parent manifest's sha256) written last, then the directory is renamed
into ``versions/`` (atomic; it fails if the number is taken) and ``CURRENT`` is replaced
atomically. Loading a version verifies every hash, the file list and the chain to the parent;
any difference raises ``TamperedVersionError``. Rollback moves ``CURRENT`` to an older version
and records it; it deletes nothing.

Pruning (``prune``) is the one deletion: the versions older than a given one (CURRENT never) lose their
weights, card and recorded training run, which hold the samples later versions removed (version 0 is the
original). Each keeps its manifest (hashes, parent, batch, method, privacy: no weights) and gains a sealed
``PRUNED`` tombstone written before any file goes, so the chain and every receipt still verify, an interrupted
prune is finished by running it again, and a pruned version can be neither loaded nor rolled back to.

Versions published before removals referred to version 0's recorded training run hold a copy of it (its last
checkpoint is the original's weights). ``drop_run_copies`` deletes those copies from every later version, each after a
sealed ``trajectory.moved.json`` record that names the file, its hash and where the same run is still kept (version
0's copy, where it holds the same file), so the version still verifies and loads, and its removals read the run there.
"""
from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import re
import shutil
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping

from torch import Tensor

from pipeline.checkpoint import atomic_write_bytes, fsync_path, sha256_of
from pipeline.models.card import CARD_FILE, WEIGHTS_FILE, ModelCard, load_model_dir, read_card, write_model_dir
from pipeline.store.crashpoint import crash_point
from pipeline.trajectory import (
    TRAJECTORY_FILE, TRAJECTORY_MOVED, TRAJECTORY_REFERENCE, recorded_trajectory, refer_to_trajectory,
    without_trajectory_reference,
)

MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MANIFEST_FILE = "manifest.json"
POINTER_FILE = "CURRENT"
PRUNED_FILE = "PRUNED"
FORMAT = "unlearn-version/1"
LEDGERS_FILE = "LEDGERS"
HMAC_KEY_ENV = "UNLEARN_STORE_HMAC_KEY"
HMAC_KEY_FILE_ENV = "UNLEARN_STORE_HMAC_KEY_FILE"
SEAL_FIELD = "hmac"


def valid_model_name(name: object) -> bool:
    """1-64 letters, digits, '.', '_' or '-', starting with a letter or digit; the WHOLE string
    (``re.match`` with ``$`` would accept a trailing newline)."""
    return isinstance(name, str) and MODEL_NAME_PATTERN.fullmatch(name) is not None and not name.endswith("\n")


def hmac_key_from_env() -> bytes | None:
    """The store's sealing key: UNLEARN_STORE_HMAC_KEY, else the file UNLEARN_STORE_HMAC_KEY_FILE names."""
    raw = os.environ.get(HMAC_KEY_ENV)
    if raw:
        key = raw.encode()
    elif os.environ.get(HMAC_KEY_FILE_ENV):
        path = Path(os.environ[HMAC_KEY_FILE_ENV])
        if not path.is_file():
            raise VersionStoreError(f"{HMAC_KEY_FILE_ENV} names {path}, which is not a file; point it at the key file")
        key = path.read_bytes().strip()
    else:
        return None
    if len(key) < 16:
        raise VersionStoreError(f"the store HMAC key ({HMAC_KEY_ENV} / {HMAC_KEY_FILE_ENV}) is shorter than 16 bytes; use a long random key")
    return key


def _seal_of(obj: dict[str, Any], key: bytes) -> str:
    body = json.dumps({k: v for k, v in obj.items() if k != SEAL_FIELD}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


class VersionStoreError(RuntimeError):
    """The version store or a model in it cannot be used as asked."""


class TamperedVersionError(VersionStoreError):
    """A version's files do not match its manifest (or the manifest its parent chain)."""


class PrunedVersionError(VersionStoreError):
    """A version whose files were pruned: only its manifest (and tombstone) remain."""


class ModelBusyError(VersionStoreError):
    """Another process holds the model's write lock."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=2, sort_keys=True).encode()


@dataclass(frozen=True)
class VersionInfo:
    model: str
    version: int
    path: Path
    manifest: dict[str, Any]

    @property
    def parent(self) -> int | None:
        return self.manifest.get("parent")

    @property
    def batch_key(self) -> str | None:
        return (self.manifest.get("batch") or {}).get("key")

    @property
    def pruned(self) -> bool:
        """Whether its files were pruned (its tombstone exists; ``VersionStore.verify`` checks it)."""
        return (self.path / PRUNED_FILE).is_file()

    def summary(self, current: int | None = None) -> dict[str, Any]:
        m = self.manifest
        return {
            "version": self.version, "parent": self.parent, "current": self.version == current,
            "kind": m.get("kind"), "created_at": m.get("created_at"), "batch": self.batch_key,
            "requests": len((m.get("batch") or {}).get("request_ids", [])), "method": m.get("method"),
            "epsilon": ((m.get("privacy") or {}).get("release") or {}).get("epsilon"),
            "epsilon_total": ((m.get("privacy") or {}).get("spent_after") or {}).get("epsilon"),
            "pruned": self.pruned,
        }


class VersionStore:
    """Versions of named models under one root folder."""

    def __init__(self, root: str | Path, *, create: bool = False, hmac_key: bytes | None | bool = True) -> None:
        """``hmac_key``: True = from the environment (see the module docstring), None = unsealed."""
        self.hmac_key = hmac_key_from_env() if hmac_key is True else (hmac_key or None)
        self.root = Path(root)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise VersionStoreError(f"version store {self.root} does not exist; create it with `unlearn versions import`")
        self._held: dict[str, int] = {}
        self._guard = threading.Lock()

    # -- names and paths --------------------------------------------------------------------
    def model_dir(self, model: str) -> Path:
        if not valid_model_name(model):
            raise VersionStoreError(
                f"model name {model!r} is invalid: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return self.root / model

    def version_dir(self, model: str, version: int) -> Path:
        return self.model_dir(model) / "versions" / f"{int(version):06d}"

    def models(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if (p / POINTER_FILE).is_file())

    def versions(self, model: str) -> list[int]:
        folder = self.model_dir(model) / "versions"
        if not folder.is_dir():
            return []
        return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())

    def require_model(self, model: str) -> None:
        if not (self.model_dir(model) / POINTER_FILE).is_file():
            known = self.models()
            raise VersionStoreError(
                f"model '{model}' is not in the version store {self.root} (it has {known or 'no models'}); "
                "import it with `unlearn versions import`"
            )

    # -- reading -----------------------------------------------------------------------------
    def pointer(self, model: str) -> dict[str, Any]:
        self.require_model(model)
        path = self.model_dir(model) / POINTER_FILE
        try:
            data = json.loads(path.read_text())
            int(data["version"])
        except (ValueError, KeyError, TypeError) as err:
            raise TamperedVersionError(f"{path} is not a valid version pointer ({err}); restore it from a backup") from None
        self._check_seal(data, f"the pointer {path}")
        return data

    def _check_seal(self, obj: dict[str, Any], what: str) -> None:
        if self.hmac_key is None:
            return
        given = obj.get(SEAL_FIELD)
        if not isinstance(given, str) or not hmac.compare_digest(given, _seal_of(obj, self.hmac_key)):
            raise TamperedVersionError(
                f"{what}: its HMAC seal is {'missing' if given is None else 'wrong'} for the store key; it was written "
                "without the key or modified after publishing - roll back to a verified version or restore it"
            )

    def _sealed(self, obj: dict[str, Any]) -> dict[str, Any]:
        return {**obj, SEAL_FIELD: _seal_of(obj, self.hmac_key)} if self.hmac_key is not None else obj

    def current(self, model: str) -> int:
        return int(self.pointer(model)["version"])

    def manifest(self, model: str, version: int) -> dict[str, Any]:
        path = self.version_dir(model, version) / MANIFEST_FILE
        if not path.parent.is_dir():
            raise VersionStoreError(f"model '{model}' has no version {version} (versions: {self.versions(model)})")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise TamperedVersionError(f"version {version} of '{model}': manifest unreadable ({err})") from None
        if not isinstance(data, dict) or data.get("version") != version or data.get("model") != model:
            raise TamperedVersionError(f"version {version} of '{model}': the manifest names another model or version")
        return data

    def info(self, model: str, version: int) -> VersionInfo:
        return VersionInfo(model, version, self.version_dir(model, version), self.manifest(model, version))

    def verify(self, model: str, version: int) -> VersionInfo:
        """Check every file's sha256, the file list, and the chain to the parent manifest; of a pruned version,
        its sealed tombstone and that its files are gone (``VersionInfo.pruned``)."""
        info = self.info(model, version)
        self._check_seal(info.manifest, f"version {version} of '{model}': the manifest")
        files = info.manifest.get("files")
        if not isinstance(files, dict) or set(files) - {TRAJECTORY_FILE} != {WEIGHTS_FILE, CARD_FILE}:
            raise TamperedVersionError(f"version {version} of '{model}': the manifest's file list is damaged")
        present = {p.name for p in info.path.iterdir()}
        if info.pruned:
            self._check_tombstone(info, present)
            files, present = {}, present - {PRUNED_FILE}  # a pruned version is its manifest: the chain is still checked
        elif TRAJECTORY_MOVED in present:  # its copy of the recorded run deleted on purpose: the record checked
            self._check_run_moved(info, present)
            files, present = {k: v for k, v in files.items() if k != TRAJECTORY_FILE}, present - {TRAJECTORY_MOVED}
        unexpected = sorted(present - set(files) - {MANIFEST_FILE})
        missing = sorted(set(files) - present)
        if unexpected or missing:
            raise TamperedVersionError(
                f"version {version} of '{model}': files differ from the manifest (missing {missing}, unexpected {unexpected})"
            )
        for name, digest in files.items():
            actual = sha256_of(info.path / name)
            if actual != digest:
                raise TamperedVersionError(
                    f"version {version} of '{model}': {name} has sha256 {actual[:16]}... but the manifest says {digest[:16]}...; "
                    "the file was modified after publishing - roll back to a verified version or restore the file"
                )
        if info.parent is not None:
            parent_manifest = self.version_dir(model, info.parent) / MANIFEST_FILE
            if not parent_manifest.is_file() or sha256_of(parent_manifest) != info.manifest.get("parent_manifest_sha256"):
                raise TamperedVersionError(f"version {version} of '{model}': its parent version {info.parent}'s manifest changed")
        pointer = self.pointer(model)
        if int(pointer["version"]) == version and pointer.get("manifest_sha256") != sha256_of(info.path / MANIFEST_FILE):
            raise TamperedVersionError(f"version {version} of '{model}': the manifest differs from the one CURRENT points to")
        return info

    def verify_all(self, model: str) -> list[tuple[int, str | None]]:
        """(version, error message or None) for every version."""
        out: list[tuple[int, str | None]] = []
        for v in self.versions(model):
            try:
                self.verify(model, v)
                out.append((v, None))
            except VersionStoreError as err:
                out.append((v, str(err)))
        return out

    @staticmethod
    def _read_record(info: VersionInfo, name: str, kind: str, label: str, described: str) -> dict[str, Any]:
        """A record the store writes beside a version's files (``name``: a pruning tombstone, a dropped run's record):
        readable JSON of ``kind``, naming this model and version (its seal and the rest checked by the caller)."""
        where = f"version {info.version} of '{info.model}'"
        try:
            record = json.loads((info.path / name).read_text())
        except (OSError, ValueError) as err:
            raise TamperedVersionError(f"{where}: {label} is unreadable ({err})") from None
        if not isinstance(record, dict) or record.get("kind") != kind:
            raise TamperedVersionError(f"{where}: {name} is not {described} (kind '{kind}')")
        if record.get("model") != info.model or record.get("version") != info.version:
            raise TamperedVersionError(f"{where}: {label} names another model or version")
        return record

    def _check_tombstone(self, info: VersionInfo, present: set[str]) -> None:
        """A pruned version: its tombstone sealed and naming it; nothing of its files left (else the prune was
        interrupted, and running it again finishes it)."""
        where = f"version {info.version} of '{info.model}'"
        tomb = self._read_record(info, PRUNED_FILE, "pruned", "the pruning tombstone", "a pruning tombstone")
        if not set(tomb.get("deleted") or []) <= set(info.manifest.get("files") or {}):
            raise TamperedVersionError(f"{where}: the pruning tombstone lists files its manifest never had")
        self._check_seal(tomb, f"{where}: the pruning tombstone")
        if int(self.pointer(info.model)["version"]) == info.version:
            raise TamperedVersionError(f"{where}: the current version has a pruning tombstone, which prune never "
                                       "writes there; restore the version's files or roll back")
        left = sorted(present - {MANIFEST_FILE, PRUNED_FILE})
        if left:
            raise VersionStoreError(f"{where}: pruning was interrupted ({left} still there); run `unlearn versions "
                                    "prune` again to finish it")

    def _check_run_moved(self, info: VersionInfo, present: set[str]) -> None:
        """A version whose copy of the recorded run was deleted (``drop_run_copies``): the record sealed, naming it
        and the file its manifest hashed; the file gone (else the drop was interrupted: running it again finishes)."""
        where = f"version {info.version} of '{info.model}'"
        record = self._read_record(info, TRAJECTORY_MOVED, "run_dropped", "the dropped run's record",
                                   "a record of a dropped run")
        if info.version == 0:
            raise TamperedVersionError(f"{where}: the dropped run's record names another model or version (version 0 "
                                       "keeps its run: it is never dropped there)")
        digest = (info.manifest.get("files") or {}).get(TRAJECTORY_FILE)
        if not isinstance(digest, str) or record.get("sha256") != digest:
            raise TamperedVersionError(f"{where}: the dropped run's record names a file its manifest never had")
        if record.get("reference") not in (None, self._run_reference(info.model, info.version, digest)):
            raise TamperedVersionError(f"{where}: the dropped run's record refers to another file than version 0's "
                                       "copy of the same run")
        self._check_seal(record, f"{where}: the dropped run's record")
        if TRAJECTORY_FILE in present:
            raise VersionStoreError(f"{where}: dropping its copy of the recorded run was interrupted; run `unlearn "
                                    "versions drop-run-copies` again to finish it")

    def _run_reference(self, model: str, version: int, digest: str) -> dict[str, str]:
        """The reference a dropped copy's record gives: version 0's run, relative to ``version``'s folder."""
        return {"path": os.path.relpath(self.version_dir(model, 0) / TRAJECTORY_FILE, self.version_dir(model, version)),
                "sha256": digest}

    def kept_run(self, model: str) -> str | None:
        """The sha256 of version 0's copy of the recorded run where it holds one (not pruned), checked against its
        manifest (a mismatch raises: no copy is dropped in favour of a damaged one); None where it holds none."""
        zero = self.version_dir(model, 0)
        if 0 not in self.versions(model) or (zero / PRUNED_FILE).is_file() or not (zero / TRAJECTORY_FILE).is_file():
            return None
        listed = (self.manifest(model, 0).get("files") or {}).get(TRAJECTORY_FILE)
        if listed is None or sha256_of(zero / TRAJECTORY_FILE) != listed:
            raise TamperedVersionError(f"version 0 of '{model}': its copy of the recorded run is not the one its "
                                       "manifest hashed; restore it before dropping the other copies (nothing was "
                                       "deleted)")
        return listed

    def run_copies_plan(self, model: str) -> tuple[list[int], dict[int, str]]:
        """(the versions after version 0 that still hold a copy of the recorded run, or whose drop was interrupted;
        those of them that fail verification, with the error). Refuses a store whose manifests are sealed when no
        key is loaded (a record written then could never be verified)."""
        versions = [v for v in self.versions(model) if v > 0 and not (self.version_dir(model, v) / PRUNED_FILE).is_file()
                    and (self.version_dir(model, v) / TRAJECTORY_FILE).is_file()]
        if self.hmac_key is None and any(SEAL_FIELD in self.manifest(model, v) for v in versions):
            raise VersionStoreError(f"the manifests of '{model}' are sealed but no store key is loaded: a record "
                                    f"written now could never be verified; set {HMAC_KEY_ENV} (or {HMAC_KEY_FILE_ENV}) "
                                    "and run it again; nothing was deleted")
        damaged: dict[int, str] = {}
        for version in versions:
            if (self.version_dir(model, version) / TRAJECTORY_MOVED).is_file():
                continue  # interrupted: finished by the drop (its record is checked there)
            try:
                self.verify(model, version)
            except TamperedVersionError as err:
                damaged[version] = str(err)
        return versions, damaged

    def drop_run_copies(self, model: str, reason: str) -> list[int]:
        """Delete the copy of the recorded training run that versions after version 0 hold (published before
        removals referred to version 0's instead; its last checkpoint is the original's weights). For each, a sealed
        ``TRAJECTORY_MOVED`` record first: the file, its sha256 from the manifest, the reason and, where version 0
        holds the same file, a reference to it (``pipeline.trajectory.locate_trajectory`` reads it there), else
        none (the version's removals then go without the run, and their records say so). Every version is verified
        first; a damaged one stops it before anything is deleted. Returns the versions done by this call."""
        self._require_lock(model)
        if not reason or not reason.strip():
            raise VersionStoreError("dropping the run copies needs a reason (recorded with each version)")
        targets, damaged = self.run_copies_plan(model)
        if damaged:
            raise VersionStoreError(f"versions {sorted(damaged)} of '{model}' fail verification "
                                    f"({next(iter(damaged.values()))}); nothing was deleted. Restore their files or "
                                    "roll back, then run it again")
        kept = self.kept_run(model) if targets else None
        done: list[int] = []
        for version in targets:
            folder = self.version_dir(model, version)
            if (folder / TRAJECTORY_MOVED).is_file():  # interrupted: its record checked, then finished
                self._check_run_moved(self.info(model, version), {MANIFEST_FILE})
            else:
                digest = self.manifest(model, version)["files"][TRAJECTORY_FILE]
                reference = self._run_reference(model, version, digest) if kept == digest else None
                record = self._sealed({"kind": "run_dropped", "model": model, "version": version, "dropped_at": _now(),
                                       "reason": reason, "file": TRAJECTORY_FILE, "sha256": digest,
                                       "reference": reference})
                self._place(model, folder, TRAJECTORY_MOVED, _json_bytes(record))
            crash_point("drop_run_record")
            (folder / TRAJECTORY_FILE).unlink()
            fsync_path(folder)
            done.append(version)
        return done

    def _place(self, model: str, folder: Path, name: str, data: bytes) -> None:
        """Write ``folder/name`` by a complete file in the model's ``.staging`` renamed into place: a writer killed
        half-way leaves its temporary file where the next lock clears it, never in a version's folder."""
        staging = self._require_lock(model) / ".staging"
        staging.mkdir(exist_ok=True)
        tmp = staging / f"{uuid.uuid4().hex}.{name}"
        atomic_write_bytes(tmp, data)
        os.replace(tmp, folder / name)
        fsync_path(folder)

    def open_verified(self, model: str, version: int | None = None) -> VersionInfo:
        """The version (default: current) after verifying it; refuses a tampered or pruned one."""
        info = self.verify(model, self.current(model) if version is None else version)
        if info.pruned:
            raise PrunedVersionError(f"version {info.version} of '{model}' was pruned: its weights and card are deleted "
                                     "and only its manifest is kept; load a later version")
        return info

    def load(self, model: str, version: int | None = None):
        """(module, task, card) of a verified version."""
        return load_model_dir(self.open_verified(model, version).path)

    def ancestors(self, model: str, version: int) -> list[int]:
        """``version`` and its parents, newest first."""
        chain: list[int] = []
        v: int | None = version
        while v is not None:
            if v in chain:
                raise TamperedVersionError(f"model '{model}': the parent chain of version {version} loops")
            chain.append(v)
            v = self.manifest(model, v).get("parent")
        return chain

    def find_published(self, model: str, content_sha256: str, *, parent: int) -> VersionInfo | None:
        """The version published on ``parent`` whose manifest's batch has this content hash
        (request ids, sample ids, seed, method and settings; never the batch's name alone)."""
        for v in self.versions(model):
            if v > parent:
                info = self.info(model, v)
                if info.parent == parent and (info.manifest.get("batch") or {}).get("content_sha256") == content_sha256:
                    return info
        return None

    def was_current(self, model: str, version: int) -> bool:
        """Whether CURRENT ever pointed at ``version`` (its history): a version that was current
        and is no longer an ancestor of CURRENT was rolled back, never merely left unfinished."""
        return any(h.get("version") == version for h in self.pointer(model).get("history", []))

    def removal_manifests(self, model: str) -> list[dict[str, Any]]:
        """Manifests of every published removal (rolled back or not: a release stays released)."""
        return [m for m in (self.manifest(model, v) for v in self.versions(model)) if m.get("kind") == "removal"]

    # -- writing (inside ``lock``) -----------------------------------------------------------
    @contextmanager
    def lock(self, model: str, *, create: bool = False) -> Iterator[None]:
        """Exclusive write access to a model across processes (flock; freed by the kernel on kill).
        Only ``create`` (an import) makes the model's folder; otherwise the model must exist."""
        folder = self.model_dir(model)
        if create:
            folder.mkdir(parents=True, exist_ok=True)
        else:
            self.require_model(model)
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ModelBusyError(
                    f"model '{model}' is being written by another process (a campaign or stream service); "
                    "wait for it to finish or stop it"
                ) from None
            with self._guard:
                self._held[model] = fd
            self._clear_staging(folder)
            try:
                yield
            finally:
                with self._guard:
                    self._held.pop(model, None)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @staticmethod
    def _clear_staging(folder: Path) -> None:
        """Remove half-built versions of a killed writer; never follow a link out of the store."""
        staging = folder / ".staging"
        if staging.is_symlink() or (staging.exists() and not staging.is_dir()):
            raise VersionStoreError(
                f"{staging} is a symbolic link or a file, not the store's own staging folder; remove it (it is never "
                "followed, so nothing it points to was touched)"
            )
        if not staging.is_dir():
            return
        for leftover in staging.iterdir():
            if leftover.is_symlink() or not leftover.is_dir():
                leftover.unlink()
            else:
                shutil.rmtree(leftover, ignore_errors=True)

    # -- ledgers that recorded work on a model (so a rollback finds them all) -----------------
    def ledgers(self, model: str) -> list[Path]:
        path = self.model_dir(model) / LEDGERS_FILE
        if not path.is_file():
            return []
        try:
            return [Path(p) for p in json.loads(path.read_text())]
        except (ValueError, TypeError) as err:
            raise VersionStoreError(f"{path} is not a JSON list of ledger paths ({err}); fix or delete it") from None

    def register_ledger(self, model: str, ledger_path: str | Path) -> None:
        """Remember (atomically, under the lock) that ``ledger_path`` records work on ``model``."""
        self._require_lock(model)
        path = Path(ledger_path).resolve()
        known = self.ledgers(model)
        if path not in known:
            atomic_write_bytes(self.model_dir(model) / LEDGERS_FILE, _json_bytes([str(p) for p in [*known, path]]))

    def _require_lock(self, model: str) -> Path:
        if model not in self._held:
            raise VersionStoreError(f"write to model '{model}' without holding its lock (use VersionStore.lock)")
        return self.model_dir(model)

    def _write_pointer(self, model: str, version: int, kind: str, reason: str | None, previous: dict[str, Any] | None) -> None:
        history = list((previous or {}).get("history", []))
        history.append({"at": _now(), "kind": kind, "version": version,
                        "from": (previous or {}).get("version"), "reason": reason})
        pointer = {
            "model": model, "version": version,
            "manifest_sha256": sha256_of(self.version_dir(model, version) / MANIFEST_FILE),
            "history": history,
        }
        atomic_write_bytes(self.model_dir(model) / POINTER_FILE, _json_bytes(self._sealed(pointer)))

    def _stage(self, model: str, write: Any, manifest: dict[str, Any], version: int) -> VersionInfo:
        """Build a version in .staging with ``write(dir)`` and the manifest, then rename it into place."""
        folder = self._require_lock(model)
        staging = folder / ".staging" / uuid.uuid4().hex
        staging.mkdir(parents=True)
        write(staging)
        crash_point("publish_staged")
        manifest = {**manifest, "format": FORMAT, "model": model, "version": version, "created_at": _now(),
                    "files": {name: sha256_of(staging / name) for name in (WEIGHTS_FILE, CARD_FILE, TRAJECTORY_FILE)
                              if name != TRAJECTORY_FILE or (staging / name).exists()}}
        manifest = self._sealed(manifest)
        atomic_write_bytes(staging / MANIFEST_FILE, _json_bytes(manifest))
        fsync_path(staging)
        target = self.version_dir(model, version)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            raise VersionStoreError(f"version {version} of '{model}' already exists; versions are never overwritten")
        os.rename(staging, target)
        fsync_path(target.parent)
        crash_point("publish_renamed")
        return VersionInfo(model, version, target, manifest)

    def import_model_dir(self, model: str, source: str | Path, *, note: str | None = None,
                         with_recorded_run: bool = False) -> VersionInfo:
        """Version 0 of a new model, copied from a model directory (validated by loading it). A directory that
        holds its recorded training run (``unlearn train``'s) brings it; a later version's directory only refers to
        its original's run, and that run (whose last checkpoint is the original) is copied into version 0 only with
        ``with_recorded_run`` (version 0 then holds the original's weights until a removal and a prune follow);
        otherwise the reference is dropped and the methods that read the run go without it."""
        folder = self._require_lock(model)
        if self.versions(model) or (folder / POINTER_FILE).exists():
            raise VersionStoreError(f"model '{model}' already has versions in {self.root}; import under a new name")
        source = Path(source)
        load_model_dir(source)  # refuses a directory whose weights do not fit its card

        card = read_card(source)
        own = (source / TRAJECTORY_FILE).exists()
        run = recorded_trajectory(source, card) if own or with_recorded_run else None
        if with_recorded_run and run is None:
            raise VersionStoreError(f"{source} has no recorded training run to bring (its card refers to none, or the "
                                    "file is gone or changed); import without with_recorded_run")

        def write(staging: Path) -> None:
            for name in (WEIGHTS_FILE, CARD_FILE):
                atomic_write_bytes(staging / name, (source / name).read_bytes())
            if run is not None:  # the store holds the run it reads, in version 0, where prune can delete it
                atomic_write_bytes(staging / TRAJECTORY_FILE, run.read_bytes())
            if TRAJECTORY_REFERENCE in card.training.extra:  # version 0 holds it now, or goes without: no reference
                kept = without_trajectory_reference(card)
                atomic_write_bytes(staging / CARD_FILE, kept.model_dump_json(indent=2).encode())

        info = self._stage(model, write, {"kind": "import", "parent": None, "source": str(source.resolve()), "note": note}, 0)
        self._write_pointer(model, 0, "import", note, None)
        return info

    def publish(self, model: str, state: Mapping[str, Tensor], card: ModelCard, *, parent: int,
                manifest: dict[str, Any]) -> VersionInfo:
        """Publish ``state``/``card`` as a new version whose parent must be the current version;
        ``manifest`` adds the removal's record (batch, requests, method, privacy, metrics)."""
        self._require_lock(model)
        pointer = self.pointer(model)
        if int(pointer["version"]) != parent:
            raise VersionStoreError(f"model '{model}' is at version {pointer['version']}, not at the expected parent {parent}")
        version = max(self.versions(model)) + 1
        parent_sha = sha256_of(self.version_dir(model, parent) / MANIFEST_FILE)
        # the recipe's recorded run stays in the version that holds it (version 0): it saw the removed samples and its
        # last checkpoint is the original's weights, so the new version's card refers to it instead of a copy
        card = refer_to_trajectory(card, self.version_dir(model, parent), self.version_dir(model, version))

        def write(staging: Path) -> None:
            write_model_dir(staging, dict(state), card)

        info = self._stage(
            model, write,
            {**manifest, "kind": "removal", "parent": parent, "parent_manifest_sha256": parent_sha}, version,
        )
        self.set_current(model, version, expected=parent, kind="publish")
        crash_point("publish_pointer")
        return info

    def set_current(self, model: str, version: int, *, expected: int | None = None, kind: str = "publish",
                    reason: str | None = None) -> None:
        """Move CURRENT to ``version`` (atomically); ``expected`` guards against a concurrent move."""
        self._require_lock(model)
        pointer = self.pointer(model)
        if expected is not None and int(pointer["version"]) != expected:
            raise VersionStoreError(f"model '{model}' is at version {pointer['version']}, expected {expected}")
        self._write_pointer(model, version, kind, reason, pointer)

    def rollback(self, model: str, version: int, reason: str) -> tuple[int, int]:
        """Point CURRENT at an older, verified version. Returns (from, to). Nothing is deleted."""
        self._require_lock(model)
        old = self.current(model)
        if version not in self.versions(model):
            raise VersionStoreError(f"model '{model}' has no version {version} (versions: {self.versions(model)})")
        if version >= old:
            raise VersionStoreError(f"rollback target {version} is not older than the current version {old}; name an older version")
        if self.verify(model, version).pruned:
            raise PrunedVersionError(f"rollback target {version} of '{model}' was pruned (only its manifest is kept); "
                                     "roll back to a version that was not pruned")
        self.set_current(model, version, expected=old, kind="rollback", reason=reason)
        return old, version

    def holding_run(self, model: str) -> list[int]:
        """The versions not pruned that hold a copy of the recorded training run (its last checkpoint is the
        original's weights): version 0, and later versions published before versions referred to it instead."""
        return [v for v in self.versions(model) if (self.version_dir(model, v) / TRAJECTORY_FILE).is_file()
                and not (self.version_dir(model, v) / PRUNED_FILE).is_file()]

    def prune_plan(self, model: str, before: int) -> tuple[list[int], dict[int, str]]:
        """(the versions below ``before`` a prune still has work on: not pruned, or pruned half-way; those of them
        that fail verification, with the error). Refuses ``before`` past the current version, and a store whose
        manifests are sealed when no key is loaded (a tombstone written then could never be verified)."""
        current = self.current(model)
        if before > current:
            raise VersionStoreError(f"--before {before} would prune the current version {current} of '{model}'; "
                                    f"name at most {current}")
        below = [v for v in self.versions(model) if v < before]
        if self.hmac_key is None and any(SEAL_FIELD in self.manifest(model, v) for v in below):
            raise VersionStoreError(f"the manifests of '{model}' are sealed but no store key is loaded: a tombstone "
                                    f"written now could never be verified; set {HMAC_KEY_ENV} (or {HMAC_KEY_FILE_ENV}) "
                                    "and prune again; nothing was deleted")
        targets: list[int] = []
        damaged: dict[int, str] = {}
        for version in below:
            folder = self.version_dir(model, version)
            if (folder / PRUNED_FILE).is_file():
                if any(p.name not in (MANIFEST_FILE, PRUNED_FILE) for p in folder.iterdir()):
                    targets.append(version)  # interrupted: to finish
                continue
            targets.append(version)
            try:  # every version about to lose its files verifies first: no evidence of tampering goes unnoticed
                self.verify(model, version)
            except TamperedVersionError as err:
                damaged[version] = str(err)
        return targets, damaged

    def prune(self, model: str, before: int, reason: str, *, include_damaged: bool = False) -> list[int]:
        """Delete the weights, card and recorded training run of every version numbered below ``before`` (at most
        the current version: CURRENT is never pruned), keeping each manifest and writing a sealed tombstone first.
        Returns the versions pruned by this call (those already pruned are skipped; an interrupted one is
        finished). Every version about to lose its files is verified first, and a store whose manifests are sealed
        is pruned only with its key. Pruned versions can no longer be loaded or rolled back to; a later version
        whose card refers to version 0's recorded run loses it (``holding_run`` lists the versions that still hold
        a copy: CURRENT may, in a store published before versions referred to it)."""
        self._require_lock(model)
        if not reason or not reason.strip():
            raise VersionStoreError("prune needs a reason (recorded in each version's tombstone)")
        targets, damaged = self.prune_plan(model, before)
        if damaged and not include_damaged:
            raise VersionStoreError(
                f"versions {sorted(damaged)} of '{model}' fail verification ({next(iter(damaged.values()))}); nothing "
                f"was deleted. Restore their files, prune below them (--before {min(damaged)}), or prune them too "
                "with --include-damaged (each tombstone records its verification error)")
        pruned: list[int] = []
        for version in targets:
            folder = self.version_dir(model, version)
            leftovers = [p for p in folder.iterdir() if p.name not in (MANIFEST_FILE, PRUNED_FILE)]
            if (folder / PRUNED_FILE).is_file():  # interrupted: its tombstone checked, then finished
                self._check_tombstone(self.info(model, version), {MANIFEST_FILE, PRUNED_FILE})
            else:
                listed = set(self.manifest(model, version).get("files") or {})
                names = sorted(p.name for p in leftovers if p.name != TRAJECTORY_MOVED)  # a dropped run's record goes
                unlisted = [n for n in names if n not in listed]  # a damaged version's extra files go too
                tomb = self._sealed({"kind": "pruned", "model": model, "version": version, "pruned_at": _now(),
                                     "reason": reason, "deleted": [n for n in names if n in listed],
                                     **({"deleted_unlisted": unlisted} if unlisted else {}),
                                     **({"verify_error": damaged[version]} if version in damaged else {})})
                self._place(model, folder, PRUNED_FILE, _json_bytes(tomb))
            crash_point("prune_tombstone")
            for path in leftovers:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            fsync_path(folder)
            pruned.append(version)
        return pruned
