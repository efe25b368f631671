"""Tree building properties (hypothesis): connected, parents first, ancestor-closure mask, depths,
top-scored selection, and rows never see each other's data."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from eagle2_jax import TreeConfig
from eagle2_jax.decoding.tree import Pool, rerank
from eagle2_jax.decoding.verify import accept_greedy


def synthetic_pool(rng, K, D, ties=False):
    """A pool with expand()'s structure: level-major, children scored parent + log-prob."""
    def child_logps(n):
        lp = np.sort(np.log(rng.dirichlet(np.ones(K + 3)))[:K])[::-1]
        if ties and rng.random() < 0.5:
            lp = np.zeros(K) if rng.random() < 0.3 else np.round(lp, 1)
        return lp
    toks = [rng.permutation(50)[:K]]
    scores = [child_logps(K)]
    parents = [np.full(K, -1)]
    frontier = np.argsort(-scores[0], kind="stable")[:K]
    f_scores, f_idx = scores[0][frontier], frontier
    base = K
    for level in range(D):
        cs = np.stack([f_scores[i] + child_logps(K) for i in range(K)]).reshape(-1)
        ct = np.stack([rng.permutation(50)[:K] for _ in range(K)]).reshape(-1)
        scores.append(cs)
        toks.append(ct)
        parents.append(np.repeat(f_idx, K))
        pick = np.argsort(-cs, kind="stable")[:K]
        f_scores, f_idx = cs[pick], base + pick
        base += K * K
    cat = lambda xs, dt: np.concatenate(xs).astype(dt)  # noqa: E731
    return cat(toks, np.int32), cat(scores, np.float32), cat(parents, np.int32)


def check_tree(tokens, parents, anc, depths, pool_tok, pool_score, pool_parent, N, root):
    assert tokens[0] == root and parents[0] == -1 and depths[0] == 0
    for i in range(1, N):
        assert 0 <= parents[i] < i  # connected, parent precedes child
        assert depths[i] == depths[parents[i]] + 1
    for i in range(N):  # ancestor closure
        chain, j = {i}, i
        while parents[j] >= 0:
            j = parents[j]
            chain.add(j)
        assert set(np.flatnonzero(anc[i])) == chain


@settings(max_examples=40, deadline=None)
@given(K=st.integers(1, 5), D=st.integers(1, 4), frac=st.floats(0, 1), seed=st.integers(0, 2**31 - 1),
       ties=st.booleans())
def test_rerank_properties(K, D, frac, seed, ties):
    rng = np.random.default_rng(seed)
    pool_size = K + D * K * K
    N = 1 + int(round(frac * pool_size))
    cfg = TreeConfig(depth=D, top_k=K, total_tokens=N)
    B = 3
    pools = [synthetic_pool(rng, K, D, ties) for _ in range(B)]
    pool = Pool(*(jnp.asarray(np.stack([p[i] for p in pools])) for i in range(3)))
    roots = jnp.asarray(rng.integers(0, 50, B), jnp.int32)
    rr = jax.jit(rerank, static_argnums=2)
    t = rr(pool, roots, cfg)
    for b in range(B):
        tok, par, anc, dep = (np.asarray(x[b]) for x in (t.tokens_BN, t.parents_BN, t.ancestors_BNN, t.depths_BN))
        check_tree(tok, par, anc, dep, *pools[b], N, int(roots[b]))
        assert dep.max() <= D + 1
        # the selected pool scores are the N-1 largest
        if N > 1:
            sel = np.sort(np.asarray(jax.lax.top_k(pool.scores_BQ[b], N - 1)[1]))
            np.testing.assert_array_equal(tok[1:], pools[b][0][sel])
        # each row alone gives the same tree: no cross-row gathers
        alone = rr(Pool(*(x[b:b + 1] for x in (pool.tokens_BQ, pool.scores_BQ, pool.parents_BQ))),
                   roots[b:b + 1], cfg)
        np.testing.assert_array_equal(np.asarray(alone.parents_BN[0]), par)
        np.testing.assert_array_equal(np.asarray(alone.tokens_BN[0]), tok)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_greedy_accept_walks_a_valid_path(seed):
    rng = np.random.default_rng(seed)
    K, D, N = 3, 3, 14
    cfg = TreeConfig(D, K, N)
    B = 2
    pools = [synthetic_pool(rng, K, D) for _ in range(B)]
    pool = Pool(*(jnp.asarray(np.stack([p[i] for p in pools])) for i in range(3)))
    t = rerank(pool, jnp.asarray([3, 4], jnp.int32), cfg)
    logits = jnp.asarray(rng.normal(size=(B, N, 50)), jnp.float32)
    # make the target agree with the tree along a random branch
    tok = np.asarray(t.tokens_BN)
    par = np.asarray(t.parents_BN)
    lg = np.asarray(logits).copy()
    for b in range(B):
        for i in range(1, N):
            if rng.random() < 0.7:
                lg[b, par[b, i], tok[b, i]] = 100.0 + rng.random()
    path, n_acc, bonus = accept_greedy(t, jnp.asarray(lg), D + 2)
    g = lg.argmax(-1)
    for b in range(B):
        p = np.asarray(path[b])[:int(n_acc[b])]
        assert p[0] == 0
        for a, c in zip(p[:-1], p[1:]):
            assert par[b, c] == a and tok[b, c] == g[b, a]
        last = p[-1]
        assert int(bonus[b]) == g[b, last]
        # no child of the last node matches: the path is maximal
        kids = [c for c in range(1, N) if par[b, c] == last]
        assert all(tok[b, c] != g[b, last] for c in kids)


