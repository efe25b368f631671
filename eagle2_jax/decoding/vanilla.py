"""Plain (autoregressive) decoding: a prefill program, then a decode program (`lax.while_loop` of
single-token steps) keyed by (batch bucket, cache bucket, spec: the target alone, greedy or sampling).
The reference path of the identity tests: it shares the prefill and the row state with EAGLE-2
(decoding.prefill) and never calls into the EAGLE round."""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct

from ..config import SamplingConfig
from ..models.cache import KVCache, advance
from ..models.target import Target, target_apply, target_logits
from ..sharding import batch_multiple, to_host
from .batching import GenerateOutput, prepare_batch
from .outputs import emit
from .prefill import Rows, first_token, prefill, prefill_args
from .programs import decoder, run
from .sampling import SamplingParams, sample_rows, step_keys
from .spec import RoundSpec, params_of


@struct.dataclass
class DecodeState(Rows):
    cache: KVCache
    token_B: jax.Array  # last emitted token, fed next


def init_state(spec: RoundSpec, params, prompt_BP, prompt_len_B, active_B, max_new, eos, seed, *,
               cache_len: int, out_len: int, sampling, mesh=None) -> DecodeState:
    _, cache, logits_BV = prefill(spec.target, params["target"], prompt_BP, prompt_len_B, cache_len, mesh)
    first, rows = first_token(logits_BV, active_B, max_new, eos, seed, sampling, out_len)
    return DecodeState(**vars(rows), cache=cache, token_B=first)


def decode_step(spec: RoundSpec, params, st: DecodeState, sampling: SamplingParams) -> DecodeState:
    B = st.token_B.shape[0]
    pos = st.cache.length[:, None]
    tp = params["target"]
    feats, cache = target_apply(spec.target, tp, st.token_B[:, None], pos, st.cache, jnp.ones((B, 1, 1), bool))
    cache = advance(cache, jnp.where(st.done_B, 0, 1))
    logits = target_logits(spec.target, tp, feats[:, 0])
    nxt = sample_rows(step_keys(st.keys_B, st.step), logits, sampling)
    out, n_out, done, _ = emit(st.out_BM, st.n_out_B, st.done_B, nxt[:, None],
                               jnp.ones((B,), jnp.int32), st.max_new_B, st.eos)
    return st.replace(cache=cache, token_B=nxt, out_BM=out, n_out_B=n_out, done_B=done, step=st.step + 1)


def _prefill(params, prompt_BP, prompt_len_B, active_B, max_new, eos, seed, sampling, *, spec, cache_len, out_len,
             mesh):
    return init_state(spec, params, prompt_BP, prompt_len_B, active_B, max_new, eos, seed, cache_len=cache_len,
                      out_len=out_len, sampling=sampling, mesh=mesh)


PREFILL, LOOP, STEP, STREAM_STEP = PROGRAMS = decoder(_prefill, decode_step)


def program_inputs(target: Target, prompts, max_new_tokens, eos_token_id, seed, sampling):
    """The padded batch, the dynamic arguments and the static settings of PREFILL (LOOP takes its state)."""
    b = prepare_batch(prompts, max_new_tokens, vocab_size=target.config.vocab_size,
                      max_positions=target.config.max_position_embeddings, slack=1,
                      batch_multiple=batch_multiple(target.mesh))
    args = prefill_args(target, params_of(target), b, max_new_tokens, eos_token_id, seed, sampling)
    static = dict(spec=RoundSpec.of(target), cache_len=b.cache_len, out_len=b.cache_len, mesh=target.mesh)
    return b, args, static


def start(target: Target, prompts, *, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
          eos_token_id: Optional[int] = None, seed: int = 0):
    """(state after prefill and the first token, padded batch): for tools that step decoding themselves
    (STEP / STREAM_STEP with RoundSpec.of(target))."""
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
    st = run(PROGRAMS, args, static, static["spec"], b.num_rows, stream, timings, compile_only, gpu_graphs)
    if compile_only:
        return None
    return _collect(st.out_BM, st.n_out_B, b.num_rows)


def _collect(out, n_out, rows):
    out, n_out = to_host(out), to_host(n_out)
    return GenerateOutput(tokens=[out[r, :n_out[r]].tolist() for r in range(rows)])
