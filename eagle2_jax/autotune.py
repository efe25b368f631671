"""Choose the tree size for the hardware at hand (EAGLE-2's `total_token=-1` idea).

Expected tokens per round for a tree of N nodes is estimated from the draft's own scores: a
node's value exp(score) (the product of confidences along its path) approximates the chance the
target accepts it, so E[tau](N) ~= 1 + sum of the N-1 largest values. Round cost is timed on
device for each candidate N (verify forward + draft passes). The chosen N maximises
E[tau](N) / cost(N).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from .config import TreeConfig
from .eagle import INIT, STEP, STREAM_STEP, scratch_slots
from .batching import eos_value, prepare_batch
from .programs import Program
from .sharding import batch_multiple
from .tree import expand
from .vanilla import _device_inputs

CANDIDATES = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclasses.dataclass
class TreeChoice:
    tree: TreeConfig
    table: list  # per candidate: dict(total_tokens, expected_tau, round_ms, tokens_per_s)


def _pool_scores(tparams, dparams, st, *, tmodule, dmodule, tree):
    pool, _ = expand(tmodule, tparams, dmodule, dparams, st.dcache, st.hidden_BD, tree)
    return jnp.sort(pool.scores_BP, axis=1)[:, ::-1]


POOL = Program(_pool_scores, ("tmodule", "dmodule", "tree"))


def fresh_copy(tree):
    """A copy of a state pytree in new buffers, for a program that donates (consumes) its input."""
    return jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, tree))


def best_time(fn, make_args, repeats=3):
    """Best of `repeats` wall times of fn(*make_args()), the arguments made outside the timing.

    Rounds are timed with the donating step a real generation's loop runs (its caches updated in
    place), each call on a fresh copy of the state: a non-donating step would add a copy of every
    KV cache to each round (~3 ms at batch 1 here), inflating all sizes alike and so favouring
    larger trees."""
    best = float("inf")
    for _ in range(repeats):
        args = make_args()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def choose_tree(target, draft, prompts, *, depth: int = 5, top_k: int = 10, candidates=CANDIDATES,
                calibration_rounds: int = 8, max_new_tokens: int = 64) -> TreeChoice:
    """Pick total_tokens for (depth, top_k) by measured round cost and draft-estimated acceptance."""
    from .config import SamplingConfig
    pool_size = top_k + depth * top_k * top_k
    cands = sorted({min(n, pool_size + 1) for n in candidates})
    big = TreeConfig(depth, top_k, cands[-1])
    sampling = SamplingConfig()
    b = prepare_batch(prompts, max_new_tokens, vocab_size=target.config.vocab_size,
                      max_positions=target.config.max_position_embeddings, slack=scratch_slots(big),
                      batch_multiple=batch_multiple(target.mesh))
    prompt, plen, active = _device_inputs(target, b)
    args = (target.params, draft.params, prompt, plen, active, jnp.int32(max_new_tokens),
            jnp.int32(eos_value(None)), jnp.uint32(0))
    static = dict(tmodule=target.module, dmodule=draft.module, cache_len=b.cache_len,
                  out_len=b.max_new + big.max_accept, sampling=sampling, tree=big, mesh=target.mesh)
    st = INIT(*args, **static)
    dyn = (target.params, draft.params)
    mods = dict(tmodule=target.module, dmodule=draft.module)
    values = []
    for _ in range(calibration_rounds):  # walk a real generation, collecting the draft's scores
        scores = np.asarray(POOL(*dyn, st, tree=big, **mods))[:b.num_rows]
        values.append(np.exp(scores.astype(np.float64)))
        st = STEP(*dyn, st, sampling=sampling, tree=big, **mods)
    values = np.concatenate(values, axis=0)  # [rounds * rows, pool]
    table = []
    for n in cands:
        tree = TreeConfig(depth, top_k, n)
        exp_tau = 1.0 + float(values[:, :n - 1].sum(axis=1).mean())
        step = lambda s: STREAM_STEP(*dyn, s, sampling=sampling, tree=tree, **mods)  # noqa: E731
        step(fresh_copy(st))  # compile outside the timing
        cost = best_time(step, lambda: (fresh_copy(st),))
        table.append(dict(total_tokens=n, expected_tau=exp_tau, round_ms=cost * 1e3,
                          tokens_per_s=b.num_rows * exp_tau / cost))
    best = max(table, key=lambda r: r["tokens_per_s"])
    return TreeChoice(TreeConfig(depth, top_k, best["total_tokens"]), table)
