"""Serving: continuous batching of EAGLE-2 rounds over slots (engine.Engine); the engine knows
nothing of HTTP."""
from .engine import Engine, Request

__all__ = ["Engine", "Request"]
