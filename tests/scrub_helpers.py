"""Shared pieces of the Fisher / NTK / Mixed-Linear tests."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """Run a module's many small products on one intra-op thread (2 shared cores: OpenMP
    oversubscription made them ~10x slower), restoring the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def _idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as fh:
        raw = fh.read()
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def fashion_subset(split: str, count: int, *, start: int = 0, size: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` Fashion-MNIST images from ``start`` of a split ("train" or "t10k"), 2x2
    average-pooled to 14x14 when size=14, scaled to [0, 1] and standardised; float32."""
    images = FASHION_DIR / f"{split}-images-idx3-ubyte.gz"
    labels = FASHION_DIR / f"{split}-labels-idx1-ubyte.gz"
    if not images.exists():
        pytest.skip(f"Fashion-MNIST is not installed at {FASHION_DIR}")
    x = torch.tensor(_idx(images)[start : start + count], dtype=torch.float32) / 255.0
    y = torch.tensor(_idx(labels)[start : start + count], dtype=torch.long)
    x = x.unsqueeze(1)
    if size == 14:
        x = torch.nn.functional.avg_pool2d(x, 2)
    return (x - 0.286) / 0.353, y


def assert_yaml_mirrors_settings(name: str) -> None:
    """configs/methods/NAME.yaml names the method and holds exactly its Settings' defaults."""
    import yaml

    from pipeline.methods import get_method

    path = Path(__file__).resolve().parents[1] / "configs" / "methods" / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    assert raw["method"] == name
    settings_cls = get_method(name).Settings
    assert set(raw["settings"]) == set(settings_cls.model_fields), path
    assert settings_cls.model_validate(raw["settings"]) == settings_cls()
