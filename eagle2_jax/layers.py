"""Llama building blocks as Flax (linen) modules: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Shapes are written in names: B batch, T new tokens, S cache slots, H query heads, K key/value
heads, G = H // K, Dh head dim, D hidden, F MLP width. Keys/values live in the cache as
[B, K, S, Dh].

Each attention call attends over the cache as it was before the call (committed prefix plus
scratch slots written by earlier calls, under an explicit mask [B, T, S]) and over its own new
keys/values (mask [B, T, T]) in one softmax, then writes the new keys/values into the cache at
slots write_at[b] .. write_at[b]+T-1. Reading before writing leaves the cache update with a
single consumer, so XLA performs it in place; reading the updated cache instead made XLA's CPU
fusion duplicate the update and copy every layer's cache twice per step at batch 1.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from . import cpu_kernels as few_rows
from . import packed as packing
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


def attend(q_BTHD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD, v_new_BKTD, mask_new_BTT, kernel: bool = False):
    """Softmax attention over cache slots and this call's own keys/values together.

    Float32 scores and softmax; (B, K) batched matmuls with no cache transpose. With `kernel`
    (float32 caches, the few-row kernels enabled, EAGLE2_JAX_CPU_ATTENTION not "0") the CPU kernel
    `cpu_kernels.attention` runs it instead, reading only unmasked slots (gradients go through the
    XLA path).
    """
    B, T, H, Dh = q_BTHD.shape
    if (kernel and k_BKSD.dtype == jnp.float32 and k_new_BKTD.dtype == jnp.float32
            and few_rows.attention_enabled()):
        return _attend_kernel(q_BTHD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD, v_new_BKTD, mask_new_BTT)
    return _attend_xla(q_BTHD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD, v_new_BKTD, mask_new_BTT)


def _query_rows(q_BTHD, K):
    """[B, T, H, Dh] -> [B, K, G * T, Dh] float32, scaled: query rows m = g * T + t."""
    B, T, H, Dh = q_BTHD.shape
    G = H // K
    q = q_BTHD.astype(jnp.float32).reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, Dh)
    return q * (1.0 / math.sqrt(Dh))


@jax.custom_vjp
def _attend_kernel(q_BTHD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD, v_new_BKTD, mask_new_BTT):
    B, T, H, Dh = q_BTHD.shape
    K = k_BKSD.shape[1]
    out = few_rows.attention(_query_rows(q_BTHD, K), k_BKSD, v_BKSD, mask_BTS, k_new_BKTD, v_new_BKTD,
                             mask_new_BTT)
    return out.reshape(B, K, H // K, T, Dh).transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)


def _attend_kernel_fwd(*args):
    return _attend_kernel(*args), args


def _attend_kernel_bwd(args, g):
    return jax.vjp(_attend_xla, *args)[1](g)


_attend_kernel.defvjp(_attend_kernel_fwd, _attend_kernel_bwd)


def _attend_xla(q_BTHD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD, v_new_BKTD, mask_new_BTT):
    B, T, H, Dh = q_BTHD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    G = H // K
    f32 = jnp.float32
    q = _query_rows(q_BTHD, K)
    dot = lambda eq, a, b: jnp.einsum(eq, a.astype(b.dtype), b, preferred_element_type=f32)  # noqa: E731
    # scores slot-major, [B, K, slots, M]: with few query rows (decoding) XLA's CPU matmuls are
    # several times faster in this orientation than with the rows first

    def cols(m_BTX):  # [B, T, X] -> [B, 1, X, M]
        m = jnp.broadcast_to(m_BTX[:, None], (B, G) + m_BTX.shape[1:]).reshape(B, G * T, -1)
        return m.transpose(0, 2, 1)[:, None]
    qc = q.astype(k_BKSD.dtype)  # the query takes the cache's dtype, never the other way round
    scores = jnp.concatenate([jnp.where(cols(mask_BTS), dot("bksd,bkmd->bksm", k_BKSD, qc), NEG_INF),
                              jnp.where(cols(mask_new_BTT), dot("bkud,bkmd->bkum", k_new_BKTD, qc), NEG_INF)],
                             axis=2)
    probs = jax.nn.softmax(scores, axis=2)
    out = dot("bksm,bksd->bkmd", probs[:, :, :S], v_BKSD) + dot("bkum,bkud->bkmd", probs[:, :, S:], v_new_BKTD)
    return out.reshape(B, K, G, T, Dh).transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)


def after(x) -> jax.Array:
    """A scalar 0 that data-depends on x: adding it to a cache update orders the update after
    the reads that produced x. Without that edge XLA cannot prove the in-place update safe
    inside a loop and copies the cache (twice per layer and step). XLA does not fold x * 0 for
    floats; the select keeps the result 0 even if x held inf or NaN."""
    x0 = jax.lax.stop_gradient(x.reshape(-1)[0].astype(jnp.float32))
    return jnp.where(jnp.isfinite(x0), x0, 0.0) * 0.0


def write_rows(buf_BKSD, new_BKTD, start_B):
    """buf[b, :, start[b]:start[b]+T] = new[b] for every row b, in place.

    One scatter with B*T row indices: XLA updates the buffer in place (at B = 1 it becomes a
    dynamic-update-slice). It replaced a chain of B dynamic-update-slices, which compiled in twice
    the time at B = 16 and, looped for large B, copied the cache every call. Callers size the
    cache so start + T <= S.
    """
    B, K, T, Dh = new_BKTD.shape
    rows = jnp.arange(B)[:, None]  # [B, 1]
    slots = start_B[:, None] + jnp.arange(T)[None]  # [B, T]
    upd = new_BKTD.astype(buf_BKSD.dtype).transpose(0, 2, 1, 3)  # [B, T, K, Dh], as the index broadcast
    return buf_BKSD.at[rows, :, slots, :].set(upd, mode="promise_in_bounds", unique_indices=True)


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


HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def dense_dot_general(few_row_kernels: bool):
    """The `dot_general` of the model's Dense layers.

    The few-row CPU kernel where enabled (see eagle2_jax.cpu_kernels), else `lax.dot_general`.
    Half-precision operands accumulate in float32 and round the result once: numerically the
    better product, what TPU and GPU matrix units do anyway, and on XLA:CPU about 4x faster than
    a bfloat16 x bfloat16 -> bfloat16 dot (which XLA runs through a slow generic path; a
    [3072, 576] x [576, 1536] product: 42 ms vs 9 ms here). Float32 operands are unchanged.
    """
    base = few_rows.dot_general if few_row_kernels else jax.lax.dot_general

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
        if (preferred_element_type is None and lhs.dtype == rhs.dtype
                and jnp.dtype(lhs.dtype) in HALF_DTYPES):
            out = base(lhs, rhs, dimension_numbers, precision=precision,
                       preferred_element_type=jnp.float32, **kw)
            return out.astype(lhs.dtype)
        return base(lhs, rhs, dimension_numbers, precision=precision,
                    preferred_element_type=preferred_element_type, **kw)
    return dot_general


class PackedDense(nn.Module):
    """nn.Dense / nn.DenseGeneral over a kernel loaded packed (eagle2_jax.packed: Q4_1 blocks, read
    by the CPU kernel); float32. Packed params are only loaded from a GGUF, never initialised."""

    features: tuple
    n_in: int = 1  # trailing input axes contracted
    use_bias: bool = False

    @nn.compact
    def __call__(self, x):
        w = self.get_variable("params", "kernel")
        lead, k = x.shape[:x.ndim - self.n_in], math.prod(x.shape[x.ndim - self.n_in:])
        y = packing.matmul(x.reshape(-1, k), w).reshape(lead + tuple(self.features))
        if self.use_bias:
            y = y + self.get_variable("params", "bias")
        return y


def _dense(features, name, bias, dtype, dot_general, packed: bool, axis=-1):
    """nn.Dense (int features, last axis), nn.DenseGeneral, or PackedDense for packed params."""
    if packed:
        feats = tuple(features) if isinstance(features, (tuple, list)) else (features,)
        return PackedDense(feats, len(axis) if isinstance(axis, tuple) else 1, bias, name=name)
    if isinstance(features, int) and axis == -1:
        return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype, name=name,
                        dot_general=dot_general)
    return nn.DenseGeneral(features, axis=axis, use_bias=bias, dtype=dtype, param_dtype=dtype, name=name,
                           dot_general=dot_general)


class Attention(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32
    few_row_kernels: bool = False  # see eagle2_jax.cpu_kernels
    packed: bool = False  # kernels loaded packed (eagle2_jax.packed)

    @nn.compact
    def __call__(self, x_BTD, positions_BT, cache_k, cache_v, write_at_B, masks):
        """masks: (cache [B,T,S], new [B,T,T]) from `split_masks`.

        Returns (out [B,T,D], (cache_k, cache_v) with this call's keys/values written)."""
        c = self.config
        dot_general = dense_dot_general(self.few_row_kernels)
        dense = lambda feats, name, bias: _dense(  # noqa: E731
            feats, name, bias, self.dtype, dot_general, self.packed)
        q = dense((c.num_attention_heads, c.head_dim), "q", c.attention_bias)(x_BTD)
        k = dense((c.num_key_value_heads, c.head_dim), "k", c.attention_bias)(x_BTD)
        v = dense((c.num_key_value_heads, c.head_dim), "v", c.attention_bias)(x_BTD)
        inv_freq = rope_inv_freq(c)
        q = apply_rope(q, positions_BT, inv_freq)
        k = apply_rope(k, positions_BT, inv_freq).transpose(0, 2, 1, 3)  # [B, K, T, Dh]
        v = v.transpose(0, 2, 1, 3)
        kc, vc = k.astype(cache_k.dtype), v.astype(cache_v.dtype)  # as a cache read would give
        out = attend(q, cache_k, cache_v, masks[0], kc, vc, masks[1], kernel=self.few_row_kernels)
        dep = after(out).astype(cache_k.dtype)
        cache_k = write_rows(cache_k, kc + dep, write_at_B)
        cache_v = write_rows(cache_v, vc + dep, write_at_B)
        out = out.astype(self.dtype)
        out = _dense(c.hidden_size, "o", False, self.dtype, dot_general, self.packed, axis=(-2, -1))(out)
        return out, (cache_k, cache_v)


class MLP(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32
    few_row_kernels: bool = False
    packed: bool = False

    @nn.compact
    def __call__(self, x):
        c = self.config
        dense = lambda feats, name: _dense(  # noqa: E731
            feats, name, c.mlp_bias, self.dtype, dense_dot_general(self.few_row_kernels), self.packed)
        h = nn.silu(dense(c.intermediate_size, "gate")(x)) * dense(c.intermediate_size, "up")(x)
        return dense(c.hidden_size, "down")(h)


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer. `input_norm=False` gives the EAGLE draft layer."""

    config: ModelConfig
    dtype: Any = jnp.float32
    input_norm: bool = True
    few_row_kernels: bool = False
    packed: bool = False

    @nn.compact
    def __call__(self, x_BTD, positions_BT, cache_k, cache_v, write_at_B, masks):
        c = self.config
        h = RMSNorm(c.rms_norm_eps, self.dtype, name="input_norm")(x_BTD) if self.input_norm else x_BTD
        kern = self.few_row_kernels
        a, kv = Attention(c, self.dtype, kern, self.packed, name="attn")(h, positions_BT, cache_k, cache_v, write_at_B, masks)
        x = x_BTD + a
        x = x + MLP(c, self.dtype, kern, self.packed, name="mlp")(RMSNorm(c.rms_norm_eps, self.dtype, name="post_norm")(x))
        return x, kv


def causal_mask(B: int, T: int) -> jax.Array:
    m = jnp.tril(jnp.ones((T, T), bool))
    return jnp.broadcast_to(m, (B, T, T))
