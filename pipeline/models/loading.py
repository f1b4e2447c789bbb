"""Loading foreign checkpoints into a preset's module: files, HF directories and key layouts.

A checkpoint can be
  * a ``.safetensors`` file,
  * a torch file (``.pt``, ``.pth``, ``.bin``, ``.tar``) read with ``torch.load(weights_only=True)``
    (never an arbitrary unpickle); a dict holding ``state_dict`` / ``model`` is unwrapped,
  * a Hugging Face model directory (``model.safetensors``, a sharded
    ``model.safetensors.index.json``, or ``pytorch_model.bin``).

Each preset registers the key *layouts* it understands (``register_layout``): a detector and a
converter to the module's own parameter names (e.g. VGG-Face ``conv1_1`` -> torchvision
``features.0``). ``load_checkpoint`` picks the layout (or uses the one named), converts, and
loads strictly: any missing or unexpected key, or a shape mismatch, fails with the key lists
(``CheckpointMismatchError``). With ``scope="backbone"`` the preset's head (its registered head
prefixes, e.g. the identity classifier) is excluded on both sides: the checkpoint's head is
dropped and the module keeps its freshly initialised head - used to start fine-tuning from a
checkpoint trained on other identities/classes. Every dropped key is listed in the report.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Mapping

import torch
from torch import Tensor, nn

from pipeline.checkpoint import CheckpointMismatchError, load_into, read_state_dict

StateDict = dict[str, Tensor]
Detect = Callable[[Mapping[str, Tensor], nn.Module], bool]
Convert = Callable[[StateDict, nn.Module], StateDict]
Scope = Literal["full", "backbone"]

# Prefixes that wrappers add around a whole model (DataParallel / DistributedDataParallel).
WRAPPER_PREFIXES: tuple[str, ...] = ("module.",)


@dataclass(frozen=True)
class Layout:
    """One key layout a preset can load: ``detect(state, model)`` and ``convert(state, model)``."""

    name: str
    detect: Detect
    convert: Convert
    description: str = ""


@dataclass
class LoadReport:
    layout: str
    source: str
    loaded: int
    dropped_from_checkpoint: list[str] = field(default_factory=list)
    kept_from_model: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "layout": self.layout, "source": self.source, "loaded": self.loaded,
            "dropped_from_checkpoint": self.dropped_from_checkpoint, "kept_from_model": self.kept_from_model,
        }


LAYOUTS: dict[str, dict[str, Layout]] = {}
HEAD_PREFIXES: dict[str, tuple[str, ...]] = {}


def register_layout(preset: str, layout: Layout) -> Layout:
    table = LAYOUTS.setdefault(preset, {})
    if layout.name in table:
        raise ValueError(f"layout '{layout.name}' registered twice for preset '{preset}'")
    table[layout.name] = layout
    return layout


def register_head(preset: str, prefixes: tuple[str, ...]) -> None:
    """Parameter-name prefixes that form the preset's task head (dropped with scope='backbone')."""
    HEAD_PREFIXES[preset] = tuple(prefixes)


def identity_layout(name: str = "native", description: str = "the module's own parameter names") -> Layout:
    """The module's own names: detected when every checkpoint key is one of the module's keys."""

    def detect(state: Mapping[str, Tensor], model: nn.Module) -> bool:
        own = set(model.state_dict())
        return len(state) > 0 and set(state) <= own

    return Layout(name, detect, lambda state, model: dict(state), description)


