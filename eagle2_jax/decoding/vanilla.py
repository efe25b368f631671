"""Plain (autoregressive) decoding: a prefill program, then a decode program (`lax.while_loop` of
single-token steps) keyed by (batch bucket, cache bucket, greedy or sampling) only."""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .batching import GenerateOutput, eos_value, prepare_batch
from ..models.cache import KVCache, advance, init_cache
from ..config import SamplingConfig
from ..models.layers import causal_mask
from ..models.target import Llama, Target, target_apply, target_logits
from .outputs import emit
from .programs import Program, run
from .sampling import SamplingParams, row_keys, sample_rows, step_keys
from ..sharding import batch_multiple, constrain_cache, put_global, to_host


@struct.dataclass
class DecodeState:
    cache: KVCache
    token_B: jax.Array  # last emitted token, fed next
    out_BM: jax.Array  # emitted tokens
    n_out_B: jax.Array  # emitted count per row
    done_B: jax.Array
    max_new_B: jax.Array
    keys_B: jax.Array  # per-row PRNG keys
    step: jax.Array  # scalar step counter
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


def init_state(module, params, prompt_BP, prompt_len_B, active_B, max_new, eos, seed, *,
               cache_len: int, out_len: int, sampling: SamplingConfig, mesh=None):
    B = prompt_BP.shape[0]
    _, cache, logits_BV = prefill(module, params, prompt_BP, prompt_len_B, cache_len, mesh)
    keys = row_keys(jax.random.PRNGKey(seed), B)
    first = sample_rows(step_keys(keys, 0), logits_BV, sampling)
    out = jnp.zeros((B, out_len), jnp.int32)
    max_new_B = jnp.where(active_B, max_new, 0).astype(jnp.int32)
    out, n_out, done, _ = emit(out, jnp.zeros((B,), jnp.int32), ~active_B, first[:, None],
                               jnp.ones((B,), jnp.int32), max_new_B, eos)
    return DecodeState(cache, first, out, n_out, done, max_new_B, keys, jnp.int32(1), eos)


def decode_step(module: Llama, params, st: DecodeState, sampling: SamplingParams) -> DecodeState:
    B = st.token_B.shape[0]
    pos = st.cache.length[:, None]
    feats, cache = target_apply(module, params, st.token_B[:, None], pos, st.cache, jnp.ones((B, 1, 1), bool))
    cache = advance(cache, jnp.where(st.done_B, 0, 1))
    logits = target_logits(module, params, feats[:, 0])
    nxt = sample_rows(step_keys(st.keys_B, st.step), logits, sampling)
    out, n_out, done, _ = emit(st.out_BM, st.n_out_B, st.done_B, nxt[:, None],
                               jnp.ones((B,), jnp.int32), st.max_new_B, st.eos)
    return st.replace(cache=cache, token_B=nxt, out_BM=out, n_out_B=n_out, done_B=done, step=st.step + 1)


def _prefill(params, prompt_BP, prompt_len_B, active_B, max_new, eos, seed, sampling, *, module, cache_len,
             out_len, mesh):
    return init_state(module, params, prompt_BP, prompt_len_B, active_B, max_new, eos, seed,
                      cache_len=cache_len, out_len=out_len, sampling=sampling, mesh=mesh)


def _loop(params, st, sampling, *, module):
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done_B), lambda s: decode_step(module, params, s, sampling), st)


def _step(params, st, sampling, *, module):
    return decode_step(module, params, st, sampling)


PREFILL = Program(_prefill, ("module", "cache_len", "out_len", "mesh"))
LOOP = Program(_loop, ("module",), donate=("st",), loop=True)
STEP = Program(_step, ("module",))
STREAM_STEP = Program(_step, ("module",), donate=("st",))  # see eagle.STREAM_STEP


def _prepare(target: Target, prompts, max_new_tokens, slack: int):
    return prepare_batch(prompts, max_new_tokens, vocab_size=target.config.vocab_size,
                         max_positions=target.config.max_position_embeddings, slack=slack,
                         batch_multiple=batch_multiple(target.mesh))


def device_inputs(target: Target, b):
    """The padded batch's prompts, lengths and active rows on the target's devices (rows on `data`)."""
    active = np.arange(b.prompt_BP.shape[0]) < b.num_rows
    arrays = (b.prompt_BP, b.prompt_len_B, active)
    if target.mesh is None:
        return tuple(map(jnp.asarray, arrays))
    rows = jax.sharding.NamedSharding(target.mesh, jax.sharding.PartitionSpec("data"))
    return tuple(put_global(a, rows) for a in arrays)


def program_inputs(target: Target, prompts, max_new_tokens, eos_token_id, seed, sampling):
    """The padded batch, the dynamic arguments and the static settings of PREFILL (LOOP takes its state)."""
    b = _prepare(target, prompts, max_new_tokens, slack=1)
    prompt, plen, active = device_inputs(target, b)
    args = (target.params, prompt, plen, active, np.int32(max_new_tokens),  # numpy scalars: replicated
            np.int32(eos_value(eos_token_id)), np.uint32(seed), SamplingParams.of(sampling))
    static = dict(module=target.module, cache_len=b.cache_len, out_len=b.cache_len, mesh=target.mesh)
    return b, args, static


def start(target: Target, prompts, *, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
          eos_token_id: Optional[int] = None, seed: int = 0):
    """(state after prefill and the first token, padded batch): for tools that step decoding themselves."""
    b, args, static = program_inputs(target, prompts, max_new_tokens, eos_token_id, seed, sampling)
    return PREFILL(*args, **static), b


def generate_vanilla(target: Target, prompts, *, max_new_tokens: int, temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = 0, eos_token_id: Optional[int] = None,
                     seed: int = 0, stream: Optional[Callable[[int, list], None]] = None,
                     timings: Optional[dict] = None, compile_only: bool = False,
                     gpu_graphs: str = "body") -> Optional[GenerateOutput]:
    """Plain decoding of a batch of token-id prompts; one compiled `lax.while_loop` on device.

    With `stream`, steps from the host instead and calls stream(row, new_tokens) as tokens come.
    With `timings` (a dict), records compile_s and run_s. With `compile_only`, compiles the program
    these prompts and settings need (cached for later calls), runs nothing and returns None.
    `gpu_graphs`: the decode loop's CUDA graphs on a GPU (eagle2_jax.decoding.programs).
    """
    sampling = SamplingConfig(temperature, top_k, top_p)
    if target.abstract and not compile_only:
        raise ValueError("this target has abstract params (shapes only): use compile_only=True")
    b, args, static = program_inputs(target, prompts, max_new_tokens, eos_token_id, seed, sampling)
    st = run(PREFILL, LOOP, STREAM_STEP, args, static, (target.params,), dict(module=target.module),
             b.num_rows, stream, timings, compile_only, gpu_graphs)
    if compile_only:
        return None
    return _collect(st.out_BM, st.n_out_B, b.num_rows)


def _collect(out, n_out, rows):
    out, n_out = to_host(out), to_host(n_out)
    return GenerateOutput(tokens=[out[r, :n_out[r]].tolist() for r in range(rows)])
