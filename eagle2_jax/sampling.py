"""Logits processing (temperature, top-k, top-p) and sampling, identical everywhere.

The same `process_logits` feeds plain decoding, EAGLE-2 verification and the bonus token, so
the distribution EAGLE-2 samples from is exactly the one plain decoding samples from.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import SamplingConfig
from .layers import NEG_INF


def process_logits(logits_NV: jax.Array, s: SamplingConfig) -> jax.Array:
    """float32 logits with filtered entries set to NEG_INF (temperature > 0 only)."""
    x = logits_NV.astype(jnp.float32) / jnp.float32(s.temperature)
    if s.top_k and s.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, s.top_k)[0][..., -1:]
        x = jnp.where(x < kth, NEG_INF, x)
    if s.top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
        p = jax.nn.softmax(sorted_x, axis=-1)
        exclusive = jnp.cumsum(p, axis=-1) - p
        keep = exclusive < s.top_p  # always keeps the most likely token
        cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, NEG_INF, x)
    return x


def target_probs(logits_NV: jax.Array, s: SamplingConfig) -> jax.Array:
    """The processed target distribution (float32, sums to 1)."""
    return jax.nn.softmax(process_logits(logits_NV, s), axis=-1)


def sample_token(key, logits_V: jax.Array, s: SamplingConfig) -> jax.Array:
    """One token from one row's logits: argmax when greedy, else from the processed distribution."""
    if s.greedy:
        return jnp.argmax(logits_V, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, process_logits(logits_V, s), axis=-1).astype(jnp.int32)


def row_keys(seed_key, batch: int):
    """Independent per-row keys [B, 2]: a row's random numbers do not depend on other rows."""
    return jax.vmap(lambda i: jax.random.fold_in(seed_key, i))(jnp.arange(batch))


def step_keys(keys_B, step):
    return jax.vmap(lambda k: jax.random.fold_in(k, step))(keys_B)
