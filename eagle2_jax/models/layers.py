"""Llama building blocks as pure functions over explicit param dicts: RMSNorm, RoPE, GQA
attention, SwiGLU MLP, the decoder layer, and their initialisers.

Shapes are written in names: B batch, T new tokens, S cache slots, H query heads, K key/value
heads, G = H // K, Dh head dim, D hidden, F MLP width, L layers. One layer's keys/values live in
the cache as [B, K, S, Dh]; the stacked cache is [L, B, K, S, Dh].

Every product goes through `ops` (eagle2_jax.models.ops): the layer code is the same on every backend.
A layer computes its queries and new keys/values and hands them to an `attend` function, which
owns the cache access. Two are defined here:
  `attend_within`: the new keys/values are written into the layer's cache slots first, then the
    queries attend over that layer's cache alone, in one block (mask [B, T, S]): one set of score,
    softmax and value kernels a layer, and the write is ordered before the read by data
    dependence, so it happens in place. Forwards over several tokens (tree verification, draft
    passes) with ops that take it (`Ops.cache_first`), where each layer's cache is a static slice
    (`model.writes_first`).
  `attend_beside`: the cache as it was before the call (mask [B, T, S]) and the new keys/values
    (mask [B, T, T]) as two blocks in one softmax; the caller writes all layers' new entries after
    the layer loop in one scatter. Decode steps, prefill into an empty cache (no cache block at
    all), scans over stacked layers, and the CPU backend's two-block attention kernel.

Param dict of one layer (the target stacks these on a leading L axis):
  input_norm/scale [D] (not in the draft layer); post_norm/scale [D];
  attn/{q,k,v}/kernel [D, H|K, Dh] (+ bias [H|K, Dh]); attn/o/kernel [H, Dh, D];
  mlp/{gate,up}/kernel [D, F] (+ bias [F]); mlp/down/kernel [F, D] (+ bias [D]).
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from .ops import NEG_INF, Ops  # noqa: F401 (NEG_INF re-exported)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies [Dh/2] with optional Llama-3 or linear scaling (float64 numpy); `local`:
    a sliding-window layer's (Gemma 3: its own base, no scaling)."""
    dh = config.head_dim
    theta = config.rope_local_base_freq if local else config.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
    rs = {} if local else config.rope_scaling_dict
    kind = rs.get("rope_type", rs.get("type")) if rs else None
    if kind is None or kind == "default":
        return inv
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_ctx = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return np.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def rope_tables(config: ModelConfig, positions_BT: jax.Array, local: bool = False):
    """(cos, sin) [B, T, 1, Dh] float32, the rotary tables of these positions in Hugging Face's
    half-split convention ([cos, cos] and [-sin, sin]). A forward computes them once, before its
    layer loop: XLA does not hoist them out of a scan over layers, where they would cost kernels in
    every layer."""
    inv_freq = rope_inv_freq(config, local)
    angles = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)[None, None]
    cos, sin = jnp.cos(angles), jnp.sin(angles)  # [B, T, Dh/2]
    return (jnp.concatenate([cos, cos], axis=-1)[:, :, None, :], jnp.concatenate([-sin, sin], axis=-1)[:, :, None, :])


def apply_rope(x_BTHD: jax.Array, rope) -> jax.Array:
    """Rotary embedding with `rope_tables`, computed in float32: x * [cos, cos] + [x2, x1] * [-sin, sin]
    (the same values as x1 cos - x2 sin, x2 cos + x1 sin, with fewer ops over x)."""
    cos2, sin2 = rope
    x = x_BTHD.astype(jnp.float32)
    half = x.shape[-1] // 2
    swapped = jnp.concatenate([x[..., half:], x[..., :half]], axis=-1)
    return (x * cos2 + swapped * sin2).astype(x_BTHD.dtype)


def rms_norm(ops: Ops, p, x, eps: float):
    scale = ops.weight(p["scale"])
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.reshape((1,) * (x.ndim - 1) + (-1,)) * xf.astype(scale.dtype)