# ---------------------------------------------------------------------------------------------
# reading files and directories
# ---------------------------------------------------------------------------------------------
HF_WEIGHT_FILES: tuple[str, ...] = ("model.safetensors", "pytorch_model.bin")
HF_INDEX_FILES: tuple[str, ...] = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def read_checkpoint(source: str | Path) -> StateDict:
    """A flat ``{name: tensor}`` from a file or a Hugging Face directory (see module docstring)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist; pass a .safetensors/.pt/.pth/.bin file or a "
            "Hugging Face model directory"
        )
    if path.is_dir():
        return _read_hf_dir(path)
    return read_state_dict(path)


def _read_hf_dir(path: Path) -> StateDict:
    for name in HF_WEIGHT_FILES:
        if (path / name).exists():
            return read_state_dict(path / name)
    for name in HF_INDEX_FILES:
        index = path / name
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            state: StateDict = {}
            for shard in sorted(set(weight_map.values())):
                state.update(read_state_dict(path / shard))
            return state
    raise FileNotFoundError(
        f"{path} is a directory without {' / '.join(HF_WEIGHT_FILES + HF_INDEX_FILES)}; "
        "point at a Hugging Face model directory (written by save_pretrained) or a weights file"
    )


def strip_wrappers(state: Mapping[str, Tensor]) -> StateDict:
    """Remove a ``module.`` prefix that every key carries (DataParallel checkpoints)."""
    out = dict(state)
    for prefix in WRAPPER_PREFIXES:
        if out and all(k.startswith(prefix) for k in out):
            out = {k[len(prefix):]: v for k, v in out.items()}
    return out


def non_persistent_buffers(model: nn.Module) -> set[str]:
    """Buffers the module does not save (e.g. HF ``position_ids``); old checkpoints may hold them."""
    return {name for name, _ in model.named_buffers()} - set(model.state_dict())


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def choose_layout(preset: str, state: Mapping[str, Tensor], model: nn.Module, layout: str = "auto") -> Layout:
    table = LAYOUTS.get(preset, {})
    if not table:
        table = {"native": identity_layout()}
    if layout != "auto":
        if layout not in table:
            raise ValueError(f"layout '{layout}' is unknown for preset '{preset}'; choose one of {sorted(table)} or 'auto'")
        return table[layout]
    for candidate in table.values():
        if candidate.detect(state, model):
            return candidate
    sample = sorted(state)[:8]
    raise CheckpointMismatchError(
        f"no known layout for preset '{preset}' matches the checkpoint (first keys {sample}); "
        f"known layouts: {sorted(table)} - convert the checkpoint or name the layout explicitly"
    )


def load_checkpoint(
    model: nn.Module, preset: str, source: str | Path | Mapping[str, Tensor], *,
    layout: str = "auto", scope: Scope = "full",
) -> LoadReport:
    """Read ``source`` (path or state dict), convert its keys, and load strictly into ``model``."""
    label = "state dict" if isinstance(source, Mapping) else str(source)
    raw = dict(source) if isinstance(source, Mapping) else read_checkpoint(source)
    state = strip_wrappers(raw)
    # Old checkpoints save buffers the module no longer persists (HF ``position_ids``): match
    # them by their last name component, since the layout may still have to add a prefix.
    hidden_names = {name.rsplit(".", 1)[-1] for name in non_persistent_buffers(model)}
    own_keys = set(model.state_dict())
    dropped = sorted(k for k in state if k not in own_keys and k.rsplit(".", 1)[-1] in hidden_names)
    chosen = choose_layout(preset, {k: v for k, v in state.items() if k not in dropped}, model, layout)
    converted = chosen.convert({k: v for k, v in state.items() if k not in dropped}, model)
    kept: list[str] = []
    if scope == "backbone":
        heads = HEAD_PREFIXES.get(preset, ())
        if not heads:
            raise ValueError(f"preset '{preset}' declares no head; use scope='full'")
        in_head = lambda key: key.startswith(heads)  # noqa: E731
        dropped += sorted(k for k in converted if in_head(k))
        converted = {k: v for k, v in converted.items() if not in_head(k)}
        own = model.state_dict()
        kept = sorted(k for k in own if in_head(k))
        converted.update({k: own[k] for k in kept})
    elif scope != "full":
        raise ValueError(f"scope must be 'full' or 'backbone', got '{scope}'")
    load_into(model, converted, source=f"{label} (layout '{chosen.name}')")
    return LoadReport(chosen.name, label, len(converted) - len(kept), sorted(set(dropped)), kept)


def rename_by_table(state: Mapping[str, Tensor], table: Mapping[str, str]) -> StateDict:
    """Rename keys by an exact ``old -> new`` table; keys not in it pass through unchanged."""
    return {table.get(k, k): v for k, v in state.items()}


def add_prefix(state: Mapping[str, Tensor], prefix: str) -> StateDict:
    return {f"{prefix}{k}": v for k, v in state.items()}


def as_float(state: Mapping[str, Tensor]) -> StateDict:
    """Floating tensors to float32 (half-precision checkpoints); integer buffers unchanged."""
    return {k: (v.float() if torch.is_floating_point(v) else v) for k, v in state.items()}
