"""``vggface``: VGG-16 (configuration D) with a face-identity head (VGG-Face, 2,622 identities).

Architecture (Simonyan & Zisserman 2015, table 1 column D; Parkhi, Vedaldi & Zisserman,
"Deep Face Recognition", BMVC 2015): 13 3x3 convolutions with ReLU in five blocks
(64, 64 | 128, 128 | 256 x3 | 512 x3 | 512 x3), a 2x2 max-pool after each block, then
fc6 (512*7*7 -> 4096), fc7 (4096 -> 4096), fc8 (4096 -> identities), ReLU + dropout 0.5
after fc6 and fc7. No batch norm (VGG-Face has none).

Parameter names are torchvision's ``vgg16`` layout: ``features.{0,2,5,7,10,12,14,17,19,21,
24,26,28}`` for the convolutions, ``avgpool`` (adaptive, to ``pool_size`` x ``pool_size`` =
7x7, so any input resolution works: at 32x32 the 1x1 map is replicated to 7x7 exactly as
torchvision does), ``classifier.{0,3,6}`` for fc6-fc8.

Checkpoint layouts:
  * ``torchvision``: ``features.N.*`` / ``classifier.N.*`` (vgg16 state dicts, our own saves);
  * ``vggface``: the published VGG-Face weights converted to PyTorch - ``conv1_1 ... conv5_3``,
    ``fc6``, ``fc7``, ``fc8`` (Albanie's ``vgg_face_dag``; ``conv_1_1`` spelling of the Torch7
    conversion is accepted too, as is a ``features.``/``classifier.``-style name prefix).
    Fully-convolutional fc weights (fc6 as 4096x512x7x7, fc7/fc8 as ...x1x1 from Caffe) are
    reshaped to matrices; the (C, H, W) flattening order is the one torchvision's ``flatten``
    uses, so the reshaped layer computes the same function.

Options (for tests at small scale): ``width_divisor`` divides every conv width, ``hidden`` sets
fc6/fc7 width, ``pool_size`` the adaptive pool output; the defaults are the real VGG-Face
(138M parameters with 1000 classes; 145M with 2,622).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from torch import Tensor, nn

from pipeline.models.loading import Layout, StateDict, identity_layout, register_head, register_layout
from pipeline.models.registry import Preset, register_preset
from pipeline.tasks import DenseInputTask

# Configuration D: numbers are conv widths, "M" a 2x2 max-pool.
VGG16_CONFIG: tuple[int | str, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                                       512, 512, 512, "M", 512, 512, 512, "M")
# VGG-Face conv names in order, one per conv of configuration D.
VGGFACE_CONV_NAMES: tuple[str, ...] = tuple(
    f"conv{block}_{i}" for block, count in ((1, 2), (2, 2), (3, 3), (4, 3), (5, 3)) for i in range(1, count + 1)
)
VGGFACE_FC_TO_CLASSIFIER: dict[str, int] = {"fc6": 0, "fc7": 3, "fc8": 6}


def conv_feature_indices(config: tuple[int | str, ...] = VGG16_CONFIG) -> list[int]:
    """Indices of the Conv2d layers inside ``features`` (torchvision numbering: conv, ReLU, [pool])."""
    indices, position = [], 0
    for item in config:
        if item == "M":
            position += 1
        else:
            indices.append(position)
            position += 2
    return indices


class VGG16(nn.Module):
    """VGG-16 (D) with torchvision parameter names; ``embed(x)`` gives the fc7 face descriptor."""

    retrieval_method = "embed"  # evaluation: face-verification features come from self.embed(x)

    def __init__(
        self, *, num_classes: int = 2622, in_channels: int = 3, width_divisor: int = 1,
        hidden: int = 4096, pool_size: int = 7, dropout: float = 0.5,
    ) -> None:
        super().__init__()
        if width_divisor < 1 or 64 % width_divisor:
            raise ValueError(f"model.options.width_divisor must divide 64 (1, 2, 4, ...), got {width_divisor}")
        layers: list[nn.Module] = []
        channels = in_channels
        for item in VGG16_CONFIG:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                width = int(item) // width_divisor
                layers += [nn.Conv2d(channels, width, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
                channels = width
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((pool_size, pool_size))
        self.classifier = nn.Sequential(
            nn.Linear(channels * pool_size * pool_size, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )
        self._init_weights()

    def _init_weights(self) -> None:
        """torchvision's VGG initialisation (Kaiming-normal convs, N(0, 0.01) linears)."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
                nn.init.zeros_(module.bias)

    def embed(self, x: Tensor) -> Tensor:
        """The fc7 activations (the VGG-Face face descriptor, before the identity layer)."""
        x = self.avgpool(self.features(x)).flatten(1)
        return self.classifier[:-1](x)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier[-1](self.embed(x))