def dense(ops: Ops, p, x, n_in: int = 1):
    """A Dense / DenseGeneral layer: p["kernel"] [*in, *out] (+ p["bias"] [*out])."""
    y = ops.dense(x, p["kernel"], n_in)
    if "bias" not in p:
        return y
    b = ops.weight(p["bias"]).astype(y.dtype)
    return y + b.reshape((1,) * (y.ndim - b.ndim) + b.shape)


def attention(ops: Ops, p, x_BTD, rope, attend, eps: float = 1e-6, q_scale: float = 1.0):
    """Self-attention through `attend(q [B,T,H,Dh], k, v [B,K,T,Dh]) -> (out [B,T,H,Dh], state)`
    (`attend_within` / `attend_beside`, which scale scores by Dh^-1/2), rotated by `rope`
    (`rope_tables`); with p["q_norm"] and p["k_norm"] (Qwen3, Gemma 3) each head's queries and keys
    are RMS-normalised first; `q_scale` rescales the queries (Gemma's query_pre_attn_scalar).
    Returns (out [B,T,D], state)."""
    q, k = dense(ops, p["q"], x_BTD), dense(ops, p["k"], x_BTD)
    if "q_norm" in p:
        q, k = rms_norm(ops, p["q_norm"], q, eps), rms_norm(ops, p["k_norm"], k, eps)
    if q_scale != 1.0:
        q = (q.astype(jnp.float32) * q_scale).astype(q.dtype)
    q = apply_rope(q, rope)
    k = apply_rope(k, rope).transpose(0, 2, 1, 3)  # [B, K, T, Dh]
    v = dense(ops, p["v"], x_BTD).transpose(0, 2, 1, 3)
    out, state = attend(q, k, v)
    return dense(ops, p["o"], out.astype(x_BTD.dtype), n_in=2), state


def attend_beside(ops: Ops, k_BKSD, v_BKSD, masks):
    """`attend` over the cache as it was (masks[0] [B,T,S]; the new tokens' own slots hidden, see
    `split_masks`) and the new keys/values as a second block (masks[1] [B,T,T]). State: the new
    (k, v) [B,K,T,Dh] in the cache's dtype, for the caller to write."""
    def attend(q_BTHD, k_BKTD, v_BKTD):
        kc, vc = k_BKTD.astype(k_BKSD.dtype), v_BKTD.astype(v_BKSD.dtype)  # as a cache read would give
        return ops.attend(q_BTHD, k_BKSD, v_BKSD, masks[0], kc, vc, masks[1]), (kc, vc)
    return attend


def attend_within(ops: Ops, k_LBKSD, v_LBKSD, layer, start_B, mask_BTS):
    """`attend` that writes the new keys/values of layer `layer` (an int or traced index) into slots
    start[b] .. start[b]+T-1 of the stacked cache, then attends over that layer's cache alone under
    mask [B,T,S] (`cache_mask`, the new tokens' own slots included). State: the updated stacked
    (k, v) [L,B,K,S,Dh]."""
    def attend(q_BTHD, k_BKTD, v_BKTD):
        k_all = write_rows(k_LBKSD, k_BKTD, start_B, layer)
        v_all = write_rows(v_LBKSD, v_BKTD, start_B, layer)
        return ops.attend(q_BTHD, k_all[layer], v_all[layer], mask_BTS), (k_all, v_all)
    return attend


def mlp(ops: Ops, p, x, activation: str = "silu"):
    """SwiGLU, or GeGLU with activation "gelu_pytorch_tanh" (Gemma)."""
    if "gate_up" in p:  # gate and up as one matmul over their concatenated weights (layer_list.per_layer)
        gate, up = jnp.split(dense(ops, p["gate_up"], x), 2, axis=-1)
    else:
        gate, up = dense(ops, p["gate"], x), dense(ops, p["up"], x)
    act = nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=True)
    return dense(ops, p["down"], act * up)


def query_scale(c: ModelConfig) -> float:
    """Queries' factor making the scores' Dh^-1/2 into query_pre_attn_scalar^-1/2 (Gemma); else 1."""
    return 1.0 if c.query_pre_attn_scalar is None else math.sqrt(c.head_dim / c.query_pre_attn_scalar)


