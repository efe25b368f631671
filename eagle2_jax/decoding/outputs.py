"""On-device output buffer shared by the decoders: append tokens, stop rows at EOS / max_new."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def emit(out_BM, n_out_B, done_B, tokens_BC, count_B, max_new_B, eos):
    """Append the first count[b] of tokens[b] to row b; returns (out, n_out, done, added_B).

    Tokens after an EOS or beyond max_new are not counted. `out` must have C slots of slack
    beyond max_new: the C-wide write at n_out never clamps, and whatever lands past n_out is
    ignored (rows that are done keep their n_out).
    """
    C = tokens_BC.shape[1]
    idx = jnp.arange(C)[None, :]
    is_eos = (idx < count_B[:, None]) & (tokens_BC == eos)
    first_eos = jnp.min(jnp.where(is_eos, idx, C), axis=1)
    count = jnp.minimum(jnp.minimum(count_B, first_eos + 1), max_new_B - n_out_B)
    count = jnp.where(done_B, 0, jnp.maximum(count, 0))
    # out[b, n_out[b] + c] = tokens[b, c] as one select over the buffer: a per-row
    # dynamic_update_slice is a scatter, which XLA's TPU compiler runs as a loop over the rows
    hit_BMC = (jnp.arange(out_BM.shape[1])[None, :, None] - n_out_B[:, None, None]) == idx[None]
    picked_BM = jnp.sum(jnp.where(hit_BMC, tokens_BC.astype(out_BM.dtype)[:, None, :], 0), axis=2)
    out = jnp.where(jnp.any(hit_BMC, axis=2), picked_BM, out_BM)
    n_out = n_out_B + count
    done = done_B | (first_eos < count) | (n_out >= max_new_B)
    return out, n_out, done, count
