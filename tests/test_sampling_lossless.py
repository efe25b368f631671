"""EAGLE-2 sampling is lossless: the first 3 generated tokens follow the target's exact distribution.

A small vocabulary (8) and a context-dependent random target give 512 outcomes whose exact
probabilities come from the target itself (same logits processing). ~100k EAGLE-2 samples
(batched rows with independent keys) are compared by a chi-square test; cells with expected count
< 5 are pooled. The test fails when p < 1e-6, so its false-alarm rate is 1e-6 per configuration.
The same test run with deliberately wrong acceptance rules must fail.
"""
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle2_jax import SamplingConfig, TreeConfig, forward, generate
from eagle2_jax.decoding import verify as verify_mod
from eagle2_jax.decoding.programs import clear_all
from eagle2_jax.decoding.sampling import target_probs
from helpers import tiny_pair

V = 8
PROMPT = [1, 5, 2]
ROWS, CALLS = 16384, 7  # 114,688 samples
P_THRESHOLD = 1e-6


@pytest.fixture(scope="module")
def pair():
    t, d = tiny_pair(3, vocab_size=V, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=32)
    t.params = dict(t.params, lm_head=t.params["lm_head"] * 40.0)  # peaked, context-dependent
    d.params = jax.tree_util.tree_map(lambda x: x * 3.0, d.params)
    return t, d


def exact_distribution(target, s: SamplingConfig):
    seqs = np.array(list(itertools.product(range(V), repeat=3)))  # [512, 3]
    ids = np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], axis=1)
    logits = forward(target, ids)[:, len(PROMPT) - 1:len(PROMPT) + 2]  # predicts x1, x2, x3
    probs = np.asarray(target_probs(logits, s), np.float64)
    p = probs[np.arange(len(seqs)), 0, seqs[:, 0]] * probs[np.arange(len(seqs)), 1, seqs[:, 1]] \
        * probs[np.arange(len(seqs)), 2, seqs[:, 2]]
    return p / p.sum()


def chi_square_p(counts, expected_p):
    n = counts.sum()
    exp = expected_p * n
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    ex = np.append(exp[big], exp[~big].sum())
    keep = ex > 0
    obs, ex = obs[keep], ex[keep]
    stat = float(((obs - ex) ** 2 / ex).sum())
    k = len(obs) - 1
    # Wilson-Hilferty normal approximation of the chi-square upper tail
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2)), stat, k


def sample_counts(target, draft, tree, temperature, top_p):
    counts = np.zeros(V ** 3, np.int64)
    for seed in range(CALLS):
        out = generate(target, draft, [PROMPT] * ROWS, max_new_tokens=3, temperature=temperature,
                       top_p=top_p, seed=1000 + seed, tree=tree)
        toks = np.array(out.tokens)
        np.add.at(counts, toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], 1)
    return counts


TREES = {"chain": TreeConfig(depth=2, top_k=1, total_tokens=3), "tree": TreeConfig(depth=2, top_k=3, total_tokens=8)}
# The default run takes half of the 2x2x2 grid so that every pair of settings (tree shape, temperature,
# top_p) still meets once; the other half runs with -m slow.
_DEFAULT = {("chain", 0.7, 1.0), ("chain", 1.0, 0.8), ("tree", 0.7, 0.8), ("tree", 1.0, 1.0)}
CASES = [(tree, temp, top_p) if (tree, temp, top_p) in _DEFAULT else
         pytest.param(tree, temp, top_p, marks=pytest.mark.slow)
         for tree in TREES for temp in (0.7, 1.0) for top_p in (1.0, 0.8)]


@pytest.mark.optimized  # ~100k samples a test: running, not compiling (tests/conftest.py)
@pytest.mark.parametrize("tree,temperature,top_p", CASES)
def test_sampling_matches_target_distribution(pair, tree, temperature, top_p):
    t, d = pair
    expected = exact_distribution(t, SamplingConfig(temperature, 0, top_p))
    counts = sample_counts(t, d, TREES[tree], temperature, top_p)
    p, stat, k = chi_square_p(counts, expected)
    assert p > P_THRESHOLD, f"chi2={stat:.1f} on {k} dof, p={p:.2e}"


@pytest.mark.optimized
@pytest.mark.parametrize("path", ["gpu", pytest.param("tpu", marks=pytest.mark.slow)])
def test_sampling_on_the_accelerator_paths_matches_target_distribution(pair, path):
    """The same check on the GPU path (`ops.XLA`, per-layer weight buffers: tree verification
    and draft passes write their keys/values into the cache first and attend over it alone) and
    on the TPU path (`ops.XLA_TPU`: a scan over stacked layers, scores laid out by query head)."""
    import dataclasses
    from eagle2_jax.models.layer_list import per_layer
    from eagle2_jax.models.ops import XLA, XLA_TPU
    if path == "gpu":
        t, d = per_layer(dataclasses.replace(pair[0], ops=XLA)), dataclasses.replace(pair[1], ops=XLA)
    else:
        t, d = dataclasses.replace(pair[0], ops=XLA_TPU), dataclasses.replace(pair[1], ops=XLA_TPU)
    expected = exact_distribution(t, SamplingConfig(1.0, 0, 0.8))
    counts = sample_counts(t, d, TREES["tree"], 1.0, 0.8)
    p, stat, k = chi_square_p(counts, expected)
    assert p > P_THRESHOLD, f"chi2={stat:.1f} on {k} dof, p={p:.2e}"


def _always_accept(q_N, parents_N, skip_N, key):
    """Accepts the first child at every node."""
    N = q_N.shape[0]

    def body(j, cur):
        return jnp.where(parents_N[j] == cur, j, cur)

    return jax.lax.fori_loop(1, N, body, jnp.int32(0))


