"""Session-wide settings and the shared fixtures of the suite (builders: ``tests/kit.py``).

  trained_model_dir   factory: ``trained_model_dir(preset="linear", options=None, **kit options)``
                      -> a fresh model directory trained by the real ``unlearn train`` code path
  ray_local           one Ray per test session, started inside the process on loopback
                      (2 CPUs, a small object store, its own short temp dir)
  http                the HTTP client helper (``kit.http_json``)
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402

OBJECT_STORE_BYTES = 256 * 2**20


@pytest.fixture(scope="session")
def trained_model_dir(tmp_path_factory) -> Callable[..., Path]:
    """A factory of trained model directories; same arguments, same (cached) directory."""
    from tests import kit

    made: dict[str, Path] = {}

    def make(preset: str = "linear", options: dict | None = None, **kwargs: Any) -> Path:
        key = repr((preset, sorted((options or {}).items()), sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in made:
            made[key] = kit.trained_model_dir(tmp_path_factory.mktemp(f"model-{preset}"), preset, options, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def ray_local():
    """A Ray started inside the test process (or the one already running), stopped at the end
    only if started here."""
    from cluster.runtime import connect

    tmp = tempfile.mkdtemp(prefix="urt-", dir="/tmp")
    rt = connect(num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, temp_dir=tmp, log_to_driver=False)
    try:
        yield rt
    finally:
        if rt.owned:
            rt.close()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def http():
    """The HTTP client helper: ``http(port, method, path, body=None, headers=None) -> (status, json)``."""
    from tests.kit import http_json

    return http_json