# ---------------------------------------------------------------------------------------------
# checkpoint layouts
# ---------------------------------------------------------------------------------------------
_CONV_RE = re.compile(r"(?:^|\.)conv_?(\d)_(\d)\.(weight|bias)$")
_FC_RE = re.compile(r"(?:^|\.)(fc[678])\.(weight|bias)$")


def _vggface_target(key: str) -> str | None:
    conv = _CONV_RE.search(key)
    if conv:
        name = f"conv{conv.group(1)}_{conv.group(2)}"
        if name not in VGGFACE_CONV_NAMES:
            return None
        return f"features.{conv_feature_indices()[VGGFACE_CONV_NAMES.index(name)]}.{conv.group(3)}"
    fc = _FC_RE.search(key)
    if fc:
        return f"classifier.{VGGFACE_FC_TO_CLASSIFIER[fc.group(1)]}.{fc.group(2)}"
    return None


def _detect_vggface(state: Mapping[str, Tensor], model: nn.Module) -> bool:
    return any(_CONV_RE.search(k) for k in state) and any(_FC_RE.search(k) for k in state)


def convert_vggface(state: Mapping[str, Tensor], model: nn.Module | None = None) -> StateDict:
    """VGG-Face names (conv1_1..conv5_3, fc6..fc8) -> torchvision names; fc kernels -> matrices.

    Keys that are not VGG-Face parameters are kept under their own names, so that the strict
    load reports them as unexpected instead of silently dropping them.
    """
    out: StateDict = {}
    for key, value in state.items():
        target = _vggface_target(key)
        if target is None:
            out[key] = value
            continue
        if target.startswith("classifier.") and target.endswith(".weight") and value.dim() == 4:
            value = value.reshape(value.shape[0], -1)  # (out, C, kH, kW) -> (out, C*kH*kW)
        if target in out:
            raise ValueError(f"two checkpoint keys map to '{target}' (second: '{key}')")
        out[target] = value
    return out


def to_vggface_names(state: Mapping[str, Tensor]) -> StateDict:
    """The inverse conversion (torchvision -> VGG-Face names), e.g. to export or to test."""
    back: dict[str, str] = {}
    for name, index in zip(VGGFACE_CONV_NAMES, conv_feature_indices()):
        for kind in ("weight", "bias"):
            back[f"features.{index}.{kind}"] = f"{name}.{kind}"
    for name, index in VGGFACE_FC_TO_CLASSIFIER.items():
        for kind in ("weight", "bias"):
            back[f"classifier.{index}.{kind}"] = f"{name}.{kind}"
    return {back.get(k, k): v for k, v in state.items()}


def _detect_torchvision(state: Mapping[str, Tensor], model: nn.Module) -> bool:
    return any(k.startswith("features.") for k in state) and any(k.startswith("classifier.") for k in state)


# ---------------------------------------------------------------------------------------------
# preset
# ---------------------------------------------------------------------------------------------
def build_vggface(
    *, num_classes: int = 2622, in_channels: int = 3, width_divisor: int = 1, hidden: int = 4096,
    pool_size: int = 7, dropout: float = 0.5, image_size: int = 224, **_: Any,
) -> nn.Module:
    """``image_size`` is recorded for data and perturbations; the adaptive pool accepts any size >= 32."""
    if image_size < 32:
        raise ValueError(f"model.options.image_size must be >= 32 (five 2x2 pools), got {image_size}")
    return VGG16(num_classes=num_classes, in_channels=in_channels, width_divisor=width_divisor,
                 hidden=hidden, pool_size=pool_size, dropout=dropout)


def vggface_task(*, label_smoothing: float = 0.0, **_: Any) -> DenseInputTask:
    return DenseInputTask(loss="cross_entropy", loss_options={"label_smoothing": label_smoothing} if label_smoothing else {})


register_layout("vggface", Layout("torchvision", _detect_torchvision, lambda s, m: dict(s),
                                  "torchvision vgg16 names: features.N / classifier.N"))
register_layout("vggface", Layout("vggface", _detect_vggface, convert_vggface,
                                  "VGG-Face converted to PyTorch: conv1_1..conv5_3, fc6, fc7, fc8"))
register_layout("vggface", identity_layout())
register_head("vggface", ("classifier.6.",))
register_preset(Preset(
    "vggface", build_vggface, vggface_task,
    {"weight_decay": 5e-4, "epochs": 30, "lr": 0.01, "batch_size": 64, "optimizer": "sgd"},
    "VGG-16 (D) face identity classifier, VGG-Face weights (2,622 identities)",
))
