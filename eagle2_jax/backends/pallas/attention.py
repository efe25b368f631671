"""Tree attention as one Pallas kernel: reads only the live blocks of the KV cache.

`attend` (eagle2_jax.models.ops) on the XLA path materialises float32 scores over every cache slot,
[B, K, S, G*T], and passes over them several times (mask, max, exp, sum, the value product); at a
4K cache and batch 16 that is far more traffic than the cache itself. This kernel computes the
same attention with an online softmax over cache blocks of `block` slots: each (row, key/value
head) program walks only the blocks up to the last slot its mask allows (committed prefix and
scratch), then, when given, the call's own new keys under the tree mask (a forward that wrote them
into the cache first passes none), and writes [T, Dh] per query head.
Scores never leave the chip. On a GPU a small batch has few (row, head) pairs, so each walk is
split over E programs (flash-decoding: `split_count`) that write float32 partial sums, and XLA
combines them.

Same arguments and result as `Ops.attend`; query rows are padded to a power of two (at least 16,
the smallest matrix-unit tile), cache slots to a multiple of the block. Runs as Triton on GPU,
Mosaic on TPU, and in interpret mode anywhere (tests on CPU compare it with the XLA path).

Shape letters as listed in eagle2_jax/__init__.py, and here: Tp the padded query tokens, E the
programs (parts) of one walk over a row's live cache blocks.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

NEG_INF = -1e30  # as eagle2_jax.models.ops


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def _kernel(nblocks_ref, q_ref, k_ref, v_ref, mask_ref, *refs, G, block, splits):
    """refs: [new keys, new values, their mask,] then out, or (out, top, total) when the walk is
    split (`splits` > 1): this part's unnormalised sums and running max for `_combine`."""
    out_refs = refs[-3:] if splits > 1 else refs[-1:]
    new_refs = refs[:-len(out_refs)]
    f32 = jnp.float32
    n = nblocks_ref[pl.program_id(0)]
    # this program's share of the row's live blocks: [lo, hi), split evenly over the parts
    part, lo, hi = 0, 0, n
    if splits > 1:
        part = pl.program_id(2)
        per_part = (n + splits - 1) // splits
        lo = part * per_part
        hi = jnp.maximum(lo, jnp.minimum(lo + per_part, n))

    def update(q, carry, k, v, keep):
        top, total, acc = carry
        s = jnp.where(keep, lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=f32), NEG_INF)
        new_top = jnp.maximum(top, jnp.max(s, axis=1))
        p = jnp.exp(s - new_top[:, None])
        shrink = jnp.exp(top - new_top)
        acc = acc * shrink[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=f32)
        return new_top, total * shrink + jnp.sum(p, axis=1), acc

    for g in range(G):  # the G query heads sharing this key/value head
        q = q_ref[g]  # [Tp, Dh]
        Tp, Dh = q.shape
        # scaled in float32, then the cache's dtype: the query rows attend_xla forms
        q = (q.astype(f32) * (1.0 / math.sqrt(Dh))).astype(k_ref.dtype)

        def body(i, carry, q=q):
            start = pl.multiple_of(i * block, block)
            k = k_ref[pl.ds(start, block), :]
            v = v_ref[pl.ds(start, block), :]
            return update(q, carry, k, v, mask_ref[:, pl.ds(start, block)] != 0)
        carry = (jnp.full((Tp,), NEG_INF, f32), jnp.zeros((Tp,), f32), jnp.zeros((Tp, Dh), f32))
        carry = lax.fori_loop(lo, hi, body, carry)
        if new_refs:  # the call's own keys: in the last part
            kn_ref, vn_ref, maskn_ref = new_refs
            with_new = lambda c, q=q: update(q, c, kn_ref[...], vn_ref[...], maskn_ref[...] != 0)  # noqa: E731
            carry = with_new(carry) if splits == 1 else lax.cond(part == splits - 1, with_new, lambda c: c, carry)
        top, total, acc = carry
        if splits == 1:
            out_refs[0][g] = (acc / total[:, None]).astype(out_refs[0].dtype)
        else:
            for ref, x in zip(out_refs, (acc, top, total)):
                ref[g] = x


def _combine(acc_BKEGTD, top_BKEGT, total_BKEGT):
    """The parts of a split walk as one softmax: rescale each to the largest running max, sum."""
    w = jnp.exp(top_BKEGT - jnp.max(top_BKEGT, axis=2, keepdims=True))
    total = jnp.sum(w * total_BKEGT, axis=2)
    return jnp.sum(w[..., None] * acc_BKEGTD, axis=2) / total[..., None]  # [B, K, G, Tp, Dh]


PROGRAMS = 128  # about one per streaming multiprocessor (132 on an H100 / H200)
MIN_BLOCKS_PER_PART = 4


