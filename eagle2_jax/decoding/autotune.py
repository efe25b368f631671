"""Choose the tree size for the hardware at hand (EAGLE-2's `total_token=-1` idea).

Tokens per round are measured, not guessed: a calibration walk of real greedy rounds with the
largest candidate tree reads off, for every smaller size N at the same state, how many tokens that
tree would have accepted (see `ACCEPT_RANKS`). Round cost is timed on device for each candidate N
(the donating step the generation loop runs). The chosen N maximises tau(N) / cost(N).

The draft's own estimate (a node's exp(score), the product of confidences along its path, taken
as its chance of acceptance: tau ~= 1 + sum of the N-1 largest) is reported beside the measurement;
on SmolLM2 it was low for N = 2 and high for N >= 3, which is why it no longer decides.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..config import SamplingConfig, TreeConfig
from ..models.target import target_apply, target_logits
from .defaults import REFERENCE_TREE, for_batch, head_tree
from .eagle import STEP, STREAM_STEP, start
from .programs import Program
from .sampling import SamplingParams
from .spec import RoundSpec, params_of
from .tree import expand, rerank
from .verify import accept_greedy

CANDIDATES = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclasses.dataclass
class TreeChoice:
    tree: TreeConfig
    table: list  # per candidate: dict(total_tokens, expected_tau (measured), estimated_tau (draft scores),
    #   round_ms, tokens_per_s)


def _accept_ranks(params, st, *, spec: RoundSpec):
    """One greedy verification of spec.tree, read for every smaller tree of the same depth and top_k.

    A candidate never outscores its parent and score ties go to the lower pool index (the parent),
    so the top-(n-1) selections for n <= N are nested and ancestor-closed, and the pool of a
    smaller tree (fewer draft passes) holds all of them. The n-node tree therefore contains exactly
    the nodes of this tree's accepted path whose score rank is < n-1 -- a prefix of the path, ranks
    growing with depth -- and its greedy acceptance (bonus included) is 1 + their count.

    Returns ranks_BC (score rank of the accepted path's drafted nodes in depth order, C = max_accept;
    the root and the entries past the path hold N), scores_BJ (the J = N-1 best cumulative
    log-probs, descending) and active_B (rows still generating)."""
    tree = spec.tree
    N = tree.total_tokens
    pool, _ = expand(spec, params, st.dcache, st.hidden_BD)
    scores, top = jax.lax.top_k(pool.scores_BQ, N - 1)  # score order, as rerank ranks them
    B, Q = pool.scores_BQ.shape
    rank_of = jax.vmap(lambda t: jnp.full((Q,), N, jnp.int32).at[t].set(jnp.arange(N - 1, dtype=jnp.int32)))(top)
    t = rerank(pool, st.root_B, tree)  # node i >= 1 is pool entry sort(top)[i-1]
    node_rank = jnp.concatenate([jnp.full((B, 1), N, jnp.int32),
                                 jnp.take_along_axis(rank_of, jnp.sort(top, axis=1), axis=1)], axis=1)
    pos = st.tcache.length[:, None] + t.depths_BN
    feats, _ = target_apply(spec.target, params["target"], t.tokens_BN, pos, st.tcache, t.ancestors_BNN)
    path, n_acc, _ = accept_greedy(t, target_logits(spec.target, params["target"], feats), tree.max_accept)
    d = jnp.arange(path.shape[1])[None]
    ranks = jnp.where((d >= 1) & (d < n_acc[:, None]), jnp.take_along_axis(node_rank, path, axis=1), N)
    return ranks, scores, ~st.done_B


ACCEPT_RANKS = Program(_accept_ranks, ("spec",))


@dataclasses.dataclass
class Acceptance:
    """Per calibration sample (a row in a round): what each tree size accepts."""
    ranks: np.ndarray  # [S, C] see _accept_ranks
    scores: np.ndarray  # [samples, N-1] draft cumulative log-probs, descending

    def measured_tau(self, n: int) -> float:
        """Mean tokens per round (bonus included) of the n-node tree, greedy."""
        return 1.0 + float((self.ranks < n - 1).sum(axis=1).mean())

    def estimated_tau(self, n: int) -> float:
        """The draft's own estimate: 1 + sum of the n-1 best exp(score)."""
        return 1.0 + float(np.exp(self.scores[:, :n - 1].astype(np.float64)).sum(axis=1).mean())