def decoder_layer(ops: Ops, c: ModelConfig, p, x_BTD, rope, attend):
    """Pre-norm Llama layer; without p["input_norm"] it is the EAGLE draft layer (the input is
    already normalised); with p["attn_out_norm"] and p["mlp_out_norm"] (Gemma's sandwich) the
    attention's and the MLP's outputs are normalised too. `rope`: the tokens' `rope_tables`.
    Returns (x [B,T,D], the state `attend` returns)."""
    eps = c.rms_norm_eps
    h = rms_norm(ops, p["input_norm"], x_BTD, eps) if "input_norm" in p else x_BTD
    a, state = attention(ops, p["attn"], h, rope, attend, eps, query_scale(c))
    if "attn_out_norm" in p:
        a = rms_norm(ops, p["attn_out_norm"], a, eps)
    x = x_BTD + a
    m = mlp(ops, p["mlp"], rms_norm(ops, p["post_norm"], x, eps), c.hidden_activation)
    if "mlp_out_norm" in p:
        m = rms_norm(ops, p["mlp_out_norm"], m, eps)
    return x + m, state


# ---- initialisers (random weights for tests, timing and training from scratch) ----------------

def init_dense(key, shape_in: tuple, shape_out: tuple, bias: bool, dtype) -> dict:
    """LeCun-normal kernel [*in, *out] (fan-in over all input axes), zero bias."""
    n_in, n_out = int(np.prod(shape_in)), int(np.prod(shape_out))
    w = nn.initializers.lecun_normal()(key, (n_in, n_out), jnp.float32).reshape(shape_in + shape_out)
    p = {"kernel": w.astype(dtype)}
    if bias:
        p["bias"] = jnp.zeros(shape_out, dtype)
    return p


def init_layer(key, c: ModelConfig, dtype, input_norm: bool = True) -> dict:
    D, H, K, Dh, F = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    ks = jax.random.split(key, 7)
    ab, mb = c.attention_bias, c.mlp_bias
    p = {"attn": {"q": init_dense(ks[0], (D,), (H, Dh), ab, dtype), "k": init_dense(ks[1], (D,), (K, Dh), ab, dtype),
                  "v": init_dense(ks[2], (D,), (K, Dh), ab, dtype), "o": init_dense(ks[3], (H, Dh), (D,), False, dtype)},
         "mlp": {"gate": init_dense(ks[4], (D,), (F,), mb, dtype), "up": init_dense(ks[5], (D,), (F,), mb, dtype),
                 "down": init_dense(ks[6], (F,), (D,), mb, dtype)},
         "post_norm": {"scale": jnp.ones((D,), dtype)}}
    if c.qk_norm:
        p["attn"]["q_norm"] = {"scale": jnp.ones((Dh,), dtype)}
        p["attn"]["k_norm"] = {"scale": jnp.ones((Dh,), dtype)}
    if c.sandwich_norm:
        p["attn_out_norm"] = {"scale": jnp.ones((D,), dtype)}
        p["mlp_out_norm"] = {"scale": jnp.ones((D,), dtype)}
    if input_norm:
        p["input_norm"] = {"scale": jnp.ones((D,), dtype)}
    return p


def init_layers(key, c: ModelConfig, dtype) -> dict:
    """L layers' params stacked on a leading axis."""
    return jax.vmap(lambda k: init_layer(k, c, dtype))(jax.random.split(key, c.num_hidden_layers))


def write_rows(buf_LBKSD, new_LBKTD, start_B, layer=None):
    """buf[:, b, :, start[b]:start[b]+T] = new[:, b] for every row b (all layers), in place; with
    `layer` (an int or traced index), new [B,K,T,Dh] goes to that layer alone.

    One scatter with B*T row indices: XLA updates the buffer in place. It replaced a chain of B
    dynamic-update-slices, which compiled in twice the time at B = 16 and, looped for large B,
    copied the cache every call. Callers size the cache so start + T <= S.
    """
    B, T = new_LBKTD.shape[-4], new_LBKTD.shape[-2]
    rows = jnp.arange(B)[:, None]  # [B, 1]
    slots = start_B[:, None] + jnp.arange(T)[None]  # [B, T]
    upd = jnp.moveaxis(new_LBKTD.astype(buf_LBKSD.dtype), (-4, -2), (0, 1))  # [B, T, (L,) K, Dh], as the index broadcast
    at = (slice(None) if layer is None else layer, rows, slice(None), slots, slice(None))
    return buf_LBKSD.at[at].set(upd, mode="promise_in_bounds", unique_indices=True)


