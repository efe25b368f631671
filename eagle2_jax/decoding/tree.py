"""EAGLE-2's dynamic draft tree with static shapes: expand (draft passes, candidate pool) and
rerank (top N-1 of the pool, parents before children, ancestor mask, depths).

The pool (Q = W + passes*W*W candidates, W = top_k; letters as listed in eagle2_jax/__init__.py) is
in level-major order: [root's W children][pass 1: W*W][pass 2: W*W]...; a candidate's pool parent
always has a lower index, and its score (cumulative log-prob) never exceeds its parent's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ..config import TreeConfig
from ..models.cache import KVCache
from ..models.draft import draft_apply, draft_own_topk
from ..models.layers import top_log_probs
from ..models.target import target_embed, target_logits
from .spec import RoundSpec


@struct.dataclass
class Pool:
    tokens_BQ: jax.Array  # int32 candidate tokens
    scores_BQ: jax.Array  # float32 cumulative log-probs
    parents_BQ: jax.Array  # int32 pool index of the parent, -1 for the root's children


@struct.dataclass
class Tree:
    tokens_BN: jax.Array  # node 0 is the root
    parents_BN: jax.Array  # node index of the parent within the tree, -1 for the root
    ancestors_BNN: jax.Array  # bool: node i sees node j (j is i or an ancestor of i)
    depths_BN: jax.Array  # 0 for the root


def _take_rows(x_BW, idx_BJ):
    """x[b, idx[b, j]] for trailing dims too, as a one-hot selection over the W rows (exact: one
    term per output)."""
    hit = idx_BJ[:, :, None] == jnp.arange(x_BW.shape[1])[None, None]  # [B, J, W]
    hit = hit.reshape(hit.shape + (1,) * (x_BW.ndim - 2))
    if x_BW.dtype == jnp.bool_:
        return jnp.any(hit & x_BW[:, None], axis=2)
    return jnp.sum(jnp.where(hit, x_BW[:, None], jnp.zeros((), x_BW.dtype)), axis=2, dtype=x_BW.dtype)


def draft_topk(spec: RoundSpec, params, h, k: int):
    """The draft's k best next tokens and their log-probs from hidden states h [..., D].

    With a `vocab_head` in the draft params (a frequent-token subset, FR-Spec style: `ids` [V'] and
    the matching LM-head columns `w` [D, V']), the draft ranks only that subset, which makes each
    draft pass's LM head V/V' times cheaper; verification always uses the full vocabulary, so this
    changes which tokens are proposed, never what is accepted.
    """
    dparams = params["draft"]
    if spec.draft.aux_layers:  # EAGLE-3: the head's own norm, LM head and draft vocabulary
        return draft_own_topk(spec.draft, dparams, h, k)
    vh = dparams.get("vocab_head") if isinstance(dparams, dict) else None
    if vh is None:
        score, tok = top_log_probs(target_logits(spec.target, params["target"], h), k)
        return score, tok.astype(jnp.int32)
    score, idx = top_log_probs(spec.target.ops.vocab_logits(h, vh), k)
    return score, jnp.take(vh["ids"], idx, mode="clip").astype(jnp.int32)


def expand(spec: RoundSpec, params, dcache: KVCache, hidden_BD: jax.Array):
    """Grow the candidate pool of spec.tree from the draft's last hidden state (the root's prediction).

    Tree nodes' draft keys/values go to the draft cache's scratch slots length + level*W + j and
    are never committed. Returns (Pool, draft cache).
    """
    W, passes = spec.tree.top_k, spec.tree.passes
    B, D = hidden_BD.shape
    score_BW, tok_BW = draft_topk(spec, params, hidden_BD, W)
    pool_tok, pool_score = [tok_BW], [score_BW]
    pool_parent = [jnp.full((B, W), -1, jnp.int32)]
    frontier_idx = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))  # pool index
    parent_h = jnp.broadcast_to(hidden_BD[:, None, :], (B, W, D))
    slots = W * passes  # U: draft scratch slots, W nodes per pass
    anc_BWU = jnp.broadcast_to(jax.nn.one_hot(jnp.arange(W), slots, dtype=bool), (B, W, slots))
    base = W
    for level in range(passes):
        emb = target_embed(spec.target, params["target"], tok_BW)
        pos = jnp.broadcast_to((dcache.length + level)[:, None], (B, W))
        h_BWD, dcache = draft_apply(spec.draft, params["draft"], emb, parent_h, pos, dcache, anc_BWU, offset=level * W)
        child_score, child_tok = draft_topk(spec, params, h_BWD, W)  # [B, W, W]
        cand = (score_BW[:, :, None] + child_score).reshape(B, W * W)
        cand_tok = child_tok.reshape(B, W * W).astype(jnp.int32)
        pool_tok.append(cand_tok)
        pool_score.append(cand)
        pool_parent.append(jnp.repeat(frontier_idx, W, axis=1))
        if level + 1 < passes:
            score_BW, pick = jax.lax.top_k(cand, W)
            parent = pick // W
            tok_BW = _take_rows(cand_tok, pick)
            frontier_idx = (base + pick).astype(jnp.int32)
            parent_h = _take_rows(h_BWD, parent)
            own = jax.nn.one_hot((level + 1) * W + jnp.arange(W), slots, dtype=bool)
            anc_BWU = _take_rows(anc_BWU, parent) | own[None]
        base += W * W
    pool = Pool(jnp.concatenate(pool_tok, 1), jnp.concatenate(pool_score, 1), jnp.concatenate(pool_parent, 1))
    return pool, dcache


def rerank(pool: Pool, root_B: jax.Array, tree: TreeConfig) -> Tree:
    """Keep the N-1 best candidates, in pool order, under the root; build mask and depths."""
    N = tree.total_tokens
    B = root_B.shape[0]
    if N == 1:
        return Tree(root_B[:, None].astype(jnp.int32), jnp.full((B, 1), -1, jnp.int32),
                    jnp.ones((B, 1, 1), bool), jnp.zeros((B, 1), jnp.int32))
    _, top = jax.lax.top_k(pool.scores_BQ, N - 1)  # ties: lower index (the parent) first
    sel = jnp.sort(top, axis=1)
    toks = jnp.take_along_axis(pool.tokens_BQ, sel, axis=1, mode="promise_in_bounds")
    ppool = jnp.take_along_axis(pool.parents_BQ, sel, axis=1, mode="promise_in_bounds")
    node_of = jax.vmap(lambda s: jnp.zeros((pool.scores_BQ.shape[1],), jnp.int32)
                       .at[s].set(jnp.arange(1, N, dtype=jnp.int32)))(sel)
    pnode_at = jnp.take_along_axis(node_of, jnp.maximum(ppool, 0), axis=1, mode="promise_in_bounds")
    pnode = jnp.where(ppool < 0, 0, pnode_at)
    tokens = jnp.concatenate([root_B[:, None].astype(jnp.int32), toks], axis=1)
    parents = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), pnode], axis=1)
    # ancestors by following parent pointers: the tree is at most passes + 1 edges deep, and each
    # hop is a gather on [B, N] indices, so the whole mask is one small fused computation
    ids = jnp.arange(N, dtype=jnp.int32)
    anc = jnp.broadcast_to(jnp.eye(N, dtype=bool), (B, N, N))
    up = parents
    for hop in range(tree.passes + 1):
        anc = anc | (up[:, :, None] == ids[None, None, :])  # (-1, above the root, matches no node)
        if hop < tree.passes:
            hop_up = jnp.take_along_axis(parents, jnp.maximum(up, 0), axis=1, mode="promise_in_bounds")
            up = jnp.where(up < 0, -1, hop_up)
    depths = jnp.sum(anc, axis=-1, dtype=jnp.int32) - 1
    return Tree(tokens, parents, anc, depths)
