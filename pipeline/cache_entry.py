"""A cache entry built once, whole, across processes.

Two evaluations sharing a cache folder (``unlearn eval``'s baselines and U-LiRA shadow originals, the frozen
features) may ask for the same entry at once. The first takes an exclusive lock beside the entry (``flock``, freed
by the kernel if the process dies) and builds it in a staging folder that is renamed into place whole; the second
waits on the lock, then finds the entry complete and reads it. A reader never sees a half-written entry: the
entry's folder exists only once its record is in it.
"""
from __future__ import annotations

import fcntl
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

STAGING_MARK = ".staging-"


@contextmanager
def exclusive(lock_path: str | Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (created if missing), waiting for another holder."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
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


@contextmanager
def building(target: str | Path, record: str) -> Iterator[Path | None]:
    """Build the cache folder ``target`` once: under ``target``'s lock, yields None where ``target / record`` exists
    (another process built it meanwhile: read it), else an empty staging folder beside ``target`` to fill, the record
    written last; when the body returns, the staging folder becomes ``target`` by one rename. If the body raises, the
    staging folder is deleted and ``target`` is left as it was. A ``target`` without its record (an interrupted
    build by code that wrote in place) and staging folders of dead builds are deleted first."""
    target = Path(target)
    with exclusive(lock_of(target)):
        if (target / record).exists():
            yield None
            return
        for stale in target.parent.glob(f".{target.name}{STAGING_MARK}*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = target.with_name(f".{target.name}{STAGING_MARK}{os.getpid()}")
        staging.mkdir(parents=True)
        try:
            yield staging
            if not (staging / record).exists():
                raise RuntimeError(f"cache entry {target} was built without its record {record}")
            if target.exists():
                shutil.rmtree(target)
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
