"""Seeded synthetic person images with identity labels (``synthetic-identities``): the re-ID stand-in
that installs offline (no package ships person re-ID images; shared/ENV.md).

Each identity i has a fixed appearance, drawn once from ``seed``:
  * clothing: an upper-body and a lower-body colour, each a palette colour (``palette`` colours
    shared by all identities, so many people wear similar colours) plus a small personal offset;
  * a personal texture: a low-resolution random pattern (3 x 8 x 4) upsampled over the body, of
    amplitude ``texture``;
  * a skin/hair tone and a body build (torso width, leg length, head size).
Each image of the identity is rendered with its own nuisance draws (image-level generator seeded by
the identity and the image's index, so an image never depends on how many others were made):
  * pose: facing left or right (the person, texture included, mirrored) and legs apart or together;
  * shift and scale: the person moved by up to ``shift`` of the width / height and scaled 0.85-1.1;
  * colour: illumination (brightness x0.6-1.4), a per-channel camera cast (+-``colour``) and contrast;
  * background: a random low-frequency clutter pattern;
  * occlusion: with probability ``occlusion`` a random rectangle (10-35 % of the image) of another colour;
  * pixel noise of std ``noise``.
Identities are therefore not separable by colour alone (shared palette, colour casts, occlusions):
a network has to combine colours, texture and build, and a held-out image is a new draw of the same
person. Images are (3, H, W) floats standardised to about zero mean and unit variance.

Splits (ids are stable: sample id = identity * per_identity_total + image index):
  ``train``  the first ``per_id_train`` images of every identity,
  ``test``   the next ``per_id_test`` images of every identity (held out: queries and gallery for
             retrieval, test accuracy for classification).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from pipeline.data.sampleset import SampleSet
from pipeline.data.sources import register_source

# the standardisation applied to every image (measured on the default generator: about mean 0, std 1)
MEAN, STD = -0.01, 0.74


def _palette(count: int, g: torch.Generator) -> torch.Tensor:
    """``count`` colours in [-1, 1]^3, spread out (farthest-point picks among random candidates)."""
    candidates = torch.rand(max(64, 8 * count), 3, generator=g) * 2 - 1
    picked = [0]
    dist = torch.cdist(candidates, candidates[:1]).squeeze(1)
    for _ in range(count - 1):
        j = int(torch.argmax(dist))
        picked.append(j)
        dist = torch.minimum(dist, torch.cdist(candidates, candidates[j:j + 1]).squeeze(1))
    return candidates[picked]


def _identity_appearance(ids: int, seed: int, palette: int, texture: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(seed) * 7919 + 17)
    colours = _palette(palette, g)
    upper = colours[torch.randint(palette, (ids,), generator=g)] + 0.15 * torch.randn(ids, 3, generator=g)
    lower = colours[torch.randint(palette, (ids,), generator=g)] + 0.15 * torch.randn(ids, 3, generator=g)
    skin = torch.tensor([0.6, 0.2, -0.1]) + 0.25 * torch.randn(ids, 3, generator=g)
    pattern = texture * torch.randn(ids, 3, 8, 4, generator=g)
    build = torch.stack([0.55 + 0.2 * torch.rand(ids, generator=g),     # torso width (share of the image width)
                         0.38 + 0.1 * torch.rand(ids, generator=g),     # leg length (share of the height)
                         0.12 + 0.05 * torch.rand(ids, generator=g)], 1)  # head height (share of the height)
    return {"upper": upper, "lower": lower, "skin": skin, "pattern": pattern, "build": build}


def _render(app: dict[str, torch.Tensor], person: int, index: int, height: int, width: int, seed: int, *,
            shift: float, colour: float, occlusion: float, noise: float) -> torch.Tensor:
    """One image (3, H, W) of ``person`` (its ``index``-th draw of the nuisances)."""
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + person) * 10_007 + index)
    H, W = height, width
    ys = (torch.arange(H, dtype=torch.float32) + 0.5) / H
    xs = (torch.arange(W, dtype=torch.float32) + 0.5) / W
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    u = torch.rand(12, generator=g)
    scale = 0.85 + 0.25 * float(u[0])
    cx = 0.5 + shift * (2 * float(u[1]) - 1)
    top = 0.06 + shift * (2 * float(u[2]) - 1)
    flip = bool(u[3] < 0.5)
    legs_apart = bool(u[4] < 0.5)
    torso_w, leg_len, head_h = (float(v) for v in app["build"][person])
    torso_h = max(0.2, 0.86 - head_h - leg_len) * scale
    head_h, leg_len = head_h * scale, leg_len * scale
    # body parts as 0/1 masks
    head_y = top + head_h / 2
    head = ((((yy - head_y) / (head_h / 2)) ** 2 + ((xx - cx) / (0.18 * scale)) ** 2) <= 1).float()
    torso_top, torso_bot = top + head_h, top + head_h + torso_h
    torso = ((yy >= torso_top) & (yy < torso_bot) & ((xx - cx).abs() <= torso_w * scale / 2)).float()
    leg_top, leg_bot = torso_bot, min(0.99, torso_bot + leg_len)
    spread = 0.12 * scale if legs_apart else 0.05 * scale
    in_legs = (yy >= leg_top) & (yy < leg_bot)
    frac = ((yy - leg_top) / max(leg_bot - leg_top, 1e-6)).clamp(0, 1)
    left_c, right_c = cx - 0.11 * scale - spread * frac, cx + 0.11 * scale + spread * frac
    legs = (in_legs & (((xx - left_c).abs() <= 0.1 * scale) | ((xx - right_c).abs() <= 0.1 * scale))).float()
    # appearance: clothing colours + personal texture (mirrored with the pose)
    pattern = app["pattern"][person]
    if flip:
        pattern = pattern.flip(-1)
    tex = F.interpolate(pattern[None], size=(H, W), mode="bilinear", align_corners=False)[0]
    upper = app["upper"][person].view(3, 1, 1) + tex
    lower = app["lower"][person].view(3, 1, 1) + 0.5 * tex
    skin = app["skin"][person].view(3, 1, 1)
    # background clutter: a low-frequency random pattern around a random tint
    bg = 0.5 * torch.randn(3, 1, 1, generator=g) + 0.6 * F.interpolate(
        torch.randn(1, 3, 4, 2, generator=g), size=(H, W), mode="bilinear", align_corners=False)[0]
    img = bg * (1 - torch.clamp(head + torso + legs, max=1.0))
    img = img + skin * head + upper * torso * (1 - head) + lower * legs * (1 - torso) * (1 - head)
    if flip:  # a small asymmetric mark (a bag strap): pose changes what is where
        strap = (((xx - (cx + 0.15 * scale)).abs() < 0.05) & (yy >= torso_top) & (yy < torso_bot)).float()
        img = img * (1 - 0.5 * strap)
    # occlusion by another object
    if float(u[5]) < occlusion:
        area = 0.10 + 0.25 * float(u[6])
        oh = min(1.0, math.sqrt(area) * (0.6 + 0.8 * float(u[7])))
        ow = min(1.0, area / oh)
        oy, ox = float(u[8]) * (1 - oh), float(u[9]) * (1 - ow)
        box = ((yy >= oy) & (yy < oy + oh) & (xx >= ox) & (xx < ox + ow)).float()
        img = img * (1 - box) + box * (torch.rand(3, 1, 1, generator=g) * 2 - 1)
    # illumination, camera colour cast, contrast, sensor noise
    brightness = 0.6 + 0.8 * float(u[10])
    contrast = 0.7 + 0.6 * float(u[11])
    cast = colour * (2 * torch.rand(3, 1, 1, generator=g) - 1)
    mean = img.mean()
    img = (img - mean) * contrast + mean
    img = img * brightness + cast
    img = img + noise * torch.randn(3, H, W, generator=g)
    return (img - MEAN) / STD


@functools.lru_cache(maxsize=4)
def _generate(ids: int, per_id_train: int, per_id_test: int, height: int, width: int, seed: int, palette: int,
              texture: float, shift: float, colour: float, occlusion: float, noise: float) -> dict[str, SampleSet]:
    app = _identity_appearance(ids, seed, palette, texture)
    total = per_id_train + per_id_test
    images = torch.empty(ids * total, 3, height, width)
    for person in range(ids):
        for index in range(total):
            images[person * total + index] = _render(app, person, index, height, width, seed, shift=shift,
                                                     colour=colour, occlusion=occlusion, noise=noise)
    labels = torch.arange(ids).repeat_interleave(total)
    sample_ids = torch.arange(ids * total, dtype=torch.long)
    index = torch.arange(total).repeat(ids)
    out = {}
    for split, keep in (("train", index < per_id_train), ("test", index >= per_id_train)):
        rows = torch.nonzero(keep).squeeze(1)
        out[split] = SampleSet({"x": images[rows].contiguous(), "y": labels[rows].clone()}, sample_ids[rows].clone())
    return out


@register_source("synthetic-identities")
def synthetic_identities(
    *, ids: int = 128, per_id_train: int = 24, per_id_test: int = 8, height: int = 64, width: int = 32, seed: int = 0,
    palette: int = 8, texture: float = 0.35, shift: float = 0.08, colour: float = 0.25, occlusion: float = 0.3,
    noise: float = 0.15,
) -> dict[str, SampleSet]:
    """Splits ``train`` / ``test`` of seeded synthetic person images (module docstring). x float32
    (N, 3, height, width), y int64 identity in 0..ids-1. Options: ids, per_id_train, per_id_test, height,
    width, seed and the nuisance strengths palette, texture, shift, colour, occlusion, noise."""
    for name, value, low in (("ids", ids, 2), ("per_id_train", per_id_train, 1), ("per_id_test", per_id_test, 0),
                             ("height", height, 8), ("width", width, 4), ("palette", palette, 1)):
        if int(value) < low:
            raise ValueError(f"data.options.{name} must be an integer >= {low}, got {value}")
    for name, value in (("texture", texture), ("shift", shift), ("colour", colour), ("noise", noise)):
        if not (math.isfinite(float(value)) and float(value) >= 0):
            raise ValueError(f"data.options.{name} must be a number >= 0, got {value}")
    if not 0 <= float(occlusion) <= 1:
        raise ValueError(f"data.options.occlusion is a probability in [0, 1], got {occlusion}")
    splits = _generate(int(ids), int(per_id_train), int(per_id_test), int(height), int(width), int(seed),
                       int(palette), float(texture), float(shift), float(colour), float(occlusion), float(noise))
    return dict(splits)
