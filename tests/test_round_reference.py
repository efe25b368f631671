"""rerank, accept_greedy and accept_sampling against a slow NumPy reference written from the design notes (shared/docs/DESIGN.md, section 1).

What is compared:
- rerank (step 3): on random valid pools laid out as expand lays them out (level-major; the root's
  K children, then per pass K*K candidates under K distinct nodes of the previous level; a child's
  score is its parent's plus a log-prob <= 0, many ties, parent-child ties included), every field of
  the Tree (tokens, parents, ancestor mask, depths) for every batch row, each row checked against
  the reference run on that row alone. The reference's selection is also checked ancestor-closed.
- accept_greedy (step 5, greedy): on random trees (any parent before its child; sibling tokens may
  repeat), with small integer logits over a vocabulary of 6 (argmax ties, frequent matches): the
  accepted length, the path up to it, and the bonus token. A second test builds the logits from a
  prefix-consistent "target" and checks the emitted tokens against plain greedy decoding.
- accept_sampling (step 5, sampling): the exact probability of every outcome (final node, bonus
  token) of the recursive-rejection walk is enumerated; tens of thousands of runs of the JAX code
  are compared with it by a chi-square test, and their first emitted token with the target's
  processed distribution at the root. The enumerated walk itself is checked lossless against the
  target's own autoregressive distribution (computed without any rejection step). Reference
  variants with a deliberately wrong rule (rejected siblings not zeroed; bonus from unprocessed
  logits) must be rejected by the same counts: the test has the power to see those mistakes.

Why the reference is independent: it is written from the design notes' words, the slow obvious
way -- Python loops over nodes, parent chains walked explicitly, children kept in dicts, a sort of
(score, index) pairs for the selection, exact float64 probabilities, top-k/top-p processing written
again in NumPy -- and shares no code and no formula with eagle2_jax (which uses lax.top_k, one-hot
gathers, hop-wise ancestor masks, argmax over depths, and a scalar walk over running masses).
"""
import math
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from eagle2_jax import SamplingConfig, TreeConfig
from eagle2_jax.decoding.sampling import SamplingParams
from eagle2_jax.decoding.tree import Pool, Tree, rerank
from eagle2_jax.decoding.verify import accept_greedy, accept_sampling

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------------
# The reference (NumPy / plain Python), from the design notes (shared/docs/DESIGN.md, section 1)
# ---------------------------------------------------------------------------------------------

def ref_chain(parents, i):
    """Nodes from the root down to node i, by walking parent pointers."""
    chain = [i]
    while parents[chain[-1]] >= 0:
        chain.append(int(parents[chain[-1]]))
    return chain[::-1]


def ref_children(parents):
    """node -> its children in node order (node order is the draft-score order of siblings)."""
    kids = defaultdict(list)
    for j in range(len(parents)):
        if parents[j] >= 0:
            kids[int(parents[j])].append(j)
    return kids


def ref_mask_and_depths(parents):
    """Ancestor mask (a node sees itself and its ancestors) and depths (root 0)."""
    N = len(parents)
    anc = np.zeros((N, N), bool)
    depths = np.zeros(N, np.int64)
    for i in range(N):
        chain = ref_chain(parents, i)
        anc[i, chain] = True
        depths[i] = len(chain) - 1
    return anc, depths


def ref_rerank(pool_tokens, pool_scores, pool_parents, root, N):
    """Step 3: the N-1 best-scored candidates (ties: lower pool index, i.e. the parent, first),
    ordered by pool index, under the root (node 0)."""
    ranked = sorted(range(len(pool_scores)), key=lambda i: (-float(pool_scores[i]), i))
    kept = sorted(ranked[:N - 1])
    kept_set = set(kept)
    for i in kept:  # the selection is a connected tree: every kept candidate's parent is kept
        assert pool_parents[i] < 0 or int(pool_parents[i]) in kept_set, "selection not ancestor-closed"
    node_of = {pool_index: node for node, pool_index in enumerate(kept, start=1)}
    tokens = [int(root)] + [int(pool_tokens[i]) for i in kept]
    parents = [-1] + [0 if pool_parents[i] < 0 else node_of[int(pool_parents[i])] for i in kept]
    anc, depths = ref_mask_and_depths(parents)
    return np.array(tokens), np.array(parents), anc, depths


def first_argmax(row):
    """The target's greedy choice: the largest logit, the lowest token id among equal ones (the
    convention of plain greedy decoding, np/jnp.argmax)."""
    best = max(row)
    return min(v for v in range(len(row)) if row[v] == best)