def _no_residual(logits_V, tokens_N, parents_N, cur, key):
    """Accepts with the right probability but draws the bonus from p, not the residual."""
    return jax.random.categorical(key, logits_V).astype(jnp.int32)


@pytest.mark.optimized
@pytest.mark.parametrize("name,broken", [("_walk_row", _always_accept),
                                         pytest.param("_bonus_row", _no_residual, marks=pytest.mark.slow)],
                         ids=["always_accept", "no_residual"])
def test_wrong_acceptance_rule_is_caught(pair, monkeypatch, name, broken):
    t, d = pair
    monkeypatch.setattr(verify_mod, name, broken)
    jax.clear_caches()
    clear_all()  # our AOT cache too, or the correct rule would still run
    try:
        expected = exact_distribution(t, SamplingConfig(1.0, 0, 1.0))
        counts = sample_counts(t, d, TREES["tree"], 1.0, 1.0)
        p, stat, k = chi_square_p(counts, expected)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
        clear_all()
    assert p < P_THRESHOLD, f"broken rule passed: chi2={stat:.1f} on {k} dof, p={p:.2e}"


def _reference_accept(probs_NV, tokens_N, parents_N, key):
    """The rule written out directly: carry the current node's distribution and zero each
    rejected sibling in it (what accept_sampling computes with scalars only)."""
    N = tokens_N.shape[0]
    k_u, k_bonus = jax.random.split(key)
    u = jax.random.uniform(k_u, (N,), jnp.float32)

    def body(j, carry):
        cur, p = carry
        x = tokens_N[j]
        mine = parents_N[j] == cur
        take = mine & (u[j] * jnp.sum(p) < p[x])
        reject = mine & ~take
        return jnp.where(take, j, cur), jnp.where(take, probs_NV[j], jnp.where(reject, p.at[x].set(0.0), p))

    cur, p = jax.lax.fori_loop(1, N, body, (jnp.int32(0), probs_NV[0]))
    from eagle2_jax.decoding.sampling import categorical  # the shared sampler (tested on its own below)
    bonus = categorical(k_bonus, jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), -1e30))
    return cur, bonus.astype(jnp.int32)


def test_scalar_walk_equals_reference_rule():
    """Same keys, same decisions: random trees (with repeated sibling tokens) over a small vocabulary."""
    from eagle2_jax.decoding.tree import Tree
    rng = np.random.default_rng(0)
    B, N, V = 2048, 12, 6
    parents = np.full((B, N), -1, np.int32)
    for j in range(1, N):
        parents[:, j] = rng.integers(0, j, B)  # any earlier node: level-major order not needed here
    tokens = rng.integers(0, V, (B, N)).astype(np.int32)  # repeats among siblings happen often
    anc = np.zeros((B, N, N), bool)
    depth = np.zeros((B, N), np.int32)
    for j in range(N):
        anc[:, j, j] = True
        for b in range(B):
            if parents[b, j] >= 0:
                anc[b, j] |= anc[b, parents[b, j]]
                depth[b, j] = depth[b, parents[b, j]] + 1
    tree = Tree(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(anc), jnp.asarray(depth))
    logits = jnp.asarray(rng.standard_normal((B, N, V)) * 2.0, jnp.float32)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(7), i))(jnp.arange(B))
    s = SamplingConfig(1.0, 0, 1.0)
    _, n_acc, bonus = verify_mod.accept_sampling(tree, logits, keys, N, s)
    ref_cur, ref_bonus = jax.vmap(_reference_accept)(target_probs(logits, s), tree.tokens_BN, tree.parents_BN, keys)
    ref_n = np.take_along_axis(depth, np.asarray(ref_cur)[:, None], 1)[:, 0] + 1
    agree = (np.asarray(n_acc) == ref_n) & (np.asarray(bonus) == np.asarray(ref_bonus))
    assert np.asarray(n_acc).max() > 2 and (np.asarray(n_acc) == 1).any()  # the cases are not trivial
    assert agree.mean() > 0.999, f"{(~agree).sum()} of {B} rows differ from the reference rule"


def _categorical_counts(logits, n, seed=0):
    from eagle2_jax.decoding.sampling import categorical
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    draws = np.asarray(jax.jit(jax.vmap(categorical, (0, None)))(keys, logits))
    return np.bincount(draws, minlength=logits.shape[0])


@pytest.mark.optimized  # 200,000 draws
def test_two_level_categorical_matches_softmax():
    """sampling.categorical (one uniform, block then token) against exact softmax probabilities, over
    several 128-token blocks, a filtered (NEG_INF) block, filtered tokens inside live blocks and a
    ragged last block; zero-probability tokens are never drawn. A shifted distribution must fail."""
    from eagle2_jax.models.layers import NEG_INF
    rng = np.random.default_rng(0)
    x = rng.normal(size=700).astype(np.float32) * 2.0
    x[128:256] = NEG_INF  # a dead block
    x[rng.choice(700, 300, replace=False)] = NEG_INF
    logits = jnp.asarray(x)
    p = np.asarray(jax.nn.softmax(logits), np.float64)
    counts = _categorical_counts(logits, 200_000)
    assert counts[p == 0].sum() == 0
    assert chi_square_p(counts, p)[0] > P_THRESHOLD
    shifted = np.roll(p, 1)  # the power check: the same counts against a wrong distribution
    assert chi_square_p(counts, shifted / shifted.sum())[0] < P_THRESHOLD


def test_two_level_categorical_single_live_token():
    from eagle2_jax.models.layers import NEG_INF
    x = np.full(1000, NEG_INF, np.float32)
    x[517] = 0.0
    counts = _categorical_counts(jnp.asarray(x), 2000, seed=1)
    assert counts[517] == 2000
