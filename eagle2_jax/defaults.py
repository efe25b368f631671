"""Per-backend defaults shared by the library and the command line.

dtype: bfloat16 weights and caches on GPU/TPU (where bf16 matmuls are native and a step is bound by
reading weights), float32 on CPU (XLA:CPU's bf16 dots are slow; the CPU backend's kernels and packed
GGUF blocks are float32).

tree: a head's `tree.json` may give one tree per platform ({"cpu": {...}, "gpu": {...}, "tpu": {...}})
or one flat tree (tuned on the CPU it was measured on: used there only). Without one, the
reference tree (depth 5, top_k 10, 60 tokens) everywhere: on GPU/TPU extra verified rows are nearly
free. `tree="auto"` (library) / `--total-tokens auto` (CLI) instead times rounds on the machine at
hand. `autotune.resolve_tree` combines these with the caller's fields.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import jax

from .config import TreeConfig

REFERENCE_TREE = TreeConfig(5, 10, 60)
TREE_FILE = "tree.json"


def platform(backend: Optional[str] = None) -> str:
    """'cpu', 'gpu' or 'tpu' for a JAX backend name (default: the default backend)."""
    b = backend or jax.default_backend()
    return "gpu" if b in ("gpu", "cuda", "rocm") else b


def default_dtype(backend: Optional[str] = None) -> str:
    return "float32" if platform(backend) == "cpu" else "bfloat16"


def head_tree(source: Optional[str], backend: Optional[str] = None) -> dict:
    """The tree fields a head's tree.json gives for this platform ({} when none)."""
    path = os.path.join(source or "", TREE_FILE)
    if not source or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt {path}: {e}") from None
    keys = ("depth", "top_k", "total_tokens")
    if any(k in d for k in keys):  # one flat tree: the CPU's
        d = d if platform(backend) == "cpu" else {}
    else:
        d = d.get(platform(backend), {})
    return {k: v for k, v in d.items() if k in keys}