def ref_accept_greedy(tokens, parents, logits_NV):
    """Step 5, greedy. Returns (the deepest accepted nodes, the target's choice at every node).
    A node is accepted iff its parent is and its token is the target's argmax at the parent."""
    N = len(tokens)
    g = [first_argmax(logits_NV[i]) for i in range(N)]
    accepted = {0}
    for j in range(1, N):  # parents precede children
        if int(parents[j]) in accepted and tokens[j] == g[parents[j]]:
            accepted.add(j)
    depth = {j: len(ref_chain(parents, j)) - 1 for j in accepted}
    deepest = max(depth.values())
    return sorted(j for j in accepted if depth[j] == deepest), g


def ref_processed_probs(logits_V, s: SamplingConfig):
    """The target distribution after temperature, top-k (keep the k largest) and then top-p (keep
    the most likely tokens, in order, while the mass before a token is below top_p: the smallest
    set reaching top_p), float64."""
    x = np.asarray(logits_V, np.float64) / s.temperature
    V = len(x)
    keep = np.ones(V, bool)
    if 0 < s.top_k < V:
        kth = sorted(x, reverse=True)[s.top_k - 1]
        keep = x >= kth
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    if s.top_p < 1.0:
        mass, keep_p = 0.0, np.zeros(V, bool)
        for v in sorted(range(V), key=lambda v: -p[v]):
            if mass < s.top_p:
                keep_p[v] = True
            mass += p[v]
        p = np.where(keep_p, p, 0.0)
        p /= p.sum()
    return p


def ref_walk_distribution(P_NV, tokens, parents, zero_rejected=True, bonus_P_NV=None):
    """Step 5, sampling, enumerated exactly: {(final node, bonus token): probability}.

    From the root: try the current node's children in node (draft-score) order, accept child x
    with probability p[x] / sum(p); on rejection set p[x] = 0 (renormalising the rest); on
    acceptance continue from the child with its own distribution; when every child is rejected
    (or at a leaf) draw the bonus from the residual p. `zero_rejected=False` and `bonus_P_NV` (the
    bonus drawn from other distributions) are deliberately wrong variants for the power checks.
    """
    kids = ref_children(parents)
    out = defaultdict(float)

    def visit(node, reach):
        p = np.array(P_NV[node], np.float64)
        if bonus_P_NV is not None:
            residual_base = np.array(bonus_P_NV[node], np.float64)
        for c in kids[node]:
            x = int(tokens[c])
            accept = p[x] / p.sum() if p.sum() > 0 else 0.0
            if accept > 0:
                visit(c, reach * accept)
            reach *= 1.0 - accept
            if zero_rejected:
                p[x] = 0.0
                if bonus_P_NV is not None:
                    residual_base[x] = 0.0
        if reach <= 0:
            return
        residual = p if bonus_P_NV is None else residual_base
        residual = residual / residual.sum()
        for v in range(len(residual)):
            if residual[v] > 0:
                out[(node, v)] += reach * residual[v]

    visit(0, 1.0)
    return dict(out)


def ref_target_distribution(P_NV, tokens, parents):
    """What plain sampling from the target gives for the same outcomes, without any rejection:
    draw x ~ P[node]; if a child of the node carries x, the prefix is still in the tree (the first
    such child: a repeated sibling adds nothing), go on from it; otherwise x is the round's last
    (bonus) token."""
    kids = ref_children(parents)
    out = defaultdict(float)

    def visit(node, reach):
        child_of = {}
        for c in kids[node]:
            child_of.setdefault(int(tokens[c]), c)
        for v, pv in enumerate(P_NV[node]):
            if pv > 0:
                if v in child_of:
                    visit(child_of[v], reach * pv)
                else:
                    out[(node, v)] += reach * pv

    visit(0, 1.0)
    return dict(out)


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------

P_THRESHOLD = 1e-6  # false alarm rate of one chi-square test


def chi_square_p(counts, expected_p):
    """Upper-tail p-value of Pearson's chi-square (cells expected < 5 pooled); 0 when a count
    falls where the expected probability is exactly zero."""
    counts = np.asarray(counts, np.float64)
    expected_p = np.asarray(expected_p, np.float64)
    if counts[expected_p == 0].sum() > 0:
        return 0.0
    exp = expected_p / expected_p.sum() * counts.sum()
    big = exp >= 5
    obs = np.append(counts[big], counts[~big].sum())
    ex = np.append(exp[big], exp[~big].sum())
    obs, ex = obs[ex > 0], ex[ex > 0]
    k = len(obs) - 1
    if k < 1:
        return 1.0
    stat = float(((obs - ex) ** 2 / ex).sum())
    # Wilson-Hilferty normal approximation of the chi-square upper tail
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def as_cells(dist, N, V):
    p = np.zeros(N * V)
    for (node, v), pr in dist.items():
        p[node * V + v] += pr
    return p


