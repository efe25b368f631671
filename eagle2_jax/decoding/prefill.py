"""What plain decoding and EAGLE-2 share before and around their rounds: the prompt's prefill into a
fresh target cache, the first token, the per-row output state both keep (`Rows`), and the padded
batch's device inputs. Plain decoding stays its own reference path: nothing here knows of drafts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..models.cache import advance, init_cache
from ..models.layers import causal_mask
from ..models.target import Llama, Target, target_apply, target_logits
from ..sharding import constrain_cache, put_global
from .batching import Batch, eos_value
from .outputs import emit
from .sampling import SamplingParams, row_keys, sample_rows, step_keys


@struct.dataclass
class Rows:
    """Per-row output and bookkeeping, the same in every decoding state."""
    out_BM: jax.Array  # emitted tokens
    n_out_B: jax.Array  # emitted count per row
    done_B: jax.Array
    max_new_B: jax.Array
    keys_B: jax.Array  # per-row PRNG keys
    step: jax.Array  # scalar step / round counter
    eos: jax.Array  # scalar (-1: none)


def prefill(module: Llama, params, prompt_BP, prompt_len_B, cache_len: int, mesh=None, aux_layers: tuple = ()):
    """Causal forward over right-padded prompts into a fresh cache.

    Returns (features [B,P,D] -- or, with `aux_layers`, the hidden states entering those layers
    [B,P,A*D] (an EAGLE-3 head's input) --, cache committed to each prompt's length, last-token
    logits [B,V]).
    """
    B, P = prompt_BP.shape
    c = module.config
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    cache = init_cache(c.num_hidden_layers, B, cache_len, c.num_key_value_heads, c.head_dim, module.dtype)
    cache = constrain_cache(cache, mesh)
    out = target_apply(module, params, prompt_BP, pos, cache, causal_mask(B, P), fresh=True, aux_layers=aux_layers)
    feats, cache = out[:2]
    cache = advance(cache, prompt_len_B)
    last = jnp.take_along_axis(feats, (prompt_len_B - 1)[:, None, None], axis=1, mode="promise_in_bounds")[:, 0]
    return (out[2] if aux_layers else feats), cache, target_logits(module, params, last)


def first_token(logits_BV, active_B, max_new, eos, seed, sampling, out_len: int):
    """The first token of each row, sampled from the prefill's logits with the row's step-0 key, and the
    rows' output state holding it (inactive padding rows are done from the start)."""
    B = logits_BV.shape[0]
    keys = row_keys(jax.random.PRNGKey(seed), B)
    first = sample_rows(step_keys(keys, 0), logits_BV, sampling)
    max_new_B = jnp.where(active_B, max_new, 0).astype(jnp.int32)
    out, n_out, done, _ = emit(jnp.zeros((B, out_len), jnp.int32), jnp.zeros((B,), jnp.int32), ~active_B,
                               first[:, None], jnp.ones((B,), jnp.int32), max_new_B, eos)
    return first, Rows(out, n_out, done, max_new_B, keys, jnp.int32(1), eos)


def device_inputs(target: Target, b: Batch):
    """The padded batch's prompts, lengths and active rows on the target's devices (rows on `data`)."""
    active = np.arange(b.prompt_BP.shape[0]) < b.num_rows
    arrays = (b.prompt_BP, b.prompt_len_B, active)
    if target.mesh is None:
        return tuple(map(jnp.asarray, arrays))
    rows = jax.sharding.NamedSharding(target.mesh, jax.sharding.PartitionSpec("data"))
    return tuple(put_global(a, rows) for a in arrays)


def prefill_args(target: Target, params: dict, b: Batch, max_new_tokens, eos_token_id, seed, sampling) -> tuple:
    """The dynamic arguments of a PREFILL program: (params, prompts, lengths, active rows, max_new, eos,
    seed, sampling values)."""
    prompt, plen, active = device_inputs(target, b)
    return (params, prompt, plen, active, np.int32(max_new_tokens),  # numpy scalars: replicated
            np.int32(eos_value(eos_token_id)), np.uint32(seed), SamplingParams.of(sampling))
