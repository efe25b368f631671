"""EAGLE-2's dynamic draft tree with static shapes: expand (draft passes, candidate pool) and
rerank (top N-1 of the pool, parents before children, ancestor mask, depths).

K = top_k, D = depth, N = total_tokens; the pool holds K + D*K*K candidates in level-major order:
[root's K children][pass 1: K*K][pass 2: K*K]...; a candidate's pool parent always has a lower
index, and its score (cumulative log-prob) never exceeds its parent's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from .cache import KVCache
from .config import TreeConfig
from .draft import EagleDraft, draft_apply, draft_own_topk
from .model import Llama, target_embed, target_logits
from .sampling import top_log_probs


@struct.dataclass
class Pool:
    tokens_BP: jax.Array  # int32 candidate tokens
    scores_BP: jax.Array  # float32 cumulative log-probs
    parents_BP: jax.Array  # int32 pool index of the parent, -1 for the root's children


@struct.dataclass
class Tree:
    tokens_BN: jax.Array  # node 0 is the root
    parents_BN: jax.Array  # node index of the parent within the tree, -1 for the root
    ancestors_BNN: jax.Array  # bool: node i sees node j (j is i or an ancestor of i)
    depths_BN: jax.Array  # 0 for the root


def _take_rows(x_BK, idx_BJ):
    """x[b, idx[b, j]] for trailing dims too, as a one-hot selection over the K rows (exact: one
    term per output)."""
    hit = idx_BJ[:, :, None] == jnp.arange(x_BK.shape[1])[None, None]  # [B, J, K]
    hit = hit.reshape(hit.shape + (1,) * (x_BK.ndim - 2))
    if x_BK.dtype == jnp.bool_:
        return jnp.any(hit & x_BK[:, None], axis=2)
    return jnp.sum(jnp.where(hit, x_BK[:, None], jnp.zeros((), x_BK.dtype)), axis=2, dtype=x_BK.dtype)


def draft_topk(tmodule: Llama, tparams, dmodule, dparams, h, k: int):
    """The draft's k best next tokens and their log-probs from hidden states h [..., D].

    With a `vocab_head` in the draft params (a frequent-token subset, FR-Spec style: `ids` [V'] and
    the matching LM-head columns `w` [D, V']), the draft ranks only that subset, which makes each
    draft pass's LM head V/V' times cheaper; verification always uses the full vocabulary, so this
    changes which tokens are proposed, never what is accepted.
    """
    if dmodule.aux_layers:  # EAGLE-3: the head's own norm, LM head and draft vocabulary
        return draft_own_topk(dmodule, dparams, h, k)
    vh = dparams.get("vocab_head") if isinstance(dparams, dict) else None
    if vh is None:
        score, tok = top_log_probs(target_logits(tmodule, tparams, h), k)
        return score, tok.astype(jnp.int32)
    score, idx = top_log_probs(tmodule.ops.vocab_logits(h, vh), k)
    return score, jnp.take(vh["ids"], idx, mode="clip").astype(jnp.int32)


def expand(tmodule: Llama, tparams, dmodule: EagleDraft, dparams, dcache: KVCache,
           hidden_BD: jax.Array, tree: TreeConfig):
    """Grow the candidate pool from the draft's last hidden state (the root's prediction).

    Tree nodes' draft keys/values go to the draft cache's scratch slots length + level*K + j and
    are never committed. Returns (Pool, draft cache).
    """
    K, D = tree.top_k, tree.passes
    B, Dm = hidden_BD.shape
    score_BK, tok_BK = draft_topk(tmodule, tparams, dmodule, dparams, hidden_BD, K)
    pool_tok, pool_score = [tok_BK], [score_BK]
    pool_parent = [jnp.full((B, K), -1, jnp.int32)]
    frontier_idx = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K))  # pool index
    parent_h = jnp.broadcast_to(hidden_BD[:, None, :], (B, K, Dm))
    slots = K * D  # draft scratch slots: K nodes per pass
    anc_BKU = jnp.broadcast_to(jax.nn.one_hot(jnp.arange(K), slots, dtype=bool), (B, K, slots))
    base = K
    for level in range(D):
        emb = target_embed(tmodule, tparams, tok_BK)
        pos = jnp.broadcast_to((dcache.length + level)[:, None], (B, K))
        h_BKD, dcache = draft_apply(dmodule, dparams, emb, parent_h, pos, dcache, anc_BKU, offset=level * K)
        child_score, child_tok = draft_topk(tmodule, tparams, dmodule, dparams, h_BKD, K)  # [B, K, K]
        cand = (score_BK[:, :, None] + child_score).reshape(B, K * K)
        cand_tok = child_tok.reshape(B, K * K).astype(jnp.int32)
        pool_tok.append(cand_tok)
        pool_score.append(cand)
        pool_parent.append(jnp.repeat(frontier_idx, K, axis=1))
        if level + 1 < D:
            score_BK, pick = jax.lax.top_k(cand, K)
            parent = pick // K
            tok_BK = _take_rows(cand_tok, pick)
            frontier_idx = (base + pick).astype(jnp.int32)
            parent_h = _take_rows(h_BKD, parent)
            own = jax.nn.one_hot((level + 1) * K + jnp.arange(K), slots, dtype=bool)
            anc_BKU = _take_rows(anc_BKU, parent) | own[None]
        base += K * K
    pool = Pool(jnp.concatenate(pool_tok, 1), jnp.concatenate(pool_score, 1), jnp.concatenate(pool_parent, 1))
    return pool, dcache


def rerank(pool: Pool, root_B: jax.Array, tree: TreeConfig) -> Tree:
    """Keep the N-1 best candidates, in pool order, under the root; build mask and depths."""
    N = tree.total_tokens
    B = root_B.shape[0]
    if N == 1:
        return Tree(root_B[:, None].astype(jnp.int32), jnp.full((B, 1), -1, jnp.int32),
                    jnp.ones((B, 1, 1), bool), jnp.zeros((B, 1), jnp.int32))
    _, top = jax.lax.top_k(pool.scores_BP, N - 1)  # ties: lower index (the parent) first
    sel = jnp.sort(top, axis=1)
    toks = jnp.take_along_axis(pool.tokens_BP, sel, axis=1, mode="promise_in_bounds")
    ppool = jnp.take_along_axis(pool.parents_BP, sel, axis=1, mode="promise_in_bounds")
    node_of = jax.vmap(lambda s: jnp.zeros((pool.scores_BP.shape[1],), jnp.int32)
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
