"""KV caches as explicit pytrees.

A cache holds, per layer, keys and values [B, S, K, Dh] and a per-row committed length [B].
Slots >= length are garbage and invisible to attention. New keys/values are produced by a
forward pass as a separate local segment and committed here: for plain decoding all of them,
for a verified tree only the accepted path (gathered first), which is EAGLE's "compact" step.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    k: tuple  # L x [B, S, K, Dh]
    v: tuple  # L x [B, S, K, Dh]
    length: jax.Array  # [B] int32, committed slots per row

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


def init_cache(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
               dtype) -> KVCache:
    shape = (batch, max_len, num_kv_heads, head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    return KVCache(k=tuple(zeros() for _ in range(num_layers)),
                   v=tuple(zeros() for _ in range(num_layers)),
                   length=jnp.zeros((batch,), jnp.int32))


def _write_rows(buf_BSKD, new_BTKD, start_B):
    """Write new[b] at slots start[b]:start[b]+T of buf[b] (start must leave room: checked by callers)."""
    def one(buf, new, s):
        return jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), s, axis=0)
    return jax.vmap(one)(buf_BSKD, new_BTKD, start_B)


def commit(cache: KVCache, new_kv: Sequence, n_B: jax.Array) -> KVCache:
    """Append per-layer (k, v) [B, T, K, Dh] at each row's length; advance by n_B (<= T).

    Slots between length+n and length+T receive garbage that stays invisible.
    """
    ks = tuple(_write_rows(ck, nk, cache.length) for ck, (nk, _) in zip(cache.k, new_kv))
    vs = tuple(_write_rows(cv, nv, cache.length) for cv, (_, nv) in zip(cache.v, new_kv))
    return KVCache(k=ks, v=vs, length=cache.length + n_B.astype(jnp.int32))


def gather_kv(new_kv: Sequence, idx_BP: jax.Array):
    """Select entries idx[b, p] of each layer's local (k, v) [B, T, K, Dh] -> [B, P, K, Dh]."""
    take = lambda x: jnp.take_along_axis(x, idx_BP[:, :, None, None], axis=1)  # noqa: E731
    return tuple((take(k), take(v)) for k, v in new_kv)
