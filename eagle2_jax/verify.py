"""Acceptance of a verified tree: greedy and lossless sampling.

Both return (path_BC, n_accept_B, bonus_B): path[b, d] is the tree node at depth d of the
accepted path (root first; entries past n_accept are padding), n_accept counts the committed
tokens (root included), bonus is the next root sampled from the target.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import SamplingConfig
from .layers import NEG_INF
from .sampling import target_probs
from .tree import Tree


def path_to(tree: Tree, node_B: jax.Array, length: int) -> jax.Array:
    """Nodes on the root->node path ordered by depth, padded with 0: [B, length]."""
    anc = jnp.take_along_axis(tree.ancestors_BNN, node_B[:, None, None], axis=1)[:, 0]  # [B, N]
    at_depth = anc[:, None, :] & (tree.depths_BN[:, None, :] == jnp.arange(length)[None, :, None])
    return jnp.argmax(at_depth, axis=-1).astype(jnp.int32)  # 0 where no node at that depth


def accept_greedy(tree: Tree, logits_BNV: jax.Array, max_len: int):
    g = jnp.argmax(logits_BNV, axis=-1).astype(jnp.int32)  # target's choice after each node
    want = jnp.take_along_axis(g, jnp.maximum(tree.parents_BN, 0), axis=1)
    correct = (tree.tokens_BN == want) | (tree.parents_BN < 0)
    accepted = ~jnp.any(tree.ancestors_BNN & ~correct[:, None, :], axis=-1)
    best = jnp.argmax(jnp.where(accepted, tree.depths_BN, -1), axis=1).astype(jnp.int32)
    n_acc = jnp.take_along_axis(tree.depths_BN, best[:, None], axis=1)[:, 0] + 1
    bonus = jnp.take_along_axis(g, best[:, None], axis=1)[:, 0]
    return path_to(tree, best, max_len), n_acc, bonus


def _walk_row(probs_NV, tokens_N, parents_N, key):
    """Sampling acceptance for one row (nodes are level-major, siblings in draft-score order).

    At the current node try its children in order: accept child x with probability p[x]/sum(p);
    on rejection zero p[x]. Accepting moves to the child with its fresh target distribution.
    The bonus is drawn from what remains of p at the final node.
    """
    N = tokens_N.shape[0]
    k_u, k_bonus = jax.random.split(key)
    u = jax.random.uniform(k_u, (N,), jnp.float32)

    def body(j, carry):
        cur, p = carry
        x = tokens_N[j]
        mine = parents_N[j] == cur
        px = p[x]
        take = mine & (u[j] * jnp.sum(p) < px)
        reject = mine & ~take
        p = jnp.where(take, probs_NV[j], jnp.where(reject, p.at[x].set(0.0), p))
        return jnp.where(take, j, cur), p

    cur, p = jax.lax.fori_loop(1, N, body, (jnp.int32(0), probs_NV[0]))
    bonus = jax.random.categorical(k_bonus, jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), NEG_INF))
    return cur, bonus.astype(jnp.int32)


def accept_sampling(tree: Tree, logits_BNV: jax.Array, keys_B: jax.Array, max_len: int,
                    sampling: SamplingConfig):
    probs = target_probs(logits_BNV, sampling)
    cur, bonus = jax.vmap(_walk_row)(probs, tree.tokens_BN, tree.parents_BN, keys_B)
    n_acc = jnp.take_along_axis(tree.depths_BN, cur[:, None], axis=1)[:, 0] + 1
    return path_to(tree, cur, max_len), n_acc, bonus
