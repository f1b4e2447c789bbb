"""A cache entry built once, whole, across processes.

Two evaluations sharing a cache folder (``unlearn eval``'s baselines and U-LiRA shadow originals, the frozen
features) may ask for the same entry at once. The first takes an exclusive lock beside the entry (``flock``, freed
by the kernel if the process dies) and builds it; the second waits on the lock, then finds the entry complete and
reads it. An entry is complete once its record is there, and the record is there only once the entry is whole: a
folder entry (``building``) is filled in a staging folder, flushed to disk and renamed into place; a file entry
writes its record after its data (``pipeline.features``). The lock needs ``flock`` to hold across the processes
that share the folder: a local disk, or NFS with locking enabled.
"""
from __future__ import annotations

import fcntl
import glob
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipeline.checkpoint import fsync_path
from pipeline.progress import note

STAGING_MARK = ".staging-"


@contextmanager
def exclusive(lock_path: str | Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (created if missing, writable by the folder's group and
    others as the umask allows), waiting for another holder, and saying so where progress is shown."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            note(f"waiting for another process building {lock_path.name.removeprefix('.').removesuffix('.lock')} "
                 f"in {lock_path.parent}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def lock_of(target: Path) -> Path:
    """The lock file that guards entry ``target`` (beside it, so that it never lies inside the entry)."""
    return target.with_name(f".{target.name}.lock")


def _flush_tree(folder: Path) -> None:
    """fsync every file in ``folder`` and the folder itself (so that a record never outlives its data)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fsync_path(path)
    fsync_path(folder)


@contextmanager
def building(target: str | Path, record: str) -> Iterator[Path | None]:
    """Build the cache folder ``target`` once: yields None where ``target / record`` exists (checked again under
    ``target``'s lock: another process built it meanwhile; read it); else a fresh staging folder beside ``target``
    for the body to fill, the record written last. When the body returns, the staging folder is flushed to disk
    and becomes ``target`` by one rename; a ``target`` without its record (an interrupted build by code that wrote
    in place) is moved aside first and deleted after. If the body raises, its staging folder is deleted and
    ``target`` is left as it was. Staging folders of dead builds are deleted before a build starts."""
    target = Path(target)
    if (target / record).exists():   # complete: read without taking the lock
        yield None
        return
    with exclusive(lock_of(target)):
        if (target / record).exists():
            yield None
            return
        prefix = f".{target.name}{STAGING_MARK}"
        for stale in target.parent.glob(glob.escape(prefix) + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
        os.chmod(staging, 0o755)   # mkdtemp's 0700 would become the entry's
        try:
            yield staging
            if not (staging / record).exists():
                raise RuntimeError(f"cache entry {target} was built without its record {record}")
            _flush_tree(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        aside = None
        if target.exists():   # no record: an interrupted build; the finished one replaces it
            aside = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
            os.rename(target, aside / target.name)
        os.rename(staging, target)
        fsync_path(target.parent)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