def total_variation(a, b):
    return 0.5 * float(np.abs(a - b).sum())


# ---------------------------------------------------------------------------------------------
# rerank
# ---------------------------------------------------------------------------------------------

DELTAS = [0.0, 0.0, -0.25, -0.5, -1.0, -3.0, -0.1, -0.7]  # child log-probs: zeros give parent-child ties
POOL_VOCAB = 50
_rerank = jax.jit(rerank, static_argnums=2)


@st.composite
def pool_rows(draw, K, passes):
    """One row of a pool in expand's layout: [root's K children][pass 1: K*K]...[pass `passes`]."""
    def deltas(n):
        return draw(st.lists(st.sampled_from(DELTAS), min_size=n, max_size=n))

    tokens = draw(st.lists(st.integers(0, POOL_VOCAB - 1), min_size=K, max_size=K))
    scores = [np.float32(d) for d in deltas(K)]
    parents = [-1] * K
    level = list(range(K))
    for _ in range(passes):
        frontier = draw(st.permutations(level))[:K]  # K distinct nodes of the previous level
        ds = deltas(K * K)
        for f_i, f in enumerate(frontier):
            for c in range(K):
                parents.append(f)
                scores.append(np.float32(scores[f] + np.float32(ds[f_i * K + c])))
        tokens += draw(st.lists(st.integers(0, POOL_VOCAB - 1), min_size=K * K, max_size=K * K))
        level = list(range(len(parents) - K * K, len(parents)))
    return np.array(tokens, np.int32), np.array(scores, np.float32), np.array(parents, np.int32)


RERANK_B = 3
RERANK_CONFIGS = [  # (K, D, N)
    (3, 3, 14),
    (2, 4, 6),  # a pool of 18, the deepest chain
    (4, 2, 5),  # passes = min(D, N - 2) = 2
    (3, 5, 3),  # passes = 1 < D
    (2, 1, 7),  # N - 1 = the whole pool
    (1, 4, 6),  # K = 1: a chain, all kept
    (2, 2, 1),  # the root alone
]


@pytest.mark.parametrize("K,D,N", RERANK_CONFIGS)
@settings(max_examples=25, **SETTINGS)
@given(data=st.data())
def test_rerank_matches_reference(K, D, N, data):
    cfg = TreeConfig(depth=D, top_k=K, total_tokens=N)
    rows = [data.draw(pool_rows(K, cfg.passes), label=f"row {b}") for b in range(RERANK_B)]
    roots = data.draw(st.lists(st.integers(0, POOL_VOCAB - 1), min_size=RERANK_B, max_size=RERANK_B))
    assert rows[0][0].shape[0] == K + cfg.passes * K * K
    for tok, score, par in rows:  # the pool is valid: parent first, score never above the parent's
        for i in range(len(par)):
            assert par[i] < i and (par[i] < 0 or score[i] <= score[par[i]])
    pool = Pool(*(jnp.asarray(np.stack([r[f] for r in rows])) for f in range(3)))
    got = _rerank(pool, jnp.asarray(roots, jnp.int32), cfg)
    for b in range(RERANK_B):
        want = ref_rerank(*rows[b], roots[b], N)
        for name, g, w in zip(("tokens", "parents", "ancestors", "depths"),
                              (got.tokens_BN, got.parents_BN, got.ancestors_BNN, got.depths_BN), want):
            np.testing.assert_array_equal(np.asarray(g[b]), w, err_msg=f"row {b}: {name}")


# ---------------------------------------------------------------------------------------------
# accept_greedy
# ---------------------------------------------------------------------------------------------

GB, GN, GV = 3, 10, 6
_greedy = jax.jit(accept_greedy, static_argnums=2)


def make_tree(tokens_BN, parents_BN):
    """A Tree whose mask and depths come from the reference."""
    anc, depths = zip(*(ref_mask_and_depths(p) for p in parents_BN))
    return Tree(jnp.asarray(np.asarray(tokens_BN), jnp.int32), jnp.asarray(np.asarray(parents_BN), jnp.int32),
                jnp.asarray(np.stack(anc)), jnp.asarray(np.stack(depths), jnp.int32))