def test_skipped_draft_passes_leave_the_tree_unchanged():
    """With N - 2 < depth the later draft passes cannot contribute a kept node: expanding only
    TreeConfig.passes levels gives the tree that the full-depth pool gives."""
    from eagle2_jax.models.cache import init_cache
    from eagle2_jax.decoding.spec import RoundSpec, params_of
    from eagle2_jax.decoding.tree import expand
    from helpers import tiny_pair
    t, d = tiny_pair(3)
    d.params = jax.tree_util.tree_map(lambda x: x * 3.0, d.params)  # peaked: deep branches score high
    c = d.module.config
    B, D, K = 4, 5, 3
    dcache = init_cache(1, B, 64, c.num_key_value_heads, c.head_dim, d.module.dtype)
    dcache = dcache.replace(length=jnp.asarray([3, 5, 7, 9], jnp.int32))
    hidden = jax.random.normal(jax.random.PRNGKey(0), (B, c.hidden_size))
    roots = jnp.asarray([1, 2, 3, 4], jnp.int32)
    full_cfg = TreeConfig(D, K, 1 + K + D * K * K)
    expand_jit, rerank_jit = jax.jit(expand, static_argnums=0), jax.jit(rerank, static_argnums=2)
    params = params_of(t, d)
    full_pool, _ = expand_jit(RoundSpec.of(t, d, full_cfg), params, dcache, hidden)
    deepest = 0
    for N in (1, 2, 3, 4, 5, 6):
        cfg = TreeConfig(D, K, N)
        assert cfg.passes == max(0, min(D, N - 2))
        pool, _ = expand_jit(RoundSpec.of(t, d, cfg), params, dcache, hidden)
        assert pool.tokens_BQ.shape[1] == K + cfg.passes * K * K
        short, ref = rerank_jit(pool, roots, cfg), rerank_jit(full_pool, roots, cfg)
        for a, b in zip((short.tokens_BN, short.parents_BN, short.depths_BN, short.ancestors_BNN),
                        (ref.tokens_BN, ref.parents_BN, ref.depths_BN, ref.ancestors_BNN)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        deepest = max(deepest, int(ref.depths_BN.max()))
    assert deepest >= 4  # some row keeps a chain as deep as N allows: the check is not vacuous


def test_top_log_probs_equals_top_k_of_log_softmax():
    """The draft's ranking (top-k on the logits, log-probs of those k alone) gives log_softmax's values
    and order, float32 and bfloat16 logits, jitted, batched."""
    from eagle2_jax.models.layers import top_log_probs
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 1000)) * 6
    for dtype in (jnp.float32, jnp.bfloat16):
        xi = x.astype(dtype)
        ref = jax.jit(lambda v: jax.lax.top_k(jax.nn.log_softmax(v.astype(jnp.float32), axis=-1), 8))(xi)
        got = jax.jit(lambda v: top_log_probs(v, 8))(xi)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(ref[1]))
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=0, atol=1e-6)


def test_row_picks_equal_gathers():
    """expand's one-hot row picks give exactly take_along_axis's rows: bf16 and float32 hidden states
    (with infinities), int tokens, bool ancestor masks, repeated picks."""
    from eagle2_jax.decoding.tree import _take_rows
    rng = np.random.default_rng(0)
    B, K, J = 3, 10, 10
    idx = jnp.asarray(rng.integers(0, K, (B, J)), jnp.int32)
    h = rng.standard_normal((B, K, 7)).astype(np.float32)
    h[0, 1, 2], h[2, 4, 1] = np.inf, -np.inf
    for x in (jnp.asarray(h), jnp.asarray(h, jnp.bfloat16), jnp.asarray(rng.integers(-1, 49152, (B, K)), jnp.int32),
              jnp.asarray(rng.random((B, K, 50)) < 0.3)):
        ref = jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)
        got = jax.jit(_take_rows)(x, idx)
        assert got.dtype == x.dtype and got.shape == ref.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
