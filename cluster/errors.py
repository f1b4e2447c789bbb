"""Errors of the cluster layer (no Ray import, so command lines can catch them cheaply)."""
from __future__ import annotations


class ClusterError(RuntimeError):
    """Base of the cluster layer's user-facing errors; messages name the option to change."""


class RuntimeConfigError(ClusterError, ValueError):
    """The Ray runtime was asked for something inconsistent."""


class PoolError(ClusterError):
    """A worker pool could not start its workers or finish a call."""