@st.composite
def tree_parents(draw, N):
    return [-1] + [draw(st.integers(0, j - 1)) for j in range(1, N)]


@st.composite
def greedy_rows(draw):
    """A random tree and integer logits; each node's token is, by a coin, the target's argmax at
    its parent (so long accepted chains and repeated sibling tokens are common) or any token."""
    parents = draw(tree_parents(GN))
    logits = np.array(draw(st.lists(st.integers(0, 3), min_size=GN * GV, max_size=GN * GV)),
                      np.float32).reshape(GN, GV)
    follow = draw(st.lists(st.booleans(), min_size=GN - 1, max_size=GN - 1))
    other = draw(st.lists(st.integers(0, GV - 1), min_size=GN - 1, max_size=GN - 1))
    root = draw(st.integers(0, GV - 1))
    tokens = [root] + [first_argmax(logits[parents[j]]) if follow[j - 1] else other[j - 1] for j in range(1, GN)]
    return np.array(tokens), np.array(parents), logits


def check_greedy_row(path, n_acc, bonus, tokens, parents, logits):
    """The code's answer against the reference's, for one row.

    Ties: two accepted nodes at the same depth need two siblings with the same token (both the
    argmax at their accepted parent). expand's top-K never proposes a token twice under one
    parent, so there the accepted nodes form one chain and the deepest is unique; where tokens do
    repeat, any deepest accepted node is a correct answer (each token on its path is the target's
    argmax after the path before it, and a target's logits depend on the prefix alone, so all
    those paths carry the same tokens: see the prefix-consistent test). The code takes the lowest
    node index among them (jnp.argmax's first maximum), and that is what is checked."""
    deepest, g = ref_accept_greedy(tokens, parents, logits)
    node = int(path[n_acc - 1])
    assert node in deepest, f"final node {node} is not a deepest accepted node {deepest}"
    assert node == deepest[0]
    chain = ref_chain(parents, node)
    assert n_acc == len(chain)
    np.testing.assert_array_equal(path[:n_acc], chain)
    assert bonus == g[node]


@settings(max_examples=40, **SETTINGS)
@given(rows=st.lists(greedy_rows(), min_size=GB, max_size=GB))
def test_accept_greedy_matches_reference(rows):
    tree = make_tree([r[0] for r in rows], [r[1] for r in rows])
    path, n_acc, bonus = (np.asarray(x) for x in _greedy(tree, jnp.asarray(np.stack([r[2] for r in rows])), GN))
    for b, (tokens, parents, logits) in enumerate(rows):
        check_greedy_row(path[b], int(n_acc[b]), int(bonus[b]), tokens, parents, logits)
        event(f"n_accept {min(int(n_acc[b]), 4)}{'+' if n_acc[b] >= 4 else ''}")
        event(f"deepest accepted nodes tie: {len(ref_accept_greedy(tokens, parents, logits)[0]) > 1}")


@settings(max_examples=25, **SETTINGS)
@given(seed=st.integers(0, 2**31 - 1), structure=st.lists(tree_parents(GN), min_size=GB, max_size=GB),
       follow=st.lists(st.lists(st.booleans(), min_size=GN, max_size=GN), min_size=GB, max_size=GB))
def test_accept_greedy_emits_plain_greedy_tokens(seed, structure, follow):
    """With a prefix-consistent target (logits a function of the token prefix, as a real model's),
    the round emits exactly the first n_accept tokens of plain greedy decoding from the root, and
    n_accept is as long as the tree allows (the next greedy token leaves the tree)."""
    def target(prefix):  # small integer logits: argmax ties happen
        return np.random.default_rng([seed, *prefix]).integers(0, 4, GV).astype(np.float32)

    tokens_BN, logits_BNV = [], []
    for b in range(GB):
        parents, toks = structure[b], [b % GV]
        for j in range(1, GN):
            prefix = [toks[i] for i in ref_chain(parents, parents[j])]
            alt = (first_argmax(target(prefix)) + 1 + j) % GV
            toks.append(first_argmax(target(prefix)) if follow[b][j] else alt)
        tokens_BN.append(toks)
        logits_BNV.append([target([toks[i] for i in ref_chain(parents, j)]) for j in range(GN)])
    tree = make_tree(tokens_BN, structure)
    path, n_acc, bonus = (np.asarray(x) for x in _greedy(tree, jnp.asarray(np.array(logits_BNV)), GN))
    for b in range(GB):
        n = int(n_acc[b])
        seq = [tokens_BN[b][0]]
        for _ in range(n):
            seq.append(first_argmax(target(seq)))
        emitted = [tokens_BN[b][i] for i in path[b][1:n]] + [int(bonus[b])]
        assert emitted == seq[1:], (emitted, seq)
        kids = ref_children(structure[b])[int(path[b][n - 1])]
        assert all(tokens_BN[b][c] != seq[-1] for c in kids)  # maximal
        check_greedy_row(path[b], n, int(bonus[b]), np.array(tokens_BN[b]), np.array(structure[b]),
                         np.array(logits_BNV[b]))


