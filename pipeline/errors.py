"""The errors a removal raises that callers act on (every layer reads these, none defines them twice).

  ``NonFiniteGradientError``  a gradient or curvature product contained NaN or infinity
  ``RemovalNotServed``        a local step cannot serve the request: nothing was published, the
                              model is as it was, and the request goes to retraining (a verdict,
                              not a failure: campaigns record it as ``needs_retrain``)
  ``UnsolvedSystemError``     the Newton system was not solved to its stated tolerance (a
                              ``RemovalNotServed``: a step from it would be an arbitrary direction)
"""
from __future__ import annotations

__all__ = ["NonFiniteGradientError", "RemovalNotServed", "UnsolvedSystemError"]


class NonFiniteGradientError(FloatingPointError):
    """A gradient or curvature product contained NaN or infinity."""


class RemovalNotServed(ValueError):
    """A local (Newton) step cannot serve this removal request: nothing was published, the
    model is as it was, and the request should go to retraining. ``reason`` says why in one
    sentence; ``diagnostics`` holds the numbers behind it (strict-JSON-ready)."""

    def __init__(self, reason: str, diagnostics: dict | None = None):
        super().__init__(reason)
        self.reason = reason
        self.diagnostics = dict(diagnostics or {})


class UnsolvedSystemError(RemovalNotServed):
    """The Newton system (H' + damping I) x = g was not solved to the stated tolerance."""
