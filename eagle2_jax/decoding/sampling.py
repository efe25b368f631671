"""Logits processing (temperature, top-k, top-p) and sampling, identical everywhere.

The same `process_logits` feeds plain decoding, EAGLE-2 verification and the bonus token, so
the distribution EAGLE-2 samples from is exactly the one plain decoding samples from.

Programs take `SamplingParams`: whether decoding is greedy is static (it changes the program),
temperature, top-k and top-p are traced arrays, so new values never recompile. Each is a scalar
(every row alike) or one value per row [B] (a serving engine's rows, each its own request); in a
sampling program a row whose temperature is 0 decodes greedily, so greedy and sampled rows share
one batch.
"""
from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..config import SamplingConfig
from ..models.ops import NEG_INF


@struct.dataclass
class SamplingParams:
    temperature: jax.Array  # float32, scalar or [B]; 0: that row is greedy
    top_k: jax.Array  # int32, scalar or [B]; 0: off
    top_p: jax.Array  # float32, scalar or [B]; 1: off
    greedy: bool = struct.field(pytree_node=False, default=True)  # every row greedy (no sampling compiled)
    # per-row values that may hold greedy rows (a serving engine's): the sampling program then also
    # computes the greedy outcome and picks per row; a generation's one temperature > 0 does not
    mixed: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def of(cls, s: Union[SamplingConfig, "SamplingParams"]) -> "SamplingParams":
        if isinstance(s, SamplingParams):
            return s
        return cls(np.float32(s.temperature if not s.greedy else 1.0), np.int32(s.top_k),  # numpy: replicated
                   np.float32(s.top_p), s.greedy)

    @classmethod
    def rows(cls, temperature, top_k, top_p) -> "SamplingParams":
        """Per-row values ([B] each; temperature 0: a greedy row); the greedy program where every row is."""
        t = np.asarray(temperature, np.float32)
        greedy = bool(np.all(t <= 0))
        return cls(t, np.asarray(top_k, np.int32), np.asarray(top_p, np.float32), greedy, not greedy)

    def greedy_rows(self, x):
        """Rows that decode greedily, shaped to broadcast against `x` ([B, ...])."""
        if self.greedy or not self.mixed:
            return jnp.asarray(self.greedy)
        return _per_row(self.temperature <= 0, x)


def _per_row(a, x):
    """A scalar as is; a per-row [B] value reshaped to broadcast against x [B, ...]."""
    a = jnp.asarray(a)
    return a if a.ndim == 0 else a.reshape(a.shape + (1,) * (x.ndim - 1))


TOP_K_CAP = 256  # top-k up to this reads its k-th value from lax.top_k; larger k (or top-p) sorts


def process_logits(logits_NV: jax.Array, s) -> jax.Array:
    """float32 logits / temperature with the entries top-k and top-p filter out set to NEG_INF
    (temperature > 0 only; a greedy row's logits pass unscaled). Top-k alone (k <= TOP_K_CAP)
    takes lax.top_k over TOP_K_CAP entries; top-p (or a larger k) one descending sort that serves
    both; neither: nothing. lax.switch picks at run time (the values are traced); with per-row
    values the batch takes the branch its most demanding row needs, which leaves the other rows
    exactly as their own branch would."""
    s = SamplingParams.of(s)
    temp = _per_row(s.temperature, logits_NV)
    x = logits_NV.astype(jnp.float32) / jnp.where(temp > 0, temp, 1.0)
    V = x.shape[-1]
    cap = min(V, TOP_K_CAP)
    k_row = jnp.where((s.top_k > 0) & (s.top_k < V), s.top_k, V)  # V: off
    k, top_p = _per_row(k_row, x), _per_row(s.top_p, x)
    kth_at = lambda vals, n: jnp.take_along_axis(  # noqa: E731  the n-th largest of each row
        vals, jnp.broadcast_to(n - 1, vals.shape[:-1] + (1,)), axis=-1, mode="promise_in_bounds")

    def top_k_only(x):
        kth = kth_at(jax.lax.top_k(x, cap)[0], jnp.minimum(k, cap))
        return jnp.where((x < kth) & (k < V), NEG_INF, x)

    def sorted_filters(x):
        desc = -jnp.sort(-x, axis=-1)
        kth = kth_at(desc, k)
        x = jnp.where(x < kth, NEG_INF, x)
        desc = jnp.where(desc < kth, NEG_INF, desc)  # the sorted top-k-filtered logits
        p = jax.nn.softmax(desc, axis=-1)
        exclusive = jnp.cumsum(p, axis=-1) - p
        # always keeps the most likely token (its exclusive mass is exactly 0), also for a top_p that
        # float32 flushes to zero
        keep = (exclusive < top_p) | (exclusive <= 0.0) | (top_p >= 1.0)
        cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        return jnp.where(x < cutoff, NEG_INF, x)

    branch_row = jnp.where(s.top_p < 1.0, 2, jnp.where(k_row < V, jnp.where(k_row <= cap, 1, 2), 0))
    return jax.lax.switch(jnp.max(branch_row), (lambda x: x, top_k_only, sorted_filters), x)


def target_probs(logits_NV: jax.Array, s) -> jax.Array:
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


def sample_rows(keys_B, logits_BV: jax.Array, s) -> jax.Array:
    """One token per row [B]: the logits are processed for the whole batch first (one sort, not
    one per row under vmap), then each row draws with its own key."""
    s = SamplingParams.of(s)
    if s.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    drawn = jax.vmap(categorical)(keys_B, process_logits(logits_BV, s))
    if not s.mixed:
        return drawn
    return jnp.where(s.greedy_rows(drawn), jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), drawn)


def row_keys(seed_key, batch: int):
    """Independent per-row keys [B, 2]: a row's random numbers do not depend on other rows."""
    return jax.vmap(lambda i: jax.random.fold_in(seed_key, i))(jnp.arange(batch))


def step_keys(keys_B, step):
    """Each row's key folded with its step (a scalar, or per row [B]: a row's own round count, so
    its draws do not depend on when it joined a serving batch)."""
    step_B = jnp.broadcast_to(jnp.asarray(step, jnp.int32), keys_B.shape[:1])
    return jax.vmap(jax.random.fold_in)(keys_B, step_B)