def cache_mask(length_B, local_mask_BTU, S: int):
    """[B, T, S]: committed slots (< length) plus local slots length+u where local_mask[b, t, u]."""
    B, T, U = local_mask_BTU.shape
    rel = jnp.arange(S)[None, :] - length_B[:, None]  # [B, S]
    in_local = (rel >= 0) & (rel < U)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, U - 1)[:, None, :], (B, T, S))
    local = jnp.take_along_axis(local_mask_BTU, idx, axis=2) & in_local[:, None, :]
    return (rel < 0)[:, None, :] | local


def split_masks(length_B, local_mask_BTU, offset: int, S: int):
    """Masks for `attend` when T new tokens go to scratch slots length+offset .. +T-1.

    Returns ([B, T, S] over the cache as it was, with the new tokens' own slots hidden because
    they still hold stale values; [B, T, T] over the new tokens, local_mask[..., offset:offset+T]).
    """
    _, T, U = local_mask_BTU.shape
    if offset + T > U:
        raise ValueError(f"local mask covers {U} scratch slots, but tokens go to {offset}..{offset + T - 1}")
    own = (jnp.arange(U) >= offset) & (jnp.arange(U) < offset + T)
    return (cache_mask(length_B, local_mask_BTU & ~own[None, None, :], S),
            local_mask_BTU[:, :, offset:offset + T])


def window_masks(masks: tuple, length_B, positions_BT, offset: int, window: int) -> tuple:
    """`masks` (the cache part [B,T,S] and, for two blocks, the new tokens' part [B,T,T]) with every
    key more than `window` - 1 positions before its query hidden (a sliding-window layer: a query at
    position p sees keys at p - window + 1 .. p). A committed slot s holds position s; a new token's
    key has its own position; other scratch slots (a draft's earlier levels) are left as they are."""
    S = masks[0].shape[-1]
    slot = jnp.arange(S)[None, :]
    key_pos = jnp.where(slot < length_B[:, None], slot, -window)  # [B, S]: committed keys only
    if len(masks) == 1:  # one block: the new tokens' keys sit in slots length+offset ..
        T = positions_BT.shape[1]
        u = slot - (length_B + offset)[:, None]
        mine = (u >= 0) & (u < T)
        key_pos = jnp.where(mine, jnp.take_along_axis(positions_BT, jnp.clip(u, 0, T - 1), axis=1), key_pos)
    near = positions_BT[:, :, None] - key_pos[:, None, :] < window  # [B, T, S]
    far_ok = key_pos[:, None, :] == -window  # not a windowed key
    out = (masks[0] & (near | far_ok),)
    if len(masks) == 2:
        out += (masks[1] & (positions_BT[:, :, None] - positions_BT[:, None, :] < window),)
    return out


def causal_mask(B: int, T: int) -> jax.Array:
    m = jnp.tril(jnp.ones((T, T), bool))
    return jnp.broadcast_to(m, (B, T, T))


def top_log_probs(logits, k: int):
    """The k largest log-probs of softmax(logits) over the last axis and their indices, float32:
    log_softmax's values ((x - max) - log sum exp(x - max), the same ops) for the k entries only,
    ranked on the logits themselves. A log_softmax over the whole axis before the top-k costs a
    GPU several passes over the vocabulary; this costs one (the sum) beside the top-k."""
    x = logits.astype(jnp.float32)
    top, idx = jax.lax.top_k(x, k)
    m = top[..., :1]  # the maximum
    lse = jnp.log(jnp.sum(jnp.exp(x - jax.lax.stop_gradient(m)), axis=-1, keepdims=True))
    return (top - m) - lse, idx
