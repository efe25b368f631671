"""EAGLE-2 generation: a prefill program, then a decode program, a `lax.while_loop` of
fixed-shape rounds on device.

One round: expand -> rerank -> verify (one target forward over the N tree tokens) -> accept ->
compact (commit the accepted path's target KV) -> catch-up (the draft consumes the accepted
tokens with their target features; draft KV of tree nodes is never committed).

Compile keys: PREFILL per (batch bucket, prompt bucket, cache bucket); LOOP per (batch bucket,
cache bucket, tree, greedy or sampling). Prompt length and max_new_tokens are arrays in the
state, and temperature / top-k / top-p traced values (sampling.SamplingParams).
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .batching import GenerateOutput, eos_value, prepare_batch
from .cache import KVCache, advance, compact, init_cache
from .config import SamplingConfig, TreeConfig
from .draft import Draft, EagleDraft, check_compatible, draft_apply
from .layers import causal_mask
from .model import Llama, Target, is_abstract, target_apply, target_embed, target_logits
from .outputs import emit
from .sampling import SamplingParams, row_keys, sample_rows, step_keys
from .sharding import batch_multiple, constrain_cache
from .tree import expand, rerank
from .programs import Program, run
from .vanilla import _device_inputs, prefill
from .verify import accept_greedy, accept_sampling


@struct.dataclass
class EagleState:
    tcache: KVCache  # target cache (committed tokens)
    dcache: KVCache  # draft cache, same committed length as the target's
    root_B: jax.Array  # last emitted token: the next tree's root (in the draft cache, not the target's)
    hidden_BD: jax.Array  # draft hidden state at the last committed position
    out_BM: jax.Array
    n_out_B: jax.Array
    done_B: jax.Array
    max_new_B: jax.Array
    keys_B: jax.Array
    accept_BR: jax.Array  # tokens added per round (bonus included)
    rounds_B: jax.Array
    step: jax.Array
    eos: jax.Array


def draft_catch_up(tmodule, tparams, dmodule, dparams, dcache: KVCache, tokens_BC, features_BCD, n_B,
                   fresh: bool = False):
    """Draft forward over C (token, preceding target feature) pairs; commits n_B of them (`fresh`:
    the draft cache is empty, as after the prompt's prefill).

    Returns (hidden at the last committed pair [B, D], new draft cache).
    """
    B, C = tokens_BC.shape
    emb = target_embed(tmodule, tparams, tokens_BC)
    pos = dcache.length[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
    h, dcache = draft_apply(dmodule, dparams, emb, features_BCD, pos, dcache, causal_mask(B, C), fresh=fresh)
    last = jnp.take_along_axis(h, jnp.maximum(n_B - 1, 0)[:, None, None], axis=1, mode="promise_in_bounds")[:, 0]
    return last, advance(dcache, n_B)


def init_state(tmodule: Llama, tparams, dmodule: EagleDraft, dparams, prompt_BP, prompt_len_B,
               active_B, max_new, eos, seed, *, cache_len, out_len, sampling, tree, mesh=None):
    B, P = prompt_BP.shape
    feats, tcache, logits_BV = prefill(tmodule, tparams, prompt_BP, prompt_len_B, cache_len, mesh,
                                       aux_layers=dmodule.aux_layers)
    keys = row_keys(jax.random.PRNGKey(seed), B)
    root = sample_rows(step_keys(keys, 0), logits_BV, sampling)
    # draft pairs (f_j, t_{j+1}) for j < len: prompt shifted left, the root in the last slot
    j = jnp.arange(P)[None]
    shifted = jnp.concatenate([prompt_BP[:, 1:], jnp.zeros((B, 1), prompt_BP.dtype)], axis=1)
    dtok = jnp.where(j == (prompt_len_B - 1)[:, None], root[:, None], shifted)
    c = dmodule.config
    dcache = constrain_cache(init_cache(1, B, cache_len, c.num_key_value_heads, c.head_dim, dmodule.dtype), mesh)
    hidden, dcache = draft_catch_up(tmodule, tparams, dmodule, dparams, dcache, dtok, feats, prompt_len_B, fresh=True)
    max_new_B = jnp.where(active_B, max_new, 0).astype(jnp.int32)
    out = jnp.zeros((B, out_len), jnp.int32)
    out, n_out, done, _ = emit(out, jnp.zeros((B,), jnp.int32), ~active_B, root[:, None],
                               jnp.ones((B,), jnp.int32), max_new_B, eos)
    rounds_cap = out_len  # every round adds at least one token
    return EagleState(tcache, dcache, root, hidden, out, n_out, done, max_new_B, keys,
                      jnp.zeros((B, rounds_cap), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.int32(1), eos)


def eagle_round(tmodule: Llama, tparams, dmodule: EagleDraft, dparams, st: EagleState,
                sampling: SamplingParams, tree: TreeConfig) -> EagleState:
    B = st.root_B.shape[0]
    C = tree.max_accept
    active = ~st.done_B
    # expand + rerank
    pool, dcache = expand(tmodule, tparams, dmodule, dparams, st.dcache, st.hidden_BD, tree)
    t = rerank(pool, st.root_B, tree)
    # verify: one target forward over the tree, positions by depth, ancestor mask
    pos = st.tcache.length[:, None] + t.depths_BN
    out = target_apply(tmodule, tparams, t.tokens_BN, pos, st.tcache, t.ancestors_BNN, aux_layers=dmodule.aux_layers)
    feats, tcache = out[:2]
    logits = target_logits(tmodule, tparams, feats)  # [B, N, V] float32
    draft_feats = out[2] if dmodule.aux_layers else feats  # what the draft reads (EAGLE-3: three layers)
    # accept
    if sampling.greedy:
        path, n_acc, bonus = accept_greedy(t, logits, C)
    else:
        path, n_acc, bonus = accept_sampling(t, logits, step_keys(st.keys_B, st.step), C, sampling)
    n_acc = jnp.where(active, n_acc, 0)
    # compact: the accepted path's target KV goes right after the committed prefix
    tcache = compact(tcache, path, n_acc)
    # emit: accepted draft tokens then the bonus
    d = jnp.arange(C)[None]
    path_tok = jnp.take_along_axis(t.tokens_BN, path, axis=1, mode="promise_in_bounds")  # [B, C], root first
    nxt = jnp.concatenate([path_tok[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    new_tok = jnp.where(d == (n_acc - 1)[:, None], bonus[:, None], nxt)
    out, n_out, done, added = emit(st.out_BM, st.n_out_B, st.done_B, new_tok, n_acc, st.max_new_B, st.eos)
    # catch-up: pairs (feature of path node d, token after it)
    path_feat = jnp.take_along_axis(draft_feats, path[:, :, None], axis=1, mode="promise_in_bounds")
    hidden, dcache = draft_catch_up(tmodule, tparams, dmodule, dparams, dcache, new_tok, path_feat, n_acc)
    r = jnp.minimum(st.rounds_B, st.accept_BR.shape[1] - 1)
    accept = st.accept_BR.at[jnp.arange(B), r].set(jnp.where(active, n_acc, st.accept_BR[jnp.arange(B), r]))
    keep = lambda new, old: jnp.where(active.reshape((B,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    return st.replace(tcache=tcache, dcache=dcache, root_B=keep(bonus, st.root_B),
                      hidden_BD=keep(hidden, st.hidden_BD), out_BM=out, n_out_B=n_out, done_B=done,
                      accept_BR=accept, rounds_B=st.rounds_B + active.astype(jnp.int32), step=st.step + 1)


def scratch_slots(tree: TreeConfig) -> int:
    """Cache slots needed past the committed length: the verified tree, the draft's tree nodes,
    the catch-up pairs."""
    return max(tree.total_tokens, tree.top_k * tree.passes, tree.max_accept) + 1


def _prefill(tparams, dparams, prompt_BP, prompt_len_B, active_B, max_new, eos, seed, sampling, *, tmodule,
             dmodule, cache_len, out_len, tree, mesh):
    return init_state(tmodule, tparams, dmodule, dparams, prompt_BP, prompt_len_B, active_B, max_new, eos,
                      seed, cache_len=cache_len, out_len=out_len, sampling=sampling, tree=tree, mesh=mesh)


def _loop(tparams, dparams, st, sampling, *, tmodule, dmodule, tree):
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done_B),
                              lambda s: eagle_round(tmodule, tparams, dmodule, dparams, s, sampling, tree), st)


def _step(tparams, dparams, st, sampling, *, tmodule, dmodule, tree):
    return eagle_round(tmodule, tparams, dmodule, dparams, st, sampling, tree)


PREFILL = Program(_prefill, ("tmodule", "dmodule", "cache_len", "out_len", "tree", "mesh"))
LOOP = Program(_loop, ("tmodule", "dmodule", "tree"), donate=("st",), loop=True)
STEP = Program(_step, ("tmodule", "dmodule", "tree"))
# The streaming driver's step: it replaces the state every round, so the caches are updated in place
# (STEP, which leaves its input intact for calibration walks that reuse it, copies every cache buffer;
# timing tools run this one on fresh copies of the state).
STREAM_STEP = Program(_step, ("tmodule", "dmodule", "tree"), donate=("st",))


def _program_inputs(target: Target, draft: Draft, prompts, max_new_tokens, eos_token_id, seed, sampling, tree):
    """The padded batch, the dynamic arguments and the static settings of PREFILL (LOOP takes its state)."""
    b = prepare_batch(prompts, max_new_tokens, vocab_size=target.config.vocab_size,
                      max_positions=target.config.max_position_embeddings, slack=scratch_slots(tree),
                      batch_multiple=batch_multiple(target.mesh))
    prompt, plen, active = _device_inputs(target, b)
    args = (target.params, draft.params, prompt, plen, active, np.int32(max_new_tokens),  # numpy: replicated
            np.int32(eos_value(eos_token_id)), np.uint32(seed), SamplingParams.of(sampling))
    static = dict(tmodule=target.module, dmodule=draft.module, cache_len=b.cache_len,
                  out_len=b.cache_len, tree=tree, mesh=target.mesh)  # cache_len >= max_new + max_accept
    return b, args, static


def start(target: Target, draft: Draft, prompts, *, max_new_tokens: int, tree: TreeConfig,
          sampling: SamplingConfig = SamplingConfig(), eos_token_id: Optional[int] = None, seed: int = 0):
    """(state after prefill and the first token, padded batch): for tools that step rounds themselves
    (STEP / STREAM_STEP with `tree` or any smaller tree of the same depth and top_k)."""
    b, args, static = _program_inputs(target, draft, prompts, max_new_tokens, eos_token_id, seed, sampling, tree)
    return PREFILL(*args, **static), b


def generate(target: Target, draft: Draft, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, eos_token_id: Optional[int] = None, seed: int = 0,
             tree=None, stream: Optional[Callable[[int, list], None]] = None,
             timings: Optional[dict] = None, compile_only: bool = False) -> Optional[GenerateOutput]:
    """EAGLE-2 speculative decoding of token-id prompts; lossless with respect to the target.

    `tree`: a TreeConfig; None: the head's tree for this platform, else the reference tree
    (eagle2_jax.defaults, as the command line); "auto": the tree size timed on this machine
    (eagle2_jax.autotune, as `--total-tokens auto`). Returns `.tokens` (new tokens per prompt, EOS
    kept) and `.accept_lengths` (tokens added per round, bonus included; tau is their mean). With `stream`, rounds are stepped from the host.
    With `timings` (a dict), records compile_s and run_s. With `compile_only`, compiles the prefill
    and decode programs these prompts and settings need (cached for later calls), runs nothing and
    returns None; it also works for abstract params (load_target(..., abstract=True)).
    """
    if tree is None:
        from .defaults import default_tree
        tree = default_tree(draft)
    elif isinstance(tree, str) and tree == "auto":
        from .autotune import choose_tree
        from .defaults import default_tree
        base = default_tree(draft)
        tree = choose_tree(target, draft, prompts, depth=base.depth, top_k=base.top_k).tree
    if not isinstance(tree, TreeConfig):
        raise ValueError(f"tree must be a TreeConfig, 'auto' or None, got {tree!r}")
    check_compatible(draft.config, target.config)
    sampling = SamplingConfig(temperature, top_k, top_p)
    if tree.top_k > target.config.vocab_size:
        raise ValueError(f"tree top_k {tree.top_k} exceeds the vocabulary ({target.config.vocab_size})")
    if draft.proposal_vocab_size is not None and tree.top_k > draft.proposal_vocab_size:
        raise ValueError(f"tree top_k {tree.top_k} exceeds the draft head's vocabulary ({draft.proposal_vocab_size})")
    if (target.abstract or is_abstract(draft.params)) and not compile_only:
        raise ValueError("this target or draft has abstract params (shapes only): use compile_only=True")
    b, args, static = _program_inputs(target, draft, prompts, max_new_tokens, eos_token_id, seed, sampling, tree)
    st = run(PREFILL, LOOP, STREAM_STEP, args, static, (target.params, draft.params),
             dict(tmodule=target.module, dmodule=draft.module, tree=tree), b.num_rows,
             stream, timings, compile_only)
    if compile_only:
        return None
    out, n_out, acc, rounds = st.out_BM, st.n_out_B, st.accept_BR, st.rounds_B
    from .sharding import to_host
    out, n_out, acc, rounds = map(to_host, (out, n_out, acc, rounds))
    rows = range(b.num_rows)
    return GenerateOutput(tokens=[out[r, :n_out[r]].tolist() for r in rows],
                          accept_lengths=[acc[r, :rounds[r]].tolist() for r in rows],
                          rounds=[int(rounds[r]) for r in rows])
