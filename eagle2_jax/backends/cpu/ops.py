"""The CPU backend's ops: few-row C++ kernels (eagle2_jax.backends.cpu.kernels) and GGUF blocks kept packed
(eagle2_jax.backends.cpu.packed), plugged into the core through eagle2_jax.models.ops.

Chosen (`choose`) for a float32 target whose params sit on one CPU device, when the kernels build
and EAGLE2_JAX_CPU_KERNELS is not "0"; EAGLE2_JAX_CPU_ATTENTION="0" at load time keeps attention on
XLA. Both are read once, when the target is loaded, and become fields of `CpuOps`, so they are part
of every compile key.

Inside the model's scan over stacked layers, `scan_layers` hands the layer body `Indexed` views
(stack, layer index) instead of slices: the kernels read slice `layer` of the stacked weights and
caches in place, where a sliced operand would make XLA copy each layer's weights before every call
(+25-30% per step measured on SmolLM2-135M). Calls over more rows than the kernels take (prompts,
large batches) and non-float32 operands use XLA on the materialised slice.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...models import ops as core_ops
from . import kernels, packed

KERNELS_SWITCH = "EAGLE2_JAX_CPU_KERNELS"  # "0": no CPU backend (plain XLA)
ATTENTION_SWITCH = "EAGLE2_JAX_CPU_ATTENTION"  # "0": attention stays on XLA (the matmuls do not)


class Indexed:
    """Layer `i` of a stacked array [L, ...], not sliced until something needs the values."""

    __slots__ = ("stack", "i")

    def __init__(self, stack, i):
        self.stack, self.i = stack, i

    @property
    def shape(self):
        return self.stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype

    def value(self):
        return lax.dynamic_index_in_dim(self.stack, self.i, 0, keepdims=False)


def _array(w):
    return w.value() if isinstance(w, Indexed) else w


def _stack_and_layer(w):
    return (w.stack, w.i) if isinstance(w, Indexed) else (w, None)


@dataclasses.dataclass(frozen=True)
class CpuOps(core_ops.Ops):
    name: str = "cpu"
    f32_dot_outputs: bool = True
    scores: str = "slots"  # (XLA:CPU's faster orientation, for the XLA attention fallback)
    attention: bool = True  # the attention kernel for float32 caches
    cache_first: bool = False  # the kernel takes the cache as it was and the new keys/values as two blocks

    def __post_init__(self):
        if self.layers != "scan":  # the kernels index the stacked weights in place
            raise ValueError(f"the {self.name!r} backend reads stacked layer weights itself; per-layer "
                             f"buffers (layers='list') are for the XLA path")

    def weight(self, w):
        if packed.is_packed(w):  # GGUF blocks: their float32 copy
            return _array(w["w"])
        return _array(w)

    def scan_layers(self, body, carry, xs):
        L = jax.tree_util.tree_leaves(xs)[0].shape[0]

        def step(c, i):
            return body(c, jax.tree_util.tree_map(lambda a: Indexed(a, i), xs))
        return lax.scan(step, carry, jnp.arange(L, dtype=jnp.int32), unroll=self.unroll_layers)

    def dense(self, x, w, n_in: int = 1):
        lead, k = x.shape[:x.ndim - n_in], math.prod(x.shape[x.ndim - n_in:])
        rows = math.prod(lead)
        if packed.is_packed(w):  # Q4_1 blocks {"q4", "d", "m", "w" [*in, *out]}
            out = w["w"].shape[n_in:]
            x2 = x.reshape(rows, k).astype(jnp.float32)
            if rows <= kernels.NN_MAX_ROWS:
                (q4, layer), (d, _), (m, _) = (_stack_and_layer(w[n]) for n in ("q4", "d", "m"))
                y = kernels.q4_matmul(x2, q4, d, m, layer)
            else:
                y = jnp.dot(x2, _array(w["w"]).reshape(k, -1))
            return y.reshape(lead + out)
        if w.dtype == jnp.float32 and x.dtype == jnp.float32 and 0 < rows <= kernels.NN_MAX_ROWS:
            stack, layer = _stack_and_layer(w)
            n = math.prod(w.shape[n_in:])
            flat = stack.reshape(stack.shape[:stack.ndim - len(w.shape)] + (k, n))  # a free reshape
            return kernels.matmul(x.reshape(rows, k), flat, False, layer).reshape(lead + w.shape[n_in:])
        return super().dense(x, _array(w), n_in)

    def embed(self, table, tokens):
        return packed.embed_rows(table, tokens)

    def lm_head(self, x, w, tied):
        lead = x.shape[:-1]
        rows = math.prod(lead)
        if packed.is_packed(w):  # tied Q8_0 embedding
            return packed.matmul_nt(x.reshape(rows, -1), w).reshape(lead + (-1,))
        limit = kernels.NT_MAX_ROWS if tied else kernels.NN_MAX_ROWS
        if w.dtype == jnp.float32 and x.dtype == jnp.float32 and 0 < rows <= limit:
            return kernels.matmul(x.reshape(rows, -1), w, tied).reshape(lead + (-1,))
        return super().lm_head(x, w, tied)

    def vocab_logits(self, x, vocab_head):
        if "q8" in vocab_head:  # packed rows [V', D]
            return packed.matmul_nt(x.reshape(-1, x.shape[-1]), vocab_head).reshape(x.shape[:-1] + (-1,))
        w = vocab_head["w"]
        rows = math.prod(x.shape[:-1])
        if w.dtype == jnp.float32 and x.dtype == jnp.float32 and 0 < rows <= kernels.NN_MAX_ROWS:
            return kernels.matmul(x.reshape(rows, -1), w).reshape(x.shape[:-1] + (-1,))
        return super().vocab_logits(x, vocab_head)

    def vocab_head(self, target_params, tie_word_embeddings, ids, dtype):
        emb = target_params["embed"]
        if tie_word_embeddings and packed.is_packed(emb) and jnp.dtype(dtype) == jnp.float32:
            # the same float32 weights, kept in the embedding's Q8_0 blocks; "w" [V', D] for many rows
            vh = {k: jnp.take(emb[k], ids, axis=0) for k in ("q8", "d", "w") if k in emb}
            return {**vh, "ids": ids}
        if packed.is_packed(emb):
            target_params = {**target_params, "embed": packed.dequantize(emb)}
        return super().vocab_head(target_params, tie_word_embeddings, ids, dtype)

    def loop_masks(self, masks: tuple, G: int) -> tuple:
        return masks  # the kernel takes [B, T, X] masks

    def attend(self, q_BTHD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD, v_new_BKTD, mask_new_BTT):
        if self.attention and k_BKSD.dtype == jnp.float32 and k_new_BKTD.dtype == jnp.float32:
            (k, layer), (v, _) = _stack_and_layer(k_BKSD), _stack_and_layer(v_BKSD)
            return _attend_kernel(q_BTHD, k, v, mask_BTS, k_new_BKTD, v_new_BKTD, mask_new_BTT, layer)
        return super().attend(q_BTHD, _array(k_BKSD), _array(v_BKSD), mask_BTS, k_new_BKTD, v_new_BKTD,
                              mask_new_BTT)


@jax.custom_vjp
def _attend_kernel(q_BTHD, k, v, mask_BTS, k_new_BKTD, v_new_BKTD, mask_new_BTT, layer):
    B, T, H, Dh = q_BTHD.shape
    K = k_new_BKTD.shape[1]
    out = kernels.attention(core_ops.query_rows(q_BTHD, K), k, v, mask_BTS, k_new_BKTD, v_new_BKTD,
                            mask_new_BTT, layer)
    return out.reshape(B, K, H // K, T, Dh).transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)


def _attend_kernel_fwd(*args):
    return _attend_kernel(*args), args


def _attend_kernel_bwd(args, g):
    """Gradients through XLA's attention (training; the kernel has none)."""
    q, k, v, mask, kn, vn, mask_new, layer = args
    sl = (lambda a: a) if layer is None else (lambda a: lax.dynamic_index_in_dim(a, layer, 0, keepdims=False))
    xla = functools.partial(core_ops.attend_xla, scores="slots")
    dq, dk, dv, dm, dkn, dvn, dmn = jax.vjp(xla, q, sl(k), sl(v), mask, kn, vn, mask_new)[1](g)
    if layer is not None:
        dk, dv = jnp.zeros_like(k).at[layer].set(dk), jnp.zeros_like(v).at[layer].set(dv)
    dlayer = None if layer is None else np.zeros((), jax.dtypes.float0)
    return dq, dk, dv, dm, dkn, dvn, dmn, dlayer


_attend_kernel.defvjp(_attend_kernel_fwd, _attend_kernel_bwd)


def choose(params, dtype, mesh=None):
    """CpuOps for a float32 target on one CPU device with the kernels built; else None (XLA)."""
    if (os.environ.get(KERNELS_SWITCH, "1") == "0" or jax.default_backend() != "cpu"
            or jnp.dtype(dtype) != jnp.float32 or mesh is not None):
        return None
    leaves = jax.tree_util.tree_leaves(params)
    sharding = getattr(leaves[0], "sharding", None) if leaves else None
    if sharding is None or len(sharding.device_set) != 1 or not kernels.load():
        return None
    return CpuOps(attention=os.environ.get(ATTENTION_SWITCH, "1") != "0")