# ---------------------------------------------------------------------------------------------
# accept_sampling
# ---------------------------------------------------------------------------------------------

SN, SV = 6, 6
SAMPLES = 20_000  # per tree; two trees per batch, rows interleaved
SB = 2 * SAMPLES
SAMPLING_CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=1.0, top_k=3),
    SamplingConfig(temperature=1.3, top_p=0.8),
    SamplingConfig(temperature=0.8, top_k=4, top_p=0.9),
]
TV_POWER = 0.05  # a wrong rule this far (total variation) from the right one must be caught
_sampling = jax.jit(accept_sampling, static_argnums=3)


def traced(s: SamplingConfig) -> SamplingParams:
    """Traced temperature / top-k / top-p: one compiled program for every configuration."""
    return SamplingParams(jnp.float32(s.temperature), jnp.int32(s.top_k), jnp.float32(s.top_p), greedy=False)


def run_sampling(trees, s, seed):
    """accept_sampling on SB rows alternating between the given trees -> per tree (final node,
    bonus, first emitted token) arrays. Checks on every row that the path is the chain from the
    root to the final node."""
    T = len(trees)
    of_row = np.arange(SB) % T
    tokens = np.stack([t[0] for t in trees])[of_row]
    logits = np.stack([t[2] for t in trees]).astype(np.float32)[of_row]
    tree = jax.tree_util.tree_map(lambda x: x[of_row], make_tree([t[0] for t in trees], [t[1] for t in trees]))
    keys = jax.random.split(jax.random.PRNGKey(seed), SB)
    path, n_acc, bonus = (np.asarray(x) for x in _sampling(tree, jnp.asarray(logits), keys, SN, traced(s)))
    rows = np.arange(SB)
    final = path[rows, n_acc - 1]
    chains = np.full((T, SN, SN), -1)  # chains[t, node, :depth + 1]: root ... node
    for t in range(T):
        for node in range(SN):
            chain = ref_chain(trees[t][1], node)
            chains[t, node, :len(chain)] = chain
    want = chains[of_row, final]
    on_path = np.arange(SN)[None] < n_acc[:, None]
    np.testing.assert_array_equal(np.where(on_path, path, -1), want)
    first = np.where(n_acc > 1, tokens[rows, path[:, 1]], bonus)
    return [(final[t::T], bonus[t::T], first[t::T]) for t in range(T)]


def outcome_counts(final, bonus):
    return np.bincount(final * SV + bonus, minlength=SN * SV)


def processed(logits_NV, s):
    return np.stack([ref_processed_probs(row, s) for row in logits_NV])


@st.composite
def sampling_trees(draw):
    """A random tree (parents before children; sibling tokens may repeat) and N x V logits."""
    parents = draw(tree_parents(SN))
    tokens = draw(st.lists(st.integers(0, SV - 1), min_size=SN, max_size=SN))
    seed = draw(st.integers(0, 2**31 - 1))
    logits = np.random.default_rng(seed).normal(size=(SN, SV)) * 1.5
    return np.array(tokens), np.array(parents), logits.astype(np.float32)


@pytest.mark.optimized
@settings(max_examples=20, **SETTINGS)
@given(trees=st.lists(sampling_trees(), min_size=2, max_size=2), s=st.sampled_from(SAMPLING_CONFIGS),
       seed=st.integers(0, 2**31 - 1))
