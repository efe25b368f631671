"""KV caches as explicit pytrees.

A cache holds, per layer, keys and values [B, K, S, Dh] and a per-row committed length [B].
Slots >= length are scratch: a forward pass writes its new tokens there (a verified tree's N
nodes, the draft's tree nodes) and attends to them through its mask; committing only moves the
length. For a verified tree, `compact` first moves the accepted path's entries to the slots
right after the committed prefix (EAGLE's compaction), then advances the length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from .layers import write_rows


@struct.dataclass
class KVCache:
    k: tuple  # L x [B, K, S, Dh]
    v: tuple  # L x [B, K, S, Dh]
    length: jax.Array  # [B] int32, committed slots per row

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def init_cache(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
               dtype) -> KVCache:
    shape = (batch, num_kv_heads, max_len, head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    return KVCache(k=tuple(zeros() for _ in range(num_layers)),
                   v=tuple(zeros() for _ in range(num_layers)),
                   length=jnp.zeros((batch,), jnp.int32))


def advance(cache: KVCache, n_B: jax.Array) -> KVCache:
    """Commit the first n[b] scratch slots of each row."""
    return cache.replace(length=cache.length + n_B.astype(jnp.int32))


def compact(cache: KVCache, path_BC: jax.Array, n_B: jax.Array) -> KVCache:
    """Move scratch slots length+path[b, d] to length+d (d < C), then commit n[b] of them."""
    src = cache.length[:, None] + path_BC  # [B, C]

    def move(buf):
        picked = jnp.take_along_axis(buf, src[:, None, :, None], axis=2)  # [B, K, C, Dh]
        return write_rows(buf, picked, cache.length)
    return KVCache(k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)),
                   length=cache.length + n_B.astype(jnp.int32))
