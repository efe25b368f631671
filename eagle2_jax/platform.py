"""The platform the programs run on, and what differs by it (the default dtype).

dtype: bfloat16 weights and caches on GPU/TPU (where bf16 matmuls are native and a step is bound by
reading weights), float32 on CPU (XLA:CPU's bf16 dots are slow; the CPU backend's kernels and packed
GGUF blocks are float32).
"""
from __future__ import annotations

from typing import Optional

import jax


def platform(backend: Optional[str] = None) -> str:
    """'cpu', 'gpu' or 'tpu' for a JAX backend name (default: the default backend)."""
    b = backend or jax.default_backend()
    return "gpu" if b in ("gpu", "cuda", "rocm") else b


def default_dtype(backend: Optional[str] = None) -> str:
    return "float32" if platform(backend) == "cpu" else "bfloat16"