def test_accept_sampling_matches_exact_distribution(trees, s, seed):
    results = run_sampling(trees, s, seed)
    for (tokens, parents, logits), (final, bonus, first) in zip(trees, results):
        P = processed(logits, s)
        walk = ref_walk_distribution(P, tokens, parents)
        # the rule itself is lossless: the walk's outcomes have the target's own probabilities
        target = ref_target_distribution(P, tokens, parents)
        np.testing.assert_allclose(as_cells(walk, SN, SV), as_cells(target, SN, SV), rtol=0, atol=1e-12)
        counts = outcome_counts(final, bonus)
        expected = as_cells(walk, SN, SV)
        p = chi_square_p(counts, expected)
        assert p > P_THRESHOLD, f"outcomes differ from the reference walk: p={p:.2e}\n{counts}\n{expected * SAMPLES}"
        # lossless: the first emitted token follows the target's processed distribution at the root
        p_first = chi_square_p(np.bincount(first, minlength=SV), P[0])
        assert p_first > P_THRESHOLD, f"first token differs from the target's: p={p_first:.2e}"
        # power: a wrong rule far enough from the right one is rejected by these same counts
        for wrong in (ref_walk_distribution(P, tokens, parents, zero_rejected=False),
                      ref_walk_distribution(P, tokens, parents, bonus_P_NV=processed(logits, SamplingConfig(1.0)))):
            w = as_cells(wrong, SN, SV)
            if total_variation(w, expected) > TV_POWER:
                event("power check made")
                assert chi_square_p(counts, w) < P_THRESHOLD


# A fixed tree on which each wrong rule is far from the right one: the root's three children carry
# its three most likely tokens, the first child has two children of its own, a repeated sibling.
FIXED_TREE = (np.array([0, 2, 4, 1, 3, 1]), np.array([-1, 0, 0, 0, 1, 1]),
              np.array([[0.3, 1.6, 2.0, -1.0, 1.2, 0.0],
                        [0.5, 1.0, -0.5, 1.5, 0.2, 0.0],
                        [0.0, 0.4, 1.0, -1.0, 0.8, 0.3],
                        [1.0, 0.0, 0.5, -0.5, 0.2, 1.4],
                        [0.2, -0.3, 0.9, 1.1, 0.0, 0.4],
                        [0.6, 0.1, -0.2, 0.3, 1.7, 0.0]], np.float32))


@pytest.mark.optimized
@pytest.mark.parametrize("s", [SamplingConfig(1.0), SamplingConfig(0.6, top_p=0.9)], ids=["plain", "top_p"])
def test_broken_reference_rules_are_rejected(s):
    """The check has power: on the code's own outcomes the right reference passes and each wrong
    one (rejected siblings not zeroed; bonus from unprocessed logits, the official code's old
    mistake -- only visible when processing changes the distribution) fails."""
    tokens, parents, logits = FIXED_TREE
    (final, bonus, first), = run_sampling([FIXED_TREE], s, seed=11)
    counts = outcome_counts(final, bonus)
    P = processed(logits, s)
    right = as_cells(ref_walk_distribution(P, tokens, parents), SN, SV)
    assert chi_square_p(counts, right) > P_THRESHOLD
    assert chi_square_p(np.bincount(first, minlength=SV), P[0]) > P_THRESHOLD
    wrongs = {"siblings not zeroed": ref_walk_distribution(P, tokens, parents, zero_rejected=False)}
    if s != SamplingConfig(1.0):
        wrongs["unprocessed bonus"] = ref_walk_distribution(P, tokens, parents,
                                                            bonus_P_NV=processed(logits, SamplingConfig(1.0)))
    for name, wrong in wrongs.items():
        w = as_cells(wrong, SN, SV)
        assert total_variation(w, right) > TV_POWER, name
        assert chi_square_p(counts, w) < P_THRESHOLD, f"the wrong rule ({name}) was not rejected"


def test_an_empty_residual_never_emits_a_filtered_token():
    """Every live token (top-k 2 leaves two) is a child and both were rejected: in exact arithmetic
    the last live child is always accepted, but float32 rounding can reject it with probability
    ~1e-7 (u within an ulp of 1). The bonus must then still be a live token of the node, never one
    that top-k filtered out (sampling from an all-masked row would be uniform over the vocabulary)."""
    from eagle2_jax.models.layers import NEG_INF
    from eagle2_jax.decoding.verify import _bonus_row
    x_V = jnp.array([9.3, NEG_INF, NEG_INF, 3.8, NEG_INF, NEG_INF], jnp.float32)  # processed: top-k 2
    tokens_N, parents_N = jnp.array([5, 3, 0], jnp.int32), jnp.array([-1, 0, 0], jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(0), 256)
    bonus = jax.vmap(lambda k: _bonus_row(x_V, tokens_N, parents_N, jnp.int32(0), k))(keys)
    assert set(np.asarray(bonus).tolist()) <= {0, 3}
