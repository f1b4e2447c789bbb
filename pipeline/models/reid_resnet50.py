"""``reid-resnet50``: ResNet-50 backbone + BNNeck + identity classifier for person re-ID.

Backbone: He et al., "Deep Residual Learning", CVPR 2016 (ResNet-50: Bottleneck blocks
[3, 4, 6, 3], expansion 4, stride on the 3x3 conv as in torchvision "ResNet v1.5"), written
here with torchvision's parameter names (``conv1``, ``bn1``, ``layer1.0.conv1``, ...,
``layerK.0.downsample.{0,1}``) so torchvision / torchreid backbone weights load unchanged.

Head (Luo et al., "Bag of Tricks and A Strong Baseline for Deep Person Re-identification",
CVPRW 2019): global average pooling -> f_t; BNNeck ``bottleneck`` = BatchNorm1d with its shift
(bias) frozen at 0 -> f_i; ``classifier`` = Linear(f_i -> identities, no bias); last stride 1;
label-smoothed cross-entropy with epsilon = 0.1:
    q_k = (1 - eps) [k = y] + eps / K,   loss = -sum_k q_k log p_k.
Retrieval uses ``features(x)`` = f_i (after the BNNeck, as the paper does at test time).
Default: 751 identities (Market-1501 training set); 23.5M backbone parameters.

Checkpoint layouts:
  * ``native``: our names (== torchvision ResNet names + ``bottleneck.*`` + ``classifier.*``);
  * ``torchreid``: torchreid's ``resnet50``: ``{"state_dict": ...}`` (unwrapped on read) whose
    keys may carry ``module.``; backbone names as ours; its BNNeck-free head is
    ``classifier.{weight,bias}`` (build with ``neck="none", classifier_bias=True``) and an
    optional ``global_avgpool`` (no parameters);
  * ``strong-baseline``: Luo et al.'s code: ``base.`` prefix on the backbone, ``bottleneck.*``,
    ``classifier.weight``;
  * ``torchvision``: ImageNet ResNet-50 (``fc.*`` head): load with ``scope="backbone"``, which
    drops ``fc.*`` and keeps our fresh neck and classifier.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from torch import Tensor, nn

from pipeline.models.loading import Layout, StateDict, identity_layout, register_head, register_layout
from pipeline.models.registry import Preset, register_preset
from pipeline.tasks import DenseInputTask

RESNET50_LAYERS: tuple[int, int, int, int] = (3, 4, 6, 3)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (stride here, v1.5) -> 1x1 expand (x4), BN after each, identity/projection shortcut."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        out = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ReIDResNet(nn.Module):
    """ResNet backbone (torchvision names) + optional BNNeck + identity classifier."""

    retrieval_method = "features"  # evaluation: retrieval features come from self.features(x)

    def __init__(
        self, *, num_classes: int = 751, layers: Sequence[int] = RESNET50_LAYERS, width: int = 64,
        in_channels: int = 3, last_stride: int = 1, neck: str = "bnneck", classifier_bias: bool = False,
    ) -> None:
        super().__init__()
        if len(layers) != 4 or any(int(n) < 1 for n in layers):
            raise ValueError(f"model.options.layers must be four block counts >= 1, got {list(layers)}")
        if neck not in NECKS:
            raise ValueError(f"model.options.neck '{neck}' is unknown; choose one of {sorted(NECKS)}")
        self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        channels = width
        strides = (1, 2, 2, last_stride)
        for stage, (blocks, stride) in enumerate(zip(layers, strides), start=1):
            stage_width = width * 2 ** (stage - 1)
            stage_modules, channels = _make_stage(channels, stage_width, int(blocks), stride)
            self.add_module(f"layer{stage}", stage_modules)
        self.feature_dim = channels
        self.global_avgpool = nn.AdaptiveAvgPool2d(1)
        NECKS[neck](self, channels)
        self.classifier = nn.Linear(channels, num_classes, bias=classifier_bias)
        self._init_weights()

    def _init_weights(self) -> None:
        """Kaiming-normal convs, BN (1, 0); classifier N(0, 0.001) as in Luo et al."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, (nn.BatchNorm2d, nn.BatchNorm1d)):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.classifier.weight, 0.0, 0.001)
        if self.classifier.bias is not None:
            nn.init.zeros_(self.classifier.bias)

    def backbone(self, x: Tensor) -> Tensor:
        """f_t: the globally average-pooled last feature map."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.global_avgpool(x).flatten(1)

    def features(self, x: Tensor) -> Tensor:
        """Retrieval features f_i (after the neck; the neck is the identity when neck='none')."""
        return self.bottleneck(self.backbone(x)) if self.bottleneck is not None else self.backbone(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


def _make_stage(in_channels: int, width: int, blocks: int, stride: int) -> tuple[nn.Sequential, int]:
    out = width * Bottleneck.expansion
    downsample = None
    if stride != 1 or in_channels != out:
        downsample = nn.Sequential(nn.Conv2d(in_channels, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
    modules = [Bottleneck(in_channels, width, stride, downsample)]
    modules += [Bottleneck(out, width) for _ in range(blocks - 1)]
    return nn.Sequential(*modules), out


def _bnneck(model: ReIDResNet, channels: int) -> None:
    """BatchNorm1d whose shift is frozen at zero (Luo et al. 2019, section 4.2)."""
    model.bottleneck = nn.BatchNorm1d(channels)
    model.bottleneck.bias.requires_grad_(False)


def _no_neck(model: ReIDResNet, channels: int) -> None:
    model.bottleneck = None


NECKS = {"bnneck": _bnneck, "none": _no_neck}


# ---------------------------------------------------------------------------------------------
# checkpoint layouts
# ---------------------------------------------------------------------------------------------
def _backbone_key(key: str) -> bool:
    return key.startswith(("conv1.", "bn1.", "layer1.", "layer2.", "layer3.", "layer4."))


def _detect_torchreid(state: Mapping[str, Tensor], model: nn.Module) -> bool:
    return any(_backbone_key(k) for k in state) and "classifier.weight" in state and "fc.weight" not in state


def _convert_torchreid(state: StateDict, model: nn.Module) -> StateDict:
    """torchreid: backbone names are ours; ``global_avgpool`` holds nothing; a ``fc.*``
    embedding block (fc_dims) is not part of this preset and stays, to be reported as unexpected."""
    return dict(state)


def _detect_strong_baseline(state: Mapping[str, Tensor], model: nn.Module) -> bool:
    return any(k.startswith("base.") for k in state)


def _convert_strong_baseline(state: StateDict, model: nn.Module) -> StateDict:
    return {(k[len("base."):] if k.startswith("base.") else k): v for k, v in state.items()}


def _detect_torchvision(state: Mapping[str, Tensor], model: nn.Module) -> bool:
    return "fc.weight" in state and any(_backbone_key(k) for k in state)


def _convert_torchvision(state: StateDict, model: nn.Module) -> StateDict:
    """ImageNet head ``fc.*`` renamed to ``classifier.*`` (head scope: dropped with scope='backbone')."""
    return {("classifier." + k[3:] if k.startswith("fc.") else k): v for k, v in state.items()}


# ---------------------------------------------------------------------------------------------
# preset
# ---------------------------------------------------------------------------------------------
def build_reid_resnet50(
    *, num_classes: int = 751, layers: Sequence[int] = RESNET50_LAYERS, width: int = 64, in_channels: int = 3,
    last_stride: int = 1, neck: str = "bnneck", classifier_bias: bool = False, image_size: int = 256, **_: Any,
) -> nn.Module:
    """``image_size`` (height; re-ID crops are usually 256x128) is recorded for data and probes."""
    if image_size < 16:
        raise ValueError(f"model.options.image_size must be >= 16, got {image_size}")
    return ReIDResNet(num_classes=num_classes, layers=tuple(int(n) for n in layers), width=width,
                      in_channels=in_channels, last_stride=last_stride, neck=neck, classifier_bias=classifier_bias)


def reid_task(*, label_smoothing: float = 0.1, **_: Any) -> DenseInputTask:
    return DenseInputTask(loss="cross_entropy", loss_options={"label_smoothing": float(label_smoothing)})


def count_backbone_parameters(model: ReIDResNet) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if _backbone_key(name))


register_layout("reid-resnet50", identity_layout("native", "our names: torchvision ResNet + bottleneck + classifier"))
register_layout("reid-resnet50", Layout("torchreid", _detect_torchreid, _convert_torchreid,
                                        "torchreid resnet50 (state_dict entry, module. prefix, classifier)"))
register_layout("reid-resnet50", Layout("strong-baseline", _detect_strong_baseline, _convert_strong_baseline,
                                        "Luo et al. reid-strong-baseline: base.* + bottleneck + classifier"))
register_layout("reid-resnet50", Layout("torchvision", _detect_torchvision, _convert_torchvision,
                                        "torchvision ImageNet resnet50 (fc head; load with scope='backbone')"))
register_head("reid-resnet50", ("classifier.", "bottleneck."))
register_preset(Preset(
    "reid-resnet50", build_reid_resnet50, reid_task,
    {"weight_decay": 5e-4, "epochs": 120, "lr": 0.035, "batch_size": 64, "optimizer": "sgd"},
    "ResNet-50 + BNNeck person re-ID identity classifier (751 identities, label smoothing 0.1)",
))

__all__ = ["ReIDResNet", "Bottleneck", "build_reid_resnet50", "reid_task", "count_backbone_parameters"]