def split_count(B: int, K: int, blocks: int, backend: str) -> int:
    """How many programs walk one (row, key/value head)'s cache (flash-decoding).

    One program per (row, KV head) is B * K programs: 8 at batch 1 for an 8B Llama, 8 of an H200's
    132 SMs, each walking the whole cache and, in a 60-token tree verify (240 query rows per KV
    head), doing all of its matmuls. On a GPU the walk is split until there are about PROGRAMS
    programs, each part at least MIN_BLOCKS_PER_PART of the bucket's blocks; a TPU core runs the
    grid in sequence, so it keeps one walk. `blocks`: the cache bucket's blocks (static)."""
    if backend == "tpu":
        return 1
    return max(1, min(blocks // MIN_BLOCKS_PER_PART, PROGRAMS // max(B * K, 1)))


def live_blocks(mask_BTS, block: int) -> jax.Array:
    """[B] int32: cache blocks up to the last slot any query of the row may see."""
    S = mask_BTS.shape[-1]
    seen = jnp.any(mask_BTS, axis=1)  # [B, S]
    last = jnp.max(jnp.where(seen, jnp.arange(1, S + 1, dtype=jnp.int32)[None], 0), axis=1, initial=0)
    return (last + block - 1) // block


@functools.partial(jax.jit, static_argnames=("block", "backend", "splits"))
def tree_attention(q_BTHD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD=None, v_new_BKTD=None, mask_new_BTT=None, *,
                   block: int = 128, backend: str = "interpret", splits: Optional[int] = None):
    """`Ops.attend` as one kernel (without new keys/values: over the cache alone, as a forward that
    wrote them into the cache first). backend: "gpu" (Triton), "tpu" (Mosaic) or "interpret".
    splits: programs per (row, KV head) walk, E (None: `split_count`); with E > 1 the parts'
    partial sums are combined by XLA (`_combine`)."""
    B, T, H, Dh = q_BTHD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    G = H // K
    Tp = _pow2_at_least(T, 16)
    block = min(block, _pow2_at_least(S, 16))
    Sp = max(pl.cdiv(S, block), 1) * block  # an empty cache (a prefill's view) gets one masked block
    E = split_count(B, K, Sp // block, backend) if splits is None else splits
    dt = k_BKSD.dtype
    q = q_BTHD.reshape(B, T, K, G, Dh).transpose(0, 2, 3, 1, 4)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, Tp - T), (0, 0)))  # [B, K, G, Tp, Dh], scaled in the kernel
    mask = jnp.pad(mask_BTS, ((0, 0), (0, Tp - T), (0, Sp - S))).astype(jnp.int32)  # [B, Tp, Sp]
    if Sp != S:  # small caches only: buckets are multiples of the block
        k_BKSD = jnp.pad(k_BKSD, ((0, 0), (0, 0), (0, Sp - S), (0, 0)))
        v_BKSD = jnp.pad(v_BKSD, ((0, 0), (0, 0), (0, Sp - S), (0, 0)))
    new = ()
    if k_new_BKTD is not None:
        pad_new = ((0, 0), (0, 0), (0, Tp - T), (0, 0))
        new = (jnp.pad(k_new_BKTD.astype(dt), pad_new), jnp.pad(v_new_BKTD.astype(dt), pad_new),
               jnp.pad(mask_new_BTT, ((0, 0), (0, Tp - T), (0, Tp - T))).astype(jnp.int32))  # mask [B, Tp, Tp]
    nblocks = live_blocks(mask_BTS, block)

    # grid (B, K) or, split, (B, K, E); `*_` takes the part index where the block does not depend on it
    row = lambda *shape: pl.BlockSpec((None,) + shape, lambda b, h, *_: (b,) + (0,) * len(shape))  # noqa: E731
    head = lambda *shape: pl.BlockSpec((None, None) + shape, lambda b, h, *_: (b, h) + (0,) * len(shape))  # noqa: E731
    part = lambda *shape: pl.BlockSpec((None, None, None) + shape, lambda b, h, p: (b, h, p) + (0,) * len(shape))  # noqa: E731
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        scalars, params = pl.BlockSpec(memory_space=pltpu.SMEM), None
    else:
        scalars = pl.BlockSpec((B,), lambda *_: (0,))
        params = None
        if backend == "gpu":
            from jax.experimental.pallas import triton as pltriton
            params = pltriton.CompilerParams(num_warps=4, num_stages=2)
    if E == 1:
        grid, out_specs = (B, K), head(G, Tp, Dh)
        out_shape = jax.ShapeDtypeStruct((B, K, G, Tp, Dh), q_BTHD.dtype)
        out_bytes = q.size * q.dtype.itemsize
    else:
        f32 = jnp.float32
        grid, out_specs = (B, K, E), [part(G, Tp, Dh), part(G, Tp), part(G, Tp)]
        out_shape = [jax.ShapeDtypeStruct((B, K, E, G, Tp, Dh), f32), jax.ShapeDtypeStruct((B, K, E, G, Tp), f32),
                     jax.ShapeDtypeStruct((B, K, E, G, Tp), f32)]
        out_bytes = B * K * E * G * Tp * (Dh + 2) * 4
    live = B * K * (Sp * Dh * 2 * jnp.dtype(dt).itemsize)  # an upper bound: every block live
    Tn = Tp if new else 0
    cost = pl.CostEstimate(flops=4 * B * H * Tp * (Sp + Tn) * Dh, transcendentals=B * H * Tp * (Sp + Tn),
                           bytes_accessed=live + q.size * q.dtype.itemsize + out_bytes + mask.size * 4)
    out = pl.pallas_call(
        functools.partial(_kernel, G=G, block=block, splits=E),
        grid=grid,
        in_specs=[scalars, head(G, Tp, Dh), head(Sp, Dh), head(Sp, Dh), row(Tp, Sp)] + (
            [head(Tp, Dh), head(Tp, Dh), row(Tp, Tp)] if new else []),
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=backend == "interpret",
        compiler_params=params,
        cost_estimate=cost,
        name="tree_attention",
    )(nblocks, q, k_BKSD, v_BKSD, mask, *new)
    if E > 1:
        out = _combine(*out).astype(q_BTHD.dtype)
    return out[:, :, :, :T].transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh)
