"""User images laid out one folder per identity: ``root/<identity>/<image>.{png,jpg,jpeg}``.

Optionally with split folders: ``root/train/<identity>/...`` and ``root/test/<identity>/...``
(``splits: auto`` detects them; otherwise one ``train`` split, and ``test_every: k`` moves
every k-th sample id to ``test``).

Stable ids: all image paths under ``root`` (relative, POSIX) are sorted; ``sample_id`` is the
position in that sorted list - unique across splits, unchanged by decoding options. Labels:
the sorted identity folder names' indices (the same mapping in every split). Images are read
with Pillow when installed (PNG/JPEG), else PNG through ``matplotlib.image``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from pipeline.data.hf import ID_COLUMN, offline
from pipeline.data.images import prepare
from pipeline.data.sampleset import SampleSet
from pipeline.data.sources import MissingSourceError, register_source

EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg")
SPLIT_DIRS: tuple[str, ...] = ("train", "test")


def list_images(root: str | Path) -> list[tuple[str, str, str]]:
    """Sorted (relative path, split, identity) of every image under ``root``."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data.options.root: {root} is not a folder of identity folders")
    has_splits = all((root / s).is_dir() for s in SPLIT_DIRS)
    rel_paths = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                       if p.is_file() and p.suffix.lower() in EXTENSIONS)
    out = []
    for rel in rel_paths:
        parts = rel.split("/")
        if has_splits:
            if len(parts) != 3 or parts[0] not in SPLIT_DIRS:
                raise ValueError(f"{root}/{rel}: with train/ and test/ folders every image must be <split>/<identity>/<file>")
            out.append((rel, parts[0], parts[1]))
        else:
            if len(parts) != 2:
                raise ValueError(f"{root}/{rel}: every image must be <identity>/<file> (one folder per identity)")
            out.append((rel, "train", parts[0]))
    if not out:
        raise ValueError(f"data.options.root: {root} holds no {'/'.join(EXTENSIONS)} images")
    return out


def read_image(path: Path, mode: str) -> np.ndarray:
    """uint8 (H, W) for mode 'L' or (H, W, 3) for 'RGB'."""
    try:
        from PIL import Image
    except ImportError:
        Image = None  # type: ignore[assignment]
    if Image is not None:
        with Image.open(path) as img:
            return np.asarray(img.convert(mode), dtype=np.uint8)
    if path.suffix.lower() != ".png":
        raise MissingSourceError(f"{path}: JPEG needs Pillow: `pip install pillow`")
    import matplotlib.image as mpimg

    arr = mpimg.imread(str(path))  # float in [0, 1] for PNG
    arr = arr[..., :3] if arr.ndim == 3 else arr
    if mode == "L" and arr.ndim == 3:
        arr = arr @ np.array([0.299, 0.587, 0.114], dtype=arr.dtype)
    if mode == "RGB" and arr.ndim == 2:
        arr = np.repeat(arr[..., None], 3, axis=2)
    return np.round(arr * 255).astype(np.uint8)


def image_folder_dataset(
    *, root: str, image_size: int | Sequence[int] = 32, channels: int = 3, test_every: int | None = None,
) -> Any:
    """``DatasetDict`` with sample_id, path, label (ClassLabel over identity names), image
    (uint8 H x W [x 3], resized with Pillow/bilinear resampling to ``image_size``)."""
    offline()
    import datasets

    entries = list_images(root)
    identities = sorted({identity for _, _, identity in entries})
    index = {name: i for i, name in enumerate(identities)}
    mode = "L" if channels == 1 else "RGB"
    hw = (int(image_size), int(image_size)) if isinstance(image_size, int) else tuple(int(s) for s in image_size)
    images = np.stack([_resized(Path(root) / rel, mode, hw) for rel, _, _ in entries])
    ids = np.arange(len(entries), dtype=np.int64)
    splits = np.array([split for _, split, _ in entries])
    if test_every:
        if (splits == "test").any():
            raise ValueError("data.options.test_every cannot be combined with train/ and test/ folders")
        splits = np.where(ids % int(test_every) == 0, "test", "train")
    shape = images.shape[1:]
    image_feature = datasets.Array2D(shape, "uint8") if len(shape) == 2 else datasets.Array3D(shape, "uint8")
    features = datasets.Features({
        ID_COLUMN: datasets.Value("int64"), "path": datasets.Value("string"),
        "label": datasets.ClassLabel(names=identities), "image": image_feature,
    })
    out = {}
    for split in sorted(set(splits.tolist())):
        rows = np.flatnonzero(splits == split)
        out[split] = datasets.Dataset.from_dict({
            ID_COLUMN: ids[rows], "path": [entries[i][0] for i in rows],
            "label": [index[entries[i][2]] for i in rows], "image": images[rows],
        }, features=features)
    return datasets.DatasetDict(out)


def _resized(path: Path, mode: str, hw: tuple[int, int]) -> np.ndarray:
    arr = read_image(path, mode)
    if arr.shape[:2] == hw:
        return arr
    x = prepare(arr[None], image_size=hw, normalize=False)  # (1, C, H, W) in [0, 1]
    x = (x[0].permute(1, 2, 0).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    return x[..., 0] if mode == "L" else x


@register_source("image-folder")
def image_folder(
    *, root: str, image_size: int | Sequence[int] = 32, channels: int = 3, test_every: int | None = None,
    normalize: bool = True, mean: Sequence[float] = (0.5,), std: Sequence[float] = (0.5,),
) -> dict[str, SampleSet]:
    """Identity folders as SampleSets: x float32 (N, C, H, W), y int64 identity index."""
    dsd = image_folder_dataset(root=root, image_size=image_size, channels=channels, test_every=test_every)
    out = {}
    for split, ds in dsd.items():
        table = ds.with_format("numpy")[:]
        x = prepare(table["image"], normalize=normalize, mean=mean, std=std)
        out[split] = SampleSet({"x": x, "y": torch.as_tensor(np.asarray(table["label"], dtype=np.int64))},
                               torch.as_tensor(np.asarray(table[ID_COLUMN], dtype=np.int64)))
    return out
