"""Llama building blocks as Flax (linen) modules: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Shapes are written in names: B batch, T new tokens, S cache slots, U local slots, H query heads,
K key/value heads, G = H // K, Dh head dim, D hidden, F MLP width.

Attention sees two segments and never concatenates them (no copy of the cache):
  * the committed cache [B, S, K, Dh], visible where slot < cache_len[b];
  * a local segment [B, U, K, Dh] with an explicit mask [B, T, U] (causal, a tree's ancestor
    mask, or the draft's tree buffer).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig

NEG_INF = -1e30  # large finite negative for masked scores (float32)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [Dh/2] with optional Llama-3 or linear scaling (float64 numpy)."""
    dh = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
    rs = config.rope_scaling_dict
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


def apply_rope(x_BTHD: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding in Hugging Face's half-split convention, computed in float32."""
    angles = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)[None, None]
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, Dh/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x = x_BTHD.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHD.dtype)


class RMSNorm(nn.Module):
    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return scale.reshape((1,) * (x.ndim - 1) + (-1,)) * xf.astype(self.dtype)


def attend(q_BTHD, cache_k_BSKD, cache_v_BSKD, cache_len_B, local_k_BUKD, local_v_BUKD,
           local_mask_BTU):
    """Softmax attention over [committed cache ; local segment], float32 scores and softmax."""
    B, T, H, Dh = q_BTHD.shape
    K = local_k_BUKD.shape[2]
    G = H // K
    q = q_BTHD.reshape(B, T, K, G, Dh).astype(jnp.float32) * (1.0 / math.sqrt(Dh))
    f32 = jnp.float32
    s_loc = jnp.einsum("btkgd,bukd->bkgtu", q, local_k_BUKD.astype(f32))
    s_loc = jnp.where(local_mask_BTU[:, None, None], s_loc, NEG_INF)
    if cache_k_BSKD is not None:
        S = cache_k_BSKD.shape[1]
        s_c = jnp.einsum("btkgd,bskd->bkgts", q, cache_k_BSKD.astype(f32))
        visible_BS = jnp.arange(S)[None, :] < cache_len_B[:, None]
        s_c = jnp.where(visible_BS[:, None, None, None, :], s_c, NEG_INF)
        scores = jnp.concatenate([s_c, s_loc], axis=-1)
    else:
        S = 0
        scores = s_loc
    probs = jax.nn.softmax(scores, axis=-1)
    p_c, p_loc = probs[..., :S], probs[..., S:]
    out = jnp.einsum("bkgtu,bukd->btkgd", p_loc, local_v_BUKD.astype(f32))
    if cache_k_BSKD is not None:
        out = out + jnp.einsum("bkgts,bskd->btkgd", p_c, cache_v_BSKD.astype(f32))
    return out.reshape(B, T, H, Dh)


class Attention(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BTD, positions_BT, cache_k, cache_v, cache_len_B, local_mask_BTU,
                 local_buffer=None, local_offset=0):
        """Returns (out [B,T,D], (k, v) of the local segment).

        Without `local_buffer` the local segment is this call's own keys/values [B,T,K,Dh].
        With `local_buffer=(k_BUKD, v_BUKD)` this call's keys/values are written into it at
        `local_offset` (the draft's tree buffer) and attention runs over the whole buffer.
        """
        c = self.config
        dense = lambda feats, name, bias: nn.DenseGeneral(  # noqa: E731
            feats, use_bias=bias, dtype=self.dtype, param_dtype=self.dtype, name=name)
        q = dense((c.num_attention_heads, c.head_dim), "q", c.attention_bias)(x_BTD)
        k = dense((c.num_key_value_heads, c.head_dim), "k", c.attention_bias)(x_BTD)
        v = dense((c.num_key_value_heads, c.head_dim), "v", c.attention_bias)(x_BTD)
        inv_freq = rope_inv_freq(c)
        q = apply_rope(q, positions_BT, inv_freq)
        k = apply_rope(k, positions_BT, inv_freq)
        if local_buffer is not None:
            kb, vb = local_buffer
            k = jax.lax.dynamic_update_slice_in_dim(kb, k.astype(kb.dtype), local_offset, axis=1)
            v = jax.lax.dynamic_update_slice_in_dim(vb, v.astype(vb.dtype), local_offset, axis=1)
        out = attend(q, cache_k, cache_v, cache_len_B, k, v, local_mask_BTU).astype(self.dtype)
        out = nn.DenseGeneral(c.hidden_size, axis=(-2, -1), use_bias=False, dtype=self.dtype,
                              param_dtype=self.dtype, name="o")(out)
        return out, (k, v)


class MLP(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = self.config
        dense = lambda feats, name: nn.Dense(  # noqa: E731
            feats, use_bias=c.mlp_bias, dtype=self.dtype, param_dtype=self.dtype, name=name)
        h = nn.silu(dense(c.intermediate_size, "gate")(x)) * dense(c.intermediate_size, "up")(x)
        return dense(c.hidden_size, "down")(h)


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer. `input_norm=False` gives the EAGLE draft layer."""

    config: ModelConfig
    dtype: Any = jnp.float32
    input_norm: bool = True

    @nn.compact
    def __call__(self, x_BTD, positions_BT, cache_k, cache_v, cache_len_B, local_mask_BTU,
                 local_buffer=None, local_offset=0):
        c = self.config
        h = RMSNorm(c.rms_norm_eps, self.dtype, name="input_norm")(x_BTD) if self.input_norm else x_BTD
        a, kv = Attention(c, self.dtype, name="attn")(
            h, positions_BT, cache_k, cache_v, cache_len_B, local_mask_BTU, local_buffer, local_offset)
        x = x_BTD + a
        x = x + MLP(c, self.dtype, name="mlp")(RMSNorm(c.rms_norm_eps, self.dtype, name="post_norm")(x))
        return x, kv


def causal_mask(B: int, T: int) -> jax.Array:
    m = jnp.tril(jnp.ones((T, T), bool))
    return jnp.broadcast_to(m, (B, T, T))
