"""KV caches as explicit pytrees, all layers stacked.

A cache holds keys and values [L, B, K, S, Dh] and a per-row committed length [B]. Slots >= length
are scratch: a forward pass writes its new tokens there (a verified tree's N nodes, the draft's
tree nodes) and attends to them through its mask; committing only moves the length. For a
verified tree, `compact` first moves the accepted path's entries to the slots right after the
committed prefix (EAGLE's compaction: one gather and one scatter over all layers, reading only the
accepted rows), then advances the length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from .layers import write_rows


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, K, S, Dh]
    v: jax.Array  # [L, B, K, S, Dh]
    length: jax.Array  # [B] int32, committed slots per row

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]


def init_cache(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
               dtype) -> KVCache:
    shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   length=jnp.zeros((batch,), jnp.int32))


def write(cache: KVCache, k_LBKTD, v_LBKTD, start_B) -> KVCache:
    """The new tokens' keys/values of every layer into slots start[b] .. start[b]+T-1."""
    return cache.replace(k=write_rows(cache.k, k_LBKTD, start_B), v=write_rows(cache.v, v_LBKTD, start_B))


def advance(cache: KVCache, n_B: jax.Array) -> KVCache:
    """Commit the first n[b] scratch slots of each row."""
    return cache.replace(length=cache.length + n_B.astype(jnp.int32))


def compact(cache: KVCache, path_BC: jax.Array, n_B: jax.Array) -> KVCache:
    """Move scratch slots length+path[b, d] to length+d (d < C), then commit n[b] of them."""
    src = (cache.length[:, None] + path_BC)[None, :, None, :, None]  # [1, B, 1, C, 1]

    def move(buf):
        picked = jnp.take_along_axis(buf, src, axis=3, mode="promise_in_bounds")  # [L, B, K, C, Dh]
        return write_rows(buf, picked, cache.length)
    return KVCache(k=move(cache.k), v=move(cache.v), length=cache.length + n_B.astype(jnp.int32))
