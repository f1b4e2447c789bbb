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
register_preset(Preset("random-conv-mlp", build_random_conv_mlp, _classification_task,
                       {"weight_decay": 5e-4, "epochs": 6, "lr": 0.05, "batch_size": 128},
                       "frozen random conv trunk + MLP head (28x28 grey images)"))
register_preset(Preset("small-cnn", build_small_cnn, _classification_task,
                       {"weight_decay": 5e-4, "epochs": 5, "lr": 0.05, "batch_size": 128},
                       "two-conv CNN for 28x28 images"))
