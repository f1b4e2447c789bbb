"""The eval-mode guard every removal runs under (dropout off, batch-norm statistics fixed).

``eval_mode_restored(model)``: eval mode for the duration of the block; afterwards each module's
own mode and every buffer are restored, also on error. ``pipeline.methods.base`` applies it once
around a method's preparation and removal, so the methods never copy it."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

__all__ = ["eval_mode_restored"]


@contextlib.contextmanager
def eval_mode_restored(model: nn.Module) -> Iterator[None]:
    """Eval mode for the duration; each module's mode and every buffer restored afterwards."""
    modes = {name: m.training for name, m in model.named_modules()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.eval()
    try:
        yield
    finally:
        for name, m in model.named_modules():
            m.training = modes[name]
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
