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


BLOCK = 128  # categorical(): tokens per block of the two-level inverse CDF


def _first_above(cum, x, live):
    """Index of the first live entry whose cumulative mass exceeds x; the last live entry when
    rounding leaves none (a dead entry, of zero mass, is never returned when one is live)."""
    n = cum.shape[0]
    above = (cum > x) & live
    last_live = n - 1 - jnp.argmax(live[::-1])
    return jnp.where(jnp.any(above), jnp.argmax(above), last_live).astype(jnp.int32)


def categorical(key, logits_V: jax.Array) -> jax.Array:
    """One index drawn from softmax(logits_V) ([V]) with a single uniform number.

    A two-level inverse CDF: cumulative block masses pick a block of BLOCK tokens, the cumulative
    masses inside it pick the token. (jax.random.categorical, Gumbel-max, draws V random numbers,
    which on CPU costs ten times a softmax over a 49,152-token vocabulary.) An index of zero
    probability (e.g. a NEG_INF-filtered token) is never returned, whatever the rounding.
    """
    V = logits_V.shape[-1]
    nb = -(-V // BLOCK)
    p = jax.nn.softmax(logits_V.astype(jnp.float32), axis=-1)
    p = jnp.pad(p, (0, nb * BLOCK - V)).reshape(nb, BLOCK)
    mass = jnp.sum(p, axis=-1)  # [nb]
    cum = jnp.cumsum(mass)
    u = jax.random.uniform(key, (), jnp.float32) * cum[-1]
    b = _first_above(cum, u, mass > 0)
    row = p[b]  # [BLOCK]
    within = u - (cum[b] - mass[b])
    i = _first_above(jnp.cumsum(row), within, row > 0)
    return b * BLOCK + i


def sample_token(key, logits_V: jax.Array, s: SamplingConfig) -> jax.Array:
    """One token from one row's logits: argmax when greedy, else from the processed distribution."""
    if s.greedy:
        return jnp.argmax(logits_V, axis=-1).astype(jnp.int32)
    return categorical(key, process_logits(logits_V, s))


def row_keys(seed_key, batch: int):
    """Independent per-row keys [B, 2]: a row's random numbers do not depend on other rows."""
    return jax.vmap(lambda i: jax.random.fold_in(seed_key, i))(jnp.arange(batch))


def step_keys(keys_B, step):
    return jax.vmap(lambda k: jax.random.fold_in(k, step))(keys_B)
