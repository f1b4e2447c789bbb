"""Image tensors for the image sources: resize, channel count, normalisation.

Images enter as uint8 or float arrays (N, H, W) or (N, H, W, C) and leave as float32
(N, C, H', W'), scaled to [0, 1] and, when ``normalize`` is on, standardised per channel with
the source's published mean and std: x' = (x - mean) / std.
Resizing is bilinear with antialiasing (``torch.nn.functional.interpolate``), so downsizing
averages instead of aliasing; 3 channels from grey repeat the grey channel (what a face/re-ID
network pretrained on RGB expects).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


def to_float_nchw(images: np.ndarray | Tensor, *, scale: float = 255.0) -> Tensor:
    """(N, H, W) or (N, H, W, C) -> float32 (N, C, H, W) in [0, 1] (divided by ``scale``)."""
    array = np.asarray(images)
    x = torch.from_numpy(array if array.flags.writeable else array.copy())
    if x.dim() == 3:
        x = x.unsqueeze(1)
    elif x.dim() == 4:
        x = x.permute(0, 3, 1, 2)
    else:
        raise ValueError(f"images must be (N, H, W) or (N, H, W, C), got shape {tuple(x.shape)}")
    return x.to(torch.float32) / float(scale)


def resize(x: Tensor, size: int | Sequence[int] | None) -> Tensor:
    """Bilinear (antialiased) resize of (N, C, H, W) to ``size`` (int: square; (h, w); None: unchanged)."""
    if size is None:
        return x
    hw = (int(size), int(size)) if isinstance(size, (int, np.integer)) else tuple(int(s) for s in size)
    if tuple(x.shape[-2:]) == hw:
        return x
    return F.interpolate(x, size=hw, mode="bilinear", align_corners=False, antialias=True)


def set_channels(x: Tensor, channels: int | None) -> Tensor:
    """1 -> 3 channels by repetition; 3 -> 1 by the ITU-R BT.601 luma weights; None: unchanged."""
    if channels is None or x.shape[1] == channels:
        return x
    if x.shape[1] == 1 and channels == 3:
        return x.repeat(1, 3, 1, 1)
    if x.shape[1] == 3 and channels == 1:
        weights = torch.tensor([0.299, 0.587, 0.114], dtype=x.dtype).view(1, 3, 1, 1)
        return (x * weights).sum(dim=1, keepdim=True)
    raise ValueError(f"data.options.channels: cannot turn {x.shape[1]} channels into {channels}; use 1 or 3")


def standardize(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    m = torch.tensor(list(mean), dtype=x.dtype)
    s = torch.tensor(list(std), dtype=x.dtype)
    if m.numel() == 1:
        m, s = m.repeat(x.shape[1]), s.repeat(x.shape[1])
    return (x - m.view(1, -1, 1, 1)) / s.view(1, -1, 1, 1)


def prepare(
    images: np.ndarray | Tensor, *, image_size: int | Sequence[int] | None = None, channels: int | None = None,
    normalize: bool = True, mean: Sequence[float] = (0.5,), std: Sequence[float] = (0.5,), scale: float = 255.0,
    flatten: bool = False,
) -> Tensor:
    """The whole chain: to float NCHW, resize, channels, standardise, optionally flatten."""
    x = set_channels(resize(to_float_nchw(images, scale=scale), image_size), channels)
    if normalize:
        x = standardize(x, mean, std)
    return x.reshape(x.shape[0], -1).contiguous() if flatten else x.contiguous()
