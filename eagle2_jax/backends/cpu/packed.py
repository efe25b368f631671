"""Target weights kept in a GGUF's block quantisation, for the CPU kernels (eagle2_jax.backends.cpu.kernels).

A float32 decode step on a CPU is bound by reading the weights (536 MB for SmolLM2-135M). A GGUF
such as SmolLM2-135M-Instruct.Q4_1 stores them in 5-8.5 bits: the kernels here read those blocks
and dequantise each weight in registers to exactly the float32 value numpy's dequantisation (what
`load_gguf` gives unpacked) holds, then sum in the float32 kernel's order. A packed target therefore
computes bit-for-bit what the unpacked float32 target computes through the kernels; it only reads
less memory. Calls over more rows than the float32 kernels take (kernels.NN_MAX_ROWS for a
Dense kernel, NT_MAX_ROWS for the LM head: prompts, large batches) use XLA's dot on a float32 copy
kept beside the blocks ("w"), as the unpacked model does, since dequantising a matrix per call
costs several times more than that dot.

A packed leaf replaces a float32 param leaf by a dict:

  Q4_1 matrix, a Dense kernel [*in, *features] with K = prod(in), N = prod(features):
    {"q4": uint8 [K, N/2], "d": float32 [K/32, N], "m": float32 [K/32, N], "w": float32 [*in, *features]}
    (the target's layers stack these leaves on a leading L axis, as every other layer param)
    w[k, c] = d[k/32, c] * q[k, c] + m[k/32, c] (the product rounded, then the sum); q in 0..15,
    packed per group of 2L columns c0..: byte c0/2 + i holds column c0 + i in its low nibble and
    c0 + L + i in its high one (L = kernels.lanes(), the kernel's vector width)
  Q8_0 tied embedding [V, D]:
    {"q8": int8 [V, D], "d": float32 [V, D/32], "w": float32 [V, D]}, w[v, k] = d[v, k/32] * q[v, k]
    (exact)
"w", the dequantised matrix, is required by eagle2_jax.backends.cpu.ops (calls over many rows, and the output
shape of a Dense kernel); leaves made here without it get it from `with_float32`.
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from . import kernels as cpu_kernels

BLOCK = 32


def is_packed(x) -> bool:
    return isinstance(x, Mapping) and ("q4" in x or "q8" in x)  # dict, or Flax's FrozenDict


def any_packed(params) -> bool:
    return isinstance(params, Mapping) and is_packed(params.get("embed"))


# ---- from GGUF blocks ------------------------------------------------------------------------------

def q4_1_blocks(raw: np.ndarray, rows: int, cols: int):
    """GGUF Q4_1 bytes of a [rows, cols] matrix -> (q uint8 [rows, cols], d, m float32 [rows, cols/32])."""
    b = np.asarray(raw, np.uint8).reshape(rows, cols // BLOCK, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)  # elements 0-15, 16-31
    return q, d, m


def q8_0_blocks(raw: np.ndarray, rows: int, cols: int):
    """GGUF Q8_0 bytes of a [rows, cols] matrix -> (q int8 [rows, cols], d float32 [rows, cols/32])."""
    b = np.asarray(raw, np.uint8).reshape(rows, cols // BLOCK, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return q, d


def pack_q4(q_KN: np.ndarray, d: np.ndarray, m: np.ndarray, lanes: int) -> dict:
    """A Dense kernel's nibbles q [K, N] and scales d, m [K/32, N] -> a packed leaf (see above)."""
    K, N = q_KN.shape
    if K % BLOCK or N % (2 * lanes) or d.shape != (K // BLOCK, N) or m.shape != d.shape:
        raise ValueError(f"cannot pack a [{K}, {N}] Q4_1 kernel: K must be a multiple of {BLOCK} "
                         f"and N of {2 * lanes}")
    g = np.asarray(q_KN, np.uint8).reshape(K, N // (2 * lanes), 2, lanes)
    q4 = (g[:, :, 0, :] | (g[:, :, 1, :] << 4)).reshape(K, N // 2)
    return {"q4": q4, "d": np.asarray(d, np.float32), "m": np.asarray(m, np.float32)}


def nibbles(leaf) -> jax.Array:
    """q [K, N] (uint8, 0..15) of a packed Q4 leaf."""
    q4 = leaf["q4"]
    *lead, K, half = q4.shape  # [L, K, N/2] for stacked layers
    lanes = cpu_kernels.lanes()
    if not lanes:
        raise RuntimeError("packed weights need the CPU kernels that packed them (eagle2_jax.backends.cpu.kernels)")
    g = q4.reshape(*lead, K, half // lanes, 1, lanes)
    return jnp.concatenate([g & 0x0F, g >> 4], axis=-2).reshape(*lead, K, 2 * half)


def dequantize(leaf) -> jax.Array:
    """The float32 matrix of a packed leaf ([K, N] for Q4, [V, D] for Q8), exactly as numpy's
    dequantisation gives it (the Q4 product is kept apart from the sum by an optimization barrier)."""
    if not is_packed(leaf):
        return leaf
    if "w" in leaf:
        return leaf["w"]
    if "q8" in leaf:
        return leaf["q8"].astype(jnp.float32) * jnp.repeat(leaf["d"], BLOCK, axis=1)
    q = nibbles(leaf).astype(jnp.float32)
    prod = jax.lax.optimization_barrier(jnp.repeat(leaf["d"], BLOCK, axis=-2) * q)
    return prod + jnp.repeat(leaf["m"], BLOCK, axis=-2)


def embed_rows(leaf, tokens) -> jax.Array:
    """Rows `tokens` of a (packed or plain) embedding [V, D], float32 for packed ones."""
    if not is_packed(leaf):
        return jnp.take(leaf, tokens, axis=0)
    q = jnp.take(leaf["q8"], tokens, axis=0).astype(jnp.float32)
    return q * jnp.repeat(jnp.take(leaf["d"], tokens, axis=0), BLOCK, axis=-1)


def with_float32(leaf) -> dict:
    """The leaf with its dequantised matrix "w" added (for calls over many rows)."""
    if not is_packed(leaf) or "w" in leaf:
        return leaf
    return {**leaf, "w": jax.jit(dequantize)(leaf)}


def matmul(x_MK, leaf) -> jax.Array:
    """x [M, K] @ w [K, N] for a packed Q4 kernel: the kernel for up to NN_MAX_ROWS rows."""
    if x_MK.shape[0] <= cpu_kernels.NN_MAX_ROWS and cpu_kernels.load():
        return cpu_kernels.q4_matmul(x_MK.astype(jnp.float32), leaf["q4"], leaf["d"], leaf["m"])
    return jnp.dot(x_MK.astype(jnp.float32), dequantize(leaf).reshape(x_MK.shape[1], -1))


def matmul_nt(x_MK, leaf) -> jax.Array:
    """x [M, K] @ w [N, K].T for a packed Q8 embedding used as the LM head (kernel: NT_MAX_ROWS)."""
    if x_MK.shape[0] <= cpu_kernels.NT_MAX_ROWS and cpu_kernels.load():
        return cpu_kernels.q8_matmul_nt(x_MK.astype(jnp.float32), leaf["q8"], leaf["d"])
    return jnp.dot(x_MK.astype(jnp.float32), dequantize(leaf).T)


def logical_size(params) -> int:
    """Number of weights a (possibly packed) param tree stands for."""
    total = 0
    for x in jax.tree_util.tree_leaves(params, is_leaf=is_packed):
        if is_packed(x):
            total += 2 * x["q4"].size if "q4" in x else x["q8"].size  # "w" repeats them
        else:
            total += x.size
    return total
