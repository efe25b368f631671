"""The EAGLE-2 round, whole: decode state, the three phases, and the programs that run them.

One round (`eagle_round`) is three public phases over fixed shapes:
  draft_tree         expand (the draft's passes, the candidate pool) and rerank (the N-node tree)
  verify_tree        one target forward over the N tree tokens (ancestor mask, positions by depth)
  accept_and_commit  accept (greedy or lossless sampling), compact (the accepted path's target KV
                     after the committed prefix), emit, catch-up (the draft consumes the accepted
                     tokens with their target features; the draft KV of tree nodes is never committed)
A spec without a tree runs a plain round (`plain_round`): the root alone is verified.
Timing tools (infer.roundcost, infer.analytic) compile these same functions.

Every function takes the round's spec (spec.RoundSpec: the networks, the tree) and the weights in one
pytree ({"target": ..., "draft": ...}). Programs (programs.decoder): PREFILL (the prompt into both
caches and the first token) per (batch bucket, prompt bucket, cache bucket); LOOP (a `lax.while_loop`
of rounds on device), STEP and STREAM_STEP per (batch bucket, cache bucket, spec, greedy or sampling).
Prompt length and max_new_tokens are arrays in the state, temperature / top-k / top-p traced values
(sampling.SamplingParams).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from ..config import SamplingConfig, TreeConfig
from ..models.cache import KVCache, advance, compact, init_cache
from ..models.draft import Draft, draft_apply
from ..models.layers import causal_mask
from ..models.target import Target, target_apply, target_embed, target_logits
from ..sharding import batch_multiple, constrain_cache
from .batching import prepare_batch
from .outputs import emit
from .prefill import Rows, first_token, prefill, prefill_args
from .programs import decoder
from .sampling import SamplingParams, step_keys
from .spec import RoundSpec, params_of
from .tree import Tree, expand, rerank
from .verify import accept_greedy, accept_sampling


@struct.dataclass
class EagleState(Rows):
    tcache: KVCache  # target cache (committed tokens)
    dcache: KVCache  # draft cache, same committed length as the target's
    root_B: jax.Array  # last emitted token: the next tree's root (in the draft cache, not the target's)
    hidden_BD: jax.Array  # draft hidden state at the last committed position
    accept_BR: jax.Array  # tokens added per round (bonus included)
    rounds_B: jax.Array


def draft_catch_up(spec: RoundSpec, params, dcache: KVCache, tokens_BC, features_BCD, n_B, fresh: bool = False):
    """Draft forward over C (token, preceding target feature) pairs; commits n_B of them (`fresh`:
    the draft cache is empty, as after the prompt's prefill).

    Returns (hidden at the last committed pair [B, D], new draft cache).
    """
    B, C = tokens_BC.shape
    emb = target_embed(spec.target, params["target"], tokens_BC)
    pos = dcache.length[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
    h, dcache = draft_apply(spec.draft, params["draft"], emb, features_BCD, pos, dcache, causal_mask(B, C),
                            fresh=fresh)
    last = jnp.take_along_axis(h, jnp.maximum(n_B - 1, 0)[:, None, None], axis=1, mode="promise_in_bounds")[:, 0]
    return last, advance(dcache, n_B)


def init_state(spec: RoundSpec, params, prompt_BP, prompt_len_B, active_B, max_new, eos, seed, *, cache_len,
               out_len, sampling, mesh=None) -> EagleState:
    B, P = prompt_BP.shape
    feats, tcache, logits_BV = prefill(spec.target, params["target"], prompt_BP, prompt_len_B, cache_len, mesh,
                                       aux_layers=spec.draft.aux_layers)
    root, rows = first_token(logits_BV, active_B, max_new, eos, seed, sampling, out_len)
    # draft pairs (f_j, t_{j+1}) for j < len: prompt shifted left, the root in the last slot
    j = jnp.arange(P)[None]
    shifted = jnp.concatenate([prompt_BP[:, 1:], jnp.zeros((B, 1), prompt_BP.dtype)], axis=1)
    dtok = jnp.where(j == (prompt_len_B - 1)[:, None], root[:, None], shifted)
    c = spec.draft.config
    dcache = constrain_cache(init_cache(1, B, cache_len, c.num_key_value_heads, c.head_dim, spec.draft.dtype), mesh)
    hidden, dcache = draft_catch_up(spec, params, dcache, dtok, feats, prompt_len_B, fresh=True)
    rounds_cap = out_len  # every round adds at least one token
    return EagleState(**vars(rows), tcache=tcache, dcache=dcache, root_B=root, hidden_BD=hidden,
                      accept_BR=jnp.zeros((B, rounds_cap), jnp.int32), rounds_B=jnp.zeros((B,), jnp.int32))


@struct.dataclass
class Verified:
    """What one target forward over a tree gives the acceptance (`verify_tree`)."""
    logits_BNV: jax.Array  # float32 target logits after each tree node
    features_BND: jax.Array  # what the draft's catch-up reads per node (EAGLE-3: the aux layers' states)
    tcache: KVCache  # the target cache with the tree's keys/values written after the committed prefix


def draft_tree(spec: RoundSpec, params, st: EagleState):
    """Phase 1, draft: expand the candidate pool from the draft's hidden state, rerank it into the
    N-node tree under the root. Returns (Tree, draft cache with the tree nodes' scratch entries)."""
    pool, dcache = expand(spec, params, st.dcache, st.hidden_BD)
    return rerank(pool, st.root_B, spec.tree), dcache


def verify_tree(spec: RoundSpec, params, st: EagleState, t: Tree) -> Verified:
    """Phase 2, verify: one target forward over the N tree tokens, positions by depth, attention over
    the committed prefix and the ancestor mask."""
    pos = st.tcache.length[:, None] + t.depths_BN
    aux = spec.draft.aux_layers
    out = target_apply(spec.target, params["target"], t.tokens_BN, pos, st.tcache, t.ancestors_BNN, aux_layers=aux)
    feats, tcache = out[:2]
    return Verified(target_logits(spec.target, params["target"], feats), out[2] if aux else feats, tcache)


def accept_and_commit(spec: RoundSpec, params, st: EagleState, t: Tree, v: Verified, dcache: KVCache,
                      sampling: SamplingParams, max_accept: int, catch_up: bool = True) -> EagleState:
    """Phase 3, accept and commit: the longest correct path (greedy or lossless sampling; at most
    `max_accept` tokens, a TreeConfig's), its target keys/values compacted after the committed
    prefix, its tokens and the bonus emitted, and the draft caught up on them (`catch_up` False: a
    server that never drafts leaves the draft behind). Rows already done keep their state."""
    B = st.root_B.shape[0]
    C = max_accept
    active = ~st.done_B
    if sampling.greedy:
        path, n_acc, bonus = accept_greedy(t, v.logits_BNV, C)
    else:
        path, n_acc, bonus = accept_sampling(t, v.logits_BNV, step_keys(st.keys_B, st.rounds_B + 1), C, sampling)
    if sampling.mixed:  # per row: a greedy row (temperature 0) keeps the greedy path
        g = jnp.broadcast_to(sampling.greedy_rows(n_acc), n_acc.shape)
        path, n_acc, bonus = (jnp.where(g.reshape(g.shape + (1,) * (a.ndim - 1)), a, b)
                              for a, b in zip(accept_greedy(t, v.logits_BNV, C), (path, n_acc, bonus)))
    n_acc = jnp.where(active, n_acc, 0)
    # one verified node (plain rounds) already sits at the commit position: nothing to move
    tcache = advance(v.tcache, n_acc) if C == 1 else compact(v.tcache, path, n_acc)
    # the accepted draft tokens (the path after its root), then the bonus
    d = jnp.arange(C)[None]
    path_tok = jnp.take_along_axis(t.tokens_BN, path, axis=1, mode="promise_in_bounds")  # [B, C], root first
    nxt = jnp.concatenate([path_tok[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    new_tok = jnp.where(d == (n_acc - 1)[:, None], bonus[:, None], nxt)
    out, n_out, done, _ = emit(st.out_BM, st.n_out_B, st.done_B, new_tok, n_acc, st.max_new_B, st.eos)
    # catch-up: pairs (feature of path node d, token after it)
    if catch_up:
        path_feat = jnp.take_along_axis(v.features_BND, path[:, :, None], axis=1, mode="promise_in_bounds")
        hidden, dcache = draft_catch_up(spec, params, dcache, new_tok, path_feat, n_acc)
    else:
        hidden = st.hidden_BD
    r = jnp.minimum(st.rounds_B, st.accept_BR.shape[1] - 1)
    accept = st.accept_BR.at[jnp.arange(B), r].set(jnp.where(active, n_acc, st.accept_BR[jnp.arange(B), r]))
    keep = lambda new, old: jnp.where(active.reshape((B,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    return st.replace(tcache=tcache, dcache=dcache, root_B=keep(bonus, st.root_B),
                      hidden_BD=keep(hidden, st.hidden_BD), out_BM=out, n_out_B=n_out, done_B=done,
                      accept_BR=accept, rounds_B=st.rounds_B + active.astype(jnp.int32), step=st.step + 1)


def eagle_round(spec: RoundSpec, params, st: EagleState, sampling: SamplingParams) -> EagleState:
    """One EAGLE-2 round: draft, verify, accept and commit (a spec without a tree: a plain round)."""
    if spec.tree is None:
        return plain_round(spec, params, st, sampling)
    t, dcache = draft_tree(spec, params, st)
    v = verify_tree(spec, params, st, t)
    return accept_and_commit(spec, params, st, t, v, dcache, sampling, spec.tree.max_accept)


def root_only(root_B: jax.Array) -> Tree:
    """The tree of the root alone: verifying it is one step of plain decoding."""
    B = root_B.shape[0]
    return Tree(root_B[:, None], jnp.full((B, 1), -1, jnp.int32), jnp.ones((B, 1, 1), bool),
                jnp.zeros((B, 1), jnp.int32))


def plain_round(spec: RoundSpec, params, st: EagleState, sampling: SamplingParams) -> EagleState:
    """One step of plain decoding on the EAGLE state (no drafting; every row adds one token, exactly
    plain decoding's): where no tree pays (a large batch), a server or generation takes these
    rounds. With spec.catch_up the draft consumes the token, so tree rounds can follow at any time."""
    t = root_only(st.root_B)
    v = verify_tree(spec, params, st, t)
    return accept_and_commit(spec, params, st, t, v, st.dcache, sampling, 1, spec.catch_up)


def scratch_slots(tree: Optional[TreeConfig]) -> int:
    """Cache slots needed past the committed length: the verified tree, the draft's tree nodes,
    the catch-up pairs (a plain round: those of the one-node tree)."""
    tree = tree or TreeConfig(1, 1, 1)
    return max(tree.total_tokens, tree.top_k * tree.passes, tree.max_accept) + 1


def _prefill(params, prompt_BP, prompt_len_B, active_B, max_new, eos, seed, sampling, *, spec, cache_len, out_len,
             mesh):
    return init_state(spec, params, prompt_BP, prompt_len_B, active_B, max_new, eos, seed, cache_len=cache_len,
                      out_len=out_len, sampling=sampling, mesh=mesh)


PREFILL, LOOP, STEP, STREAM_STEP = PROGRAMS = decoder(_prefill, eagle_round)


def program_inputs(target: Target, draft: Draft, prompts, max_new_tokens, eos_token_id, seed, sampling,
                   slack: int, cache_len: Optional[int] = None):
    """The padded batch, the dynamic arguments and the static settings of PREFILL (LOOP takes its state);
    `slack`: cache slots a round needs past the committed tokens (scratch_slots of its tree);
    `cache_len`: a fixed cache bucket (a serving engine's), else the prompts' own."""
    b = prepare_batch(prompts, max_new_tokens, vocab_size=target.config.vocab_size,
                      max_positions=target.config.max_position_embeddings, slack=slack,
                      batch_multiple=batch_multiple(target.mesh), cache_len=cache_len)
    args = prefill_args(target, params_of(target, draft), b, max_new_tokens, eos_token_id, seed, sampling)
    static = dict(spec=RoundSpec.of(target, draft), cache_len=b.cache_len, out_len=b.cache_len,
                  mesh=target.mesh)  # cache_len >= max_new + max_accept
    return b, args, static


def start(target: Target, draft: Draft, prompts, *, max_new_tokens: int, tree: TreeConfig,
          sampling: SamplingConfig = SamplingConfig(), eos_token_id: Optional[int] = None, seed: int = 0):
    """(state after prefill and the first token, padded batch): for tools that step rounds themselves
    (STEP / STREAM_STEP with RoundSpec.of(target, draft, tree), or any smaller tree of the same depth
    and top_k)."""
    b, args, static = program_inputs(target, draft, prompts, max_new_tokens, eos_token_id, seed, sampling,
                                     scratch_slots(tree))
    return PREFILL(*args, **static), b
