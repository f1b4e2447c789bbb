"""Model presets (importing this package registers them) and checkpoint loaders."""
from pipeline.models import reid_resnet50, small, text, text_mean_mlp, text_split, vggface  # noqa: F401
from pipeline.models import image_split  # noqa: F401  (splitters of vggface and reid-resnet50)
from pipeline.models.loading import LAYOUTS, LoadReport, load_checkpoint, read_checkpoint
from pipeline.models.registry import PRESETS, Preset, build, get_preset, register_preset

__all__ = [
    "PRESETS", "Preset", "build", "get_preset", "register_preset",
    "LAYOUTS", "LoadReport", "load_checkpoint", "read_checkpoint",
]
