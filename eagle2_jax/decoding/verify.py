"""Acceptance of a verified tree: greedy and lossless sampling.

Both return (path_BC, n_accept_B, bonus_B): path[b, d] is the tree node at depth d of the
accepted path (root first; entries past n_accept are padding), n_accept counts the committed
tokens (root included), bonus is the next root sampled from the target.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import SamplingConfig
from ..models.layers import NEG_INF
from .sampling import categorical, process_logits
from .tree import Tree


def path_to(tree: Tree, node_B: jax.Array, length: int) -> jax.Array:
    """Nodes on the root->node path ordered by depth, padded with 0: [B, length]."""
    anc = jnp.take_along_axis(tree.ancestors_BNN, node_B[:, None, None], axis=1,
                              mode="promise_in_bounds")[:, 0]  # [B, N]
    at_depth = anc[:, None, :] & (tree.depths_BN[:, None, :] == jnp.arange(length)[None, :, None])
    return jnp.argmax(at_depth, axis=-1).astype(jnp.int32)  # 0 where no node at that depth


def accept_greedy(tree: Tree, logits_BNV: jax.Array, max_len: int):
    g = jnp.argmax(logits_BNV, axis=-1).astype(jnp.int32)  # target's choice after each node
    want = jnp.take_along_axis(g, jnp.maximum(tree.parents_BN, 0), axis=1, mode="promise_in_bounds")
    correct = (tree.tokens_BN == want) | (tree.parents_BN < 0)
    accepted = ~jnp.any(tree.ancestors_BNN & ~correct[:, None, :], axis=-1)
    best = jnp.argmax(jnp.where(accepted, tree.depths_BN, -1), axis=1).astype(jnp.int32)
    n_acc = jnp.take_along_axis(tree.depths_BN, best[:, None], axis=1, mode="promise_in_bounds")[:, 0] + 1
    bonus = jnp.take_along_axis(g, best[:, None], axis=1, mode="promise_in_bounds")[:, 0]
    return path_to(tree, best, max_len), n_acc, bonus


def _walk_row(q_N, parents_N, skip_N, key):
    """Sampling acceptance for one row (nodes are level-major, siblings in draft-score order).

    At the current node try its children in order: accept child x with probability p[x]/sum(p),
    where p is the node's target distribution with the already rejected siblings zeroed; on
    rejection zero p[x]. Accepting moves to the child with its fresh target distribution.
    Only scalars are carried: q_N[j] = p_parent(x_j) (fixed per node; sum(p) = 1 minus the mass
    rejected so far at the current node). skip_N marks a repeated sibling token (its p[x] is
    already zero: never accepted). Returns the final node.
    """
    N = q_N.shape[0]
    u = jax.random.uniform(key, (N,), jnp.float32)

    def body(j, carry):
        cur, removed = carry
        mine = (parents_N[j] == cur) & ~skip_N[j]
        take = mine & (u[j] * (1.0 - removed) < q_N[j])
        removed = jnp.where(take, 0.0, jnp.where(mine, removed + q_N[j], removed))
        return jnp.where(take, j, cur), removed

    cur, _ = jax.lax.fori_loop(1, N, body, (jnp.int32(0), jnp.float32(0.0)))
    return cur


def _bonus_row(logits_V, tokens_N, parents_N, cur, key):
    """The next token from the final node's processed logits minus its children (all rejected).

    A residual with no mass left (every live token was a child, the last one rejected only because
    float32 rounding left 1 - removed a hair above its probability: an event of probability zero in
    exact arithmetic) falls back to the node's own distribution, never to a filtered-out token."""
    rejected = jnp.zeros(logits_V.shape, bool).at[tokens_N].max(parents_N == cur)
    residual = jnp.where(rejected, NEG_INF, logits_V)
    empty = jnp.all(residual <= NEG_INF)
    return categorical(key, jnp.where(empty, logits_V, residual))


def accept_sampling(tree: Tree, logits_BNV: jax.Array, keys_B: jax.Array, max_len: int,
                    sampling: SamplingConfig):
    """Lossless tree acceptance at temperature > 0 (recursive rejection over each node's children).

    One pass over the [B, N, V] logits (processing + log-sum-exp); the walk itself is scalar."""
    x = process_logits(logits_BNV, sampling)  # [B, N, V] float32, filtered entries NEG_INF
    lse = jax.nn.logsumexp(x, axis=-1)  # [B, N]
    N = tree.tokens_BN.shape[1]
    par = jnp.maximum(tree.parents_BN, 0)
    x_par = jax.vmap(lambda xb, a, t: xb[a, t])(x, par, tree.tokens_BN)  # [B, N]: parent's logit of x_j
    q = jnp.exp(x_par - jnp.take_along_axis(lse, par, axis=1, mode="promise_in_bounds"))  # p_parent(x_j)
    earlier = jnp.tril(jnp.ones((N, N), bool), -1)[None]  # k < j
    same = (tree.parents_BN[:, :, None] == tree.parents_BN[:, None, :]) & \
        (tree.tokens_BN[:, :, None] == tree.tokens_BN[:, None, :])
    skip = jnp.any(same & earlier, axis=-1)
    k_walk, k_bonus = jnp.moveaxis(jax.vmap(jax.random.split)(keys_B), 1, 0)
    cur = jax.vmap(_walk_row)(q, tree.parents_BN, skip, k_walk)
    x_cur = jnp.take_along_axis(x, cur[:, None, None], axis=1, mode="promise_in_bounds")[:, 0]  # [B, V]
    bonus = jax.vmap(_bonus_row)(x_cur, tree.tokens_BN, tree.parents_BN, cur, k_bonus)
    n_acc = jnp.take_along_axis(tree.depths_BN, cur[:, None], axis=1, mode="promise_in_bounds")[:, 0] + 1
    return path_to(tree, cur, max_len), n_acc, bonus
