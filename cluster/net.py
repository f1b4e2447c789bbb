"""Loopback networking helpers shared by the launchers (no Ray, no DeepSpeed import)."""
from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` right now (the OS picks it; a race with another process
    binding it before use is possible but harmless for rendezvous on loopback)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
