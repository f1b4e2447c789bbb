"""Small presets for tabular/low-resolution inputs: softmax regression, an MLP and a small CNN."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.models.registry import Preset, register_preset
from pipeline.tasks import DenseInputTask

ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}


def build_linear(*, in_features: int = 64, num_classes: int = 10, **_: Any) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, num_classes))


def build_mlp(
    *, in_features: int = 64, hidden: tuple[int, ...] | list[int] = (32,), num_classes: int = 10,
    activation: str = "tanh", **_: Any,
) -> nn.Module:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation '{activation}' is unknown; choose one of {sorted(ACTIVATIONS)}")
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, int(h)), ACTIVATIONS[activation]()]
        width = int(h)
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def build_small_cnn(
    *, in_channels: int = 1, num_classes: int = 10, width: int = 16, image_size: int = 28, **_: Any
) -> nn.Module:
    """conv(3x3)-relu-pool x2, then a linear head: a few tens of thousands of parameters."""
    feat = (image_size // 4) ** 2 * 2 * width
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(feat, 64), nn.ReLU(), nn.Linear(64, num_classes),
    )


def build_cnn(
    *, in_channels: int = 1, channels: tuple[int, ...] | list[int] = (16, 32, 64), pool: tuple[int, ...] | list[int] = (2, 2, 1),
    kernel: int = 3, hidden: tuple[int, ...] | list[int] = (128,), num_classes: int = 10, image_size: int = 28,
    activation: str = "relu", **_: Any,
) -> nn.Module:
    """A VGG-style CNN trained end to end: for each entry of ``channels`` a conv (``kernel`` x ``kernel``,
    same padding), the activation and a max-pool of the matching ``pool`` size (1: none); then flatten, the
    hidden Linear layers with the activation, and the output Linear. One ``nn.Sequential`` (the frozen-prefix
    splitter and the probe address its modules by index). Default: conv 1->16->32->64 with two 2x2 pools on
    28x28 inputs, fc 3136 -> 128 -> 10: 426k parameters in 5 trained layers."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"model.options.activation '{activation}' is unknown; choose one of {sorted(ACTIVATIONS)}")
    if len(pool) != len(channels) or any(int(p) < 1 for p in pool):
        raise ValueError(f"model.options.pool must give one pool size >= 1 per conv layer ({len(channels)}), got {list(pool)}")
    if int(kernel) < 1 or int(kernel) % 2 == 0:
        raise ValueError(f"model.options.kernel must be an odd size >= 1, got {kernel}")
    layers: list[nn.Module] = []
    width, size = int(in_channels), int(image_size)
    for c, p in zip(channels, pool):
        layers += [nn.Conv2d(width, int(c), int(kernel), padding=int(kernel) // 2), ACTIVATIONS[activation]()]
        if int(p) > 1:
            layers.append(nn.MaxPool2d(int(p)))
            size //= int(p)
        width = int(c)
    if size < 1:
        raise ValueError(f"model.options.pool: pooling leaves no pixel of a {image_size}x{image_size} image")
    layers.append(nn.Flatten())
    features = width * size * size
    for h in hidden:
        layers += [nn.Linear(features, int(h)), ACTIVATIONS[activation]()]
        features = int(h)
    layers.append(nn.Linear(features, int(num_classes)))
    return nn.Sequential(*layers)


def build_random_conv_mlp(
    *, in_channels: int = 1, channels: int = 32, kernel: int = 5, pool: int = 4, seed: int = 0, image_size: int = 28,
    hidden: tuple[int, ...] | list[int] = (128,), num_classes: int = 10, activation: str = "relu", **_: Any,
) -> nn.Module:
    """The frozen seeded random conv trunk of ``pipeline.features`` (conv k x k, C channels, ReLU,
    max-pool p, flatten: C ((image_size - k + 1) // p)^2 features) followed by a trainable MLP head:
    bench/forgetting.py's Fashion-MNIST model as one network (module 0 = the trunk)."""
    from pipeline.features import random_conv_trunk

    trunk = random_conv_trunk(in_channels=in_channels, channels=channels, kernel=kernel, pool=pool, seed=seed)
    features = channels * ((image_size - kernel + 1) // pool) ** 2
    head = build_mlp(in_features=features, hidden=hidden, num_classes=num_classes, activation=activation)
    return nn.Sequential(trunk, *list(head)[1:])  # the trunk flattens already


def _classification_task(*, label_smoothing: float = 0.0, **_: Any) -> DenseInputTask:
    opts = {"label_smoothing": label_smoothing} if label_smoothing else {}
    return DenseInputTask(loss="cross_entropy", loss_options=opts)


register_preset(Preset("linear", build_linear, _classification_task,
                       {"weight_decay": 0.01, "epochs": 200, "lr": 0.5, "batch_size": 0},
                       "softmax regression (convex)"))
register_preset(Preset("mlp", build_mlp, _classification_task,
                       {"weight_decay": 0.01, "epochs": 300, "lr": 0.1, "batch_size": 0},
                       "multilayer perceptron"))
register_preset(Preset("cnn", build_cnn, _classification_task,
                       {"weight_decay": 5e-4, "epochs": 4, "lr": 0.05, "batch_size": 128},
                       "VGG-style CNN trained end to end (conv stack + MLP head; 28x28 grey images by default)"))
register_preset(Preset("random-conv-mlp", build_random_conv_mlp, _classification_task,
                       {"weight_decay": 5e-4, "epochs": 6, "lr": 0.05, "batch_size": 128},
                       "frozen random conv trunk + MLP head (28x28 grey images)"))
register_preset(Preset("small-cnn", build_small_cnn, _classification_task,
                       {"weight_decay": 5e-4, "epochs": 5, "lr": 0.05, "batch_size": 128},
                       "two-conv CNN for 28x28 images"))