def calibrate(target, draft, st, tree: TreeConfig, rounds: int):
    """Walk `rounds` real greedy rounds of `tree` from state `st`, measuring acceptance for every
    smaller size on the way. Returns (Acceptance, the state after the walk)."""
    params, spec = params_of(target, draft), RoundSpec.of(target, draft, tree)
    ranks, scores = [], []
    for _ in range(rounds):
        r, s, active = (np.asarray(x) for x in ACCEPT_RANKS(params, st, spec=spec))
        ranks.append(r[active])
        scores.append(s[active])
        st = STEP(params, st, SamplingParams.of(SamplingConfig()), spec=spec)
    return Acceptance(np.concatenate(ranks), np.concatenate(scores)), st


def fresh_copy(tree):
    """A copy of a state pytree in new buffers, for a program that donates (consumes) its input."""
    return jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, tree))


def best_time(fn, make_args, repeats=3):
    """Best of `repeats` wall times of fn(*make_args()), the arguments made outside the timing.

    Rounds are timed with the donating step a real generation's loop runs (its caches updated in
    place), each call on a fresh copy of the state: a non-donating step would add a copy of every
    KV cache to each round, inflating all sizes alike and so favouring larger trees."""
    best = float("inf")
    for _ in range(repeats):
        args = make_args()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def choose_tree(target, draft, prompts, *, depth: int = 5, top_k: int = 10, candidates=CANDIDATES,
                calibration_rounds: int = 16, max_new_tokens: int = 128) -> TreeChoice:
    """Pick total_tokens for (depth, top_k) by measured round cost and measured greedy acceptance
    (`calibration_rounds` rounds over the prompts, see `calibrate`)."""
    pool_size = top_k + depth * top_k * top_k
    cands = sorted({min(n, pool_size + 1) for n in candidates})
    big = TreeConfig(depth, top_k, cands[-1])
    sampling = SamplingConfig()
    st, b = start(target, draft, prompts, max_new_tokens=max_new_tokens, tree=big, sampling=sampling)
    params = params_of(target, draft)
    acc, st = calibrate(target, draft, st, big, calibration_rounds)
    if len(acc.ranks) == 0:
        raise ValueError("choose_tree: every prompt finished before calibration; give longer prompts or a "
                         "larger max_new_tokens")
    table = []
    for n in cands:
        spec = RoundSpec.of(target, draft, TreeConfig(depth, top_k, n))
        tau = acc.measured_tau(n)
        step = lambda s: STREAM_STEP(params, s, SamplingParams.of(sampling), spec=spec)  # noqa: E731
        step(fresh_copy(st))  # compile outside the timing
        cost = best_time(step, lambda: (fresh_copy(st),))
        table.append(dict(total_tokens=n, expected_tau=tau, estimated_tau=acc.estimated_tau(n),
                          round_ms=cost * 1e3, tokens_per_s=b.num_rows * tau / cost))
    best = max(table, key=lambda r: r["tokens_per_s"])
    return TreeChoice(TreeConfig(depth, top_k, best["total_tokens"]), table)


def resolve_tree(draft=None, depth=None, top_k=None, total_tokens=None, *, batch=None, target=None,
                 prompts=None, backend=None, report=None) -> Optional[TreeConfig]:
    """The tree for a generation, for the library and every command alike: each field given here
    (command-line flags), else the head's tree.json for this platform (defaults.head_tree), else the
    reference tree. Where tree.json times trees per batch size (`by_batch`) and total_tokens is not
    given, `batch` rows take that table's size, and None where it says plain decoding is faster at
    that batch (as verifying a tree becomes compute-bound). total_tokens "auto" times rounds on this
    machine over `prompts` (`choose_tree`) and, with `report`, passes it the TreeChoice."""
    fields = {**{k: getattr(REFERENCE_TREE, k) for k in ("depth", "top_k", "total_tokens")},
              **head_tree(getattr(draft, "source", None), backend)}
    by_batch = fields.pop("by_batch", None)  # timed for the head's own tree: it holds unless a field is given
    if by_batch and batch is not None and depth is None and top_k is None and total_tokens is None:
        n = for_batch(by_batch, batch)
        if n == "plain":
            return None
        fields["total_tokens"] = n
    for k, v in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)):
        if v is not None:
            fields[k] = v
    if fields["total_tokens"] == "auto":
        if target is None or draft is None or not prompts:
            raise ValueError("total_tokens 'auto' needs the target, the draft and prompts to time rounds on")
        choice = choose_tree(target, draft, prompts, depth=fields["depth"], top_k=fields["top_k"])
        if report is not None:
            report(choice)
        return choice.tree
    return TreeConfig(**fields)
