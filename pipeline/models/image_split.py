"""Where the image presets that are not one ``nn.Sequential`` divide for a removal
(``pipeline.frozen_prefix``): VGG-16 (``vggface``) and the re-ID ResNet (``reid-resnet50``).

Both are chains of modules run in order:
  VGG16:       features.0 .. features.K -> avgpool -> flatten -> classifier.0 .. classifier.6
  ReIDResNet:  conv1 -> bn1 -> relu -> maxpool -> layer1.0 .. layer4.B (Bottlenecks) -> global_avgpool
               -> flatten -> bottleneck (BNNeck, optional) -> classifier
A block whose parameters all lie at or after one link of the chain (a ``features``/``classifier``
entry of VGG; a Bottleneck, the neck or the classifier of the ResNet) divides the model there: the
prefix (every link before it) maps an image batch to that link's input, run once with no gradient in
the caller's (eval) mode; the suffix is the model's own module objects from that link on, under
their qualified names (``classifier.3.weight``, ``layer4.2.conv3.weight``), so a block or a gradient
means the same coordinates on the model and on the suffix. A block that reaches the first link
(``features.0``; ``conv1``/``bn1``) has nothing before it to cache: no split.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from pipeline.frozen_prefix import Split, register_splitter
from pipeline.models.reid_resnet50 import ReIDResNet
from pipeline.models.vggface import VGG16
from pipeline.param_block import ParamBlock
from pipeline.tasks import Batch, Task

__all__ = ["ResNetSuffix", "VGGSuffix", "reid_split", "vgg_split"]


def _tail(sequence: nn.Sequential, start: int) -> nn.Sequential:
    """The entries of ``sequence`` from index ``start`` on, under their own keys."""
    return nn.Sequential(OrderedDict(list(sequence._modules.items())[start:]))


class VGGSuffix(nn.Module):
    """VGG-16 from ``features.start`` (part "features") or ``classifier.start`` (part "classifier") on."""

    def __init__(self, model: VGG16, part: str, start: int):
        super().__init__()
        self.part = part
        if part == "features":
            self.features = _tail(model.features, start)
            self.avgpool = model.avgpool
            self.classifier = model.classifier
        else:
            self.classifier = _tail(model.classifier, start)

    def forward(self, x: Tensor) -> Tensor:
        if self.part == "features":
            x = self.avgpool(self.features(x)).flatten(1)
        return self.classifier(x)


def _first_index(names: list[str], part: str) -> int | None:
    found = [int(n[len(part) + 1:].split(".", 1)[0]) for n in names if n.startswith(part + ".")]
    return min(found) if found else None


@register_splitter
def vgg_split(model: nn.Module, task: Task, block: ParamBlock) -> Split | None:
    if not isinstance(model, VGG16) or getattr(task, "kind", None) != "dense":
        return None
    names = [part.name for part in block.parts]
    if any(not n.startswith(("features.", "classifier.")) for n in names):
        return None
    first_feature = _first_index(names, "features")
    if first_feature is not None:
        if first_feature == 0:
            return None
        part, start = "features", first_feature
    else:
        part, start = "classifier", _first_index(names, "classifier")
        assert start is not None

    def prefix(m: nn.Module, batch: Batch) -> Batch:
        x = batch["x"]
        if part == "features":
            return {"x": m.features[:start](x)}
        x = m.avgpool(m.features(x)).flatten(1)
        return {"x": m.classifier[:start](x)}

    return Split(f"{part}.{start}", prefix, lambda m: VGGSuffix(m, part, start), task, ("x",))


class ResNetSuffix(nn.Module):
    """The re-ID ResNet from Bottleneck ``layer{stage}.{index}`` (stage 1-4), from the neck (stage
    "bottleneck") or from the classifier (stage "classifier") on."""

    def __init__(self, model: ReIDResNet, stage: int | str, index: int = 0):
        super().__init__()
        self.stage = stage
        if isinstance(stage, int):
            for s in range(stage, 5):
                layer = getattr(model, f"layer{s}")
                setattr(self, f"layer{s}", _tail(layer, index) if s == stage else layer)
            self.global_avgpool = model.global_avgpool
        if stage != "classifier":
            self.bottleneck = model.bottleneck
        self.classifier = model.classifier

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.stage, int):
            for s in range(self.stage, 5):
                x = getattr(self, f"layer{s}")(x)
            x = self.global_avgpool(x).flatten(1)
        if self.stage != "classifier" and self.bottleneck is not None:
            x = self.bottleneck(x)
        return self.classifier(x)


@register_splitter
def reid_split(model: nn.Module, task: Task, block: ParamBlock) -> Split | None:
    if not isinstance(model, ReIDResNet) or getattr(task, "kind", None) != "dense":
        return None
    names = [part.name for part in block.parts]
    places: list[tuple[int, int]] = []  # (stage, block index); the neck (5, 0), the classifier (6, 0)
    for n in names:
        head = n.split(".", 1)[0]
        if head.startswith("layer") and head[5:].isdigit():
            places.append((int(head[5:]), int(n.split(".")[1])))
        elif head == "bottleneck":
            places.append((5, 0))
        elif head == "classifier":
            places.append((6, 0))
        else:
            return None  # the stem (conv1, bn1): nothing before the block to cache
    stage, index = min(places)
    if stage <= 4:
        start: int | str = stage

        def prefix(m: nn.Module, batch: Batch) -> Batch:
            x = m.maxpool(m.relu(m.bn1(m.conv1(batch["x"]))))
            for s in range(1, stage):
                x = getattr(m, f"layer{s}")(x)
            return {"x": getattr(m, f"layer{stage}")[:index](x)}

        return Split(f"layer{stage}.{index}", prefix, lambda m: ResNetSuffix(m, stage, index), task, ("x",))
    where = "bottleneck" if stage == 5 else "classifier"

    def head_prefix(m: nn.Module, batch: Batch) -> Batch:
        return {"x": m.backbone(batch["x"]) if where == "bottleneck" else m.features(batch["x"])}

    return Split(where, head_prefix, lambda m: ResNetSuffix(m, where), task, ("x",))
