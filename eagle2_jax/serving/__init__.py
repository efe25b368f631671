"""Serving: continuous batching of EAGLE-2 rounds over slots (engine.Engine); the engine knows
nothing of HTTP."""
from .engine import Engine, Request, compile_programs

__all__ = ["Engine", "Request", "compile_programs"]
