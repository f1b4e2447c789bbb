"""Checkpoints: safetensors in and out, strict key checks, and torch state dicts read with
``weights_only=True`` (never an arbitrary unpickle)."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn


class CheckpointMismatchError(ValueError):
    """A checkpoint's keys or shapes do not match the model it is loaded into."""


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder by path (a folder: so that the names renamed or created in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temporary name in the same folder, fsync, rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; published files are world-readable
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def save_safetensors(tensors: Mapping[str, Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> str:
    """Save atomically; returns the sha256 of the written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        digest = sha256_of(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Read safetensors, or a torch state dict with ``weights_only=True``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        return load_file(str(path))
    obj = torch.load(str(path), map_location="cpu", weights_only=True)
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise CheckpointMismatchError(f"{path} does not hold a flat state dict of tensors")
    return dict(obj)


def load_into(model: nn.Module, state: Mapping[str, Tensor], *, source: str = "checkpoint") -> None:
    """Load strictly: any missing or unexpected key, or a shape mismatch, is an error listing them."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong_shape = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in set(own) & set(state)
        if tuple(own[k].shape) != tuple(state[k].shape)
    )
    if missing or unexpected or wrong_shape:
        raise CheckpointMismatchError(
            f"{source} does not match the model: missing keys {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}; unexpected keys {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}; shape mismatches {wrong_shape[:20]}"
        )
    model.load_state_dict(dict(state), strict=True)
