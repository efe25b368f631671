"""The few-row CPU matmul custom call: values, row independence, dispatch and its off switch."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle2_jax import ModelConfig, init_target
from eagle2_jax.backends.cpu import kernels as few_rows
from eagle2_jax.backends.cpu.ops import ATTENTION_SWITCH, KERNELS_SWITCH, CpuOps
from eagle2_jax.models.ops import XLA_CPU, attend_xla

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or not few_rows.load(),
                                reason="few-row kernel is for XLA:CPU and needs a C++ compiler")

# Odd sizes on purpose: K not a multiple of 4 or 16, N not a multiple of 16 or 4.
SHAPES = [(1, 576, 1536), (3, 37, 70), (8, 48, 33), (9, 19, 5), (13, 64, 200), (2, 1, 7)]


def _ref(x, w, transpose_w):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return x64 @ (w64.T if transpose_w else w64)


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matmul_matches_float64_reference(M, K, N, transpose_w):
    rng = np.random.default_rng(M * 1000 + K + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K) if transpose_w else (K, N)).astype(np.float32)
    y = np.asarray(jax.jit(few_rows.matmul, static_argnums=2)(jnp.asarray(x), jnp.asarray(w), transpose_w))
    assert y.shape == (M, N)
    np.testing.assert_allclose(y, _ref(x, w, transpose_w), rtol=1e-5, atol=1e-5 * np.sqrt(K))


@pytest.mark.parametrize("K,N", [(576, 300), (37, 211)])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_a_row_is_bit_identical_whatever_the_other_rows(transpose_w, K, N):
    """The property lossless verification leans on: a tree row equals the same row decoded alone."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((N, K) if transpose_w else (K, N)).astype(np.float32))
    x = rng.standard_normal((11, K)).astype(np.float32)
    f = jax.jit(few_rows.matmul, static_argnums=2)
    alone = np.asarray(f(jnp.asarray(x[4:5]), w, transpose_w))[0]
    for m in (2, 3, 5, 6, 8, 11):
        rows = np.asarray(f(jnp.asarray(x[:m] if m > 4 else x[3:3 + m]), w, transpose_w))
        got = rows[4] if m > 4 else rows[1]
        assert np.array_equal(got, alone), f"row differs in a batch of {m}"


def _uses_kernel(fn, *args) -> bool:
    return few_rows.TARGET in jax.jit(fn).lower(*args).as_text()


def test_dot_general_dispatch_and_fallback():
    x8 = jnp.ones((2, 4, 96), jnp.float32)  # 8 rows
    w = jnp.ones((96, 3, 32), jnp.float32)  # DenseGeneral kernel [in, heads, head_dim]
    dims = (((2,), (0,)), ((), ()))
    f = lambda a, b: few_rows.dot_general(a, b, dims)  # noqa: E731
    assert _uses_kernel(f, x8, w)
    np.testing.assert_allclose(f(x8, w), jax.lax.dot_general(x8, w, dims), rtol=1e-6)
    assert not _uses_kernel(f, jnp.ones((3, 4, 96)), w)  # 12 rows: XLA's GEMM
    assert not _uses_kernel(f, x8.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    o = jnp.ones((3, 32, 96), jnp.float32)  # attention output kernel [heads, head_dim, D]
    g = lambda a, b: few_rows.dot_general(a, b, (((2, 3), (0, 1)), ((), ())))  # noqa: E731
    h = jnp.ones((1, 2, 3, 32), jnp.float32)
    assert _uses_kernel(g, h, o)
    assert g(h, o).shape == (1, 2, 96)
    emb = jnp.ones((50, 96), jnp.float32)  # tied embedding [V, D] as LM head
    lm = lambda a, b: few_rows.dot_general(a, b, (((2,), (1,)), ((), ())))  # noqa: E731
    x12 = jnp.ones((3, 4, 96), jnp.float32)
    assert _uses_kernel(lm, x8, emb) and not _uses_kernel(lm, x12, emb)  # 8 rows yes, 12 no


def test_gradients_flow_through_xla():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 20)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((20, 7)).astype(np.float32))
    def loss(x, w, t):
        return jnp.sum(jnp.sin(few_rows.matmul(x, w.T, True) if t else few_rows.matmul(x, w, False)))

    ref = lambda x, w: jnp.sum(jnp.sin(x @ w))  # noqa: E731
    for t in (False, True):
        got = jax.grad(loss, argnums=(0, 1))(x, w, t)
        want = jax.grad(ref, argnums=(0, 1))(x, w)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_target_uses_the_kernel_on_one_device_only(monkeypatch):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    t = init_target(cfg)
    assert isinstance(t.module.ops, CpuOps)
    assert init_target(cfg, dtype="bfloat16").ops is XLA_CPU  # float32 only: else XLA as XLA:CPU runs it
    monkeypatch.setenv(KERNELS_SWITCH, "0")  # read when the target is made, then part of the compile key
    assert init_target(cfg).ops is XLA_CPU
    monkeypatch.delenv(KERNELS_SWITCH)
    if len(jax.devices()) >= 2:  # params sharded over a mesh keep XLA's dot
        from eagle2_jax import make_mesh
        sharded = init_target(cfg, mesh=make_mesh(model=2, devices=jax.devices()[:2]))
        assert sharded.ops is XLA_CPU


@pytest.mark.parametrize("rows", [1, 5])
def test_stacked_weights_read_in_place_equal_slices(rows):
    """A layer index into a stacked weight / cache gives the bits of the sliced one, and inside a
    scan the kernel reads the stack itself (no per-layer slice feeds the custom call)."""
    rng = np.random.default_rng(rows)
    L, K, N = 3, 48, 40
    w = jnp.asarray(rng.standard_normal((L, K, N)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((rows, K)).astype(np.float32))
    for i in range(L):
        got = jax.jit(lambda x, w, i: few_rows.matmul(x, w, False, i))(x, w, jnp.int32(i))
        assert np.array_equal(np.asarray(got), np.asarray(few_rows.matmul(x, w[i])))
    ops = CpuOps()

    def body(c, p):
        return c + ops.dense(x, p["k"]).sum(), None
    scan = jax.jit(lambda w: ops.scan_layers(body, jnp.float32(0), {"k": w})[0])
    hlo = scan.lower(w).compile().as_text()
    call = next(ln for ln in hlo.splitlines() if few_rows.TARGET in ln and "custom-call(" in ln)
    assert f"f32[{L},{K},{N}]" in call, call  # the whole stack is the operand
    want = sum(float(np.asarray(few_rows.matmul(x, w[i])).sum()) for i in range(L))
    np.testing.assert_allclose(float(scan(w)), want, rtol=1e-5)
    args = _attention_inputs(rng, 2, 3, 4, 2, 9, 16)
    kc = jnp.stack([args[1] * (j + 1) for j in range(L)])
    vc = jnp.stack([args[2] - j for j in range(L)])
    from eagle2_jax.backends.cpu.ops import Indexed
    for i in range(L):
        got = jax.jit(lambda *a: ops.attend(a[0], Indexed(a[1], a[-1]), Indexed(a[2], a[-1]), *a[3:-1]))(
            args[0], kc, vc, *args[3:], jnp.int32(i))
        want = ops.attend(args[0], kc[i], vc[i], *args[3:])
        assert np.array_equal(np.asarray(got), np.asarray(want))


def _attention_inputs(rng, B, T, H, K, S, Dh, p=0.6):
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    mask = jnp.asarray(rng.random((B, T, S)) < p)
    mask_new = jnp.asarray(np.tril(rng.random((B, T, T)) < 0.7) | np.eye(T, dtype=bool)[None])
    return f(B, T, H, Dh), f(B, K, S, Dh), f(B, K, S, Dh), mask, f(B, K, T, Dh), f(B, K, T, Dh), mask_new


@pytest.mark.parametrize("B,T,H,K,S,Dh", [(2, 4, 6, 2, 40, 64), (1, 1, 9, 3, 17, 64), (3, 5, 4, 4, 9, 12)])
def test_attention_kernel_matches_xla_and_its_gradient(B, T, H, K, S, Dh):
    args = _attention_inputs(np.random.default_rng(B * 100 + T), B, T, H, K, S, Dh)
    ref = jax.jit(functools.partial(attend_xla, scores="slots"))(*args)
    got = jax.jit(CpuOps().attend)(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=2e-6)
    g_kernel = jax.grad(lambda q: CpuOps().attend(q, *args[1:]).sum())(args[0])
    g_xla = jax.grad(lambda q: attend_xla(q, *args[1:], scores="slots").sum())(args[0])
    np.testing.assert_array_equal(np.asarray(g_kernel), np.asarray(g_xla))


def test_attention_row_sees_keys_in_cache_or_new_alike():
    """A token verified inside a tree (its ancestors among the new keys) gets the same bits as the
    same token decoded alone (its ancestors already in the cache), whatever else the call holds:
    the property greedy verification leans on."""
    rng = np.random.default_rng(7)
    B, T, H, K, S, Dh, P = 2, 4, 6, 2, 30, 64, 11  # P committed slots
    q, kc, vc, _, kn, vn, _ = _attention_inputs(rng, B, T, H, K, S, Dh)
    chain = np.tril(np.ones((T, T), bool))  # a chain: token t sees tokens 0..t
    mask = jnp.asarray(np.broadcast_to(np.arange(S) < P, (B, T, S)))
    tree = jax.jit(CpuOps().attend)(q, kc, vc, mask, kn, vn,
                                                             jnp.asarray(np.broadcast_to(chain, (B, T, T))))
    for t in range(T):  # decode token t alone: tokens 0..t-1 written to cache slots P.., itself new
        kc_t = kc.at[:, :, P:P + t].set(kn[:, :, :t])
        vc_t = vc.at[:, :, P:P + t].set(vn[:, :, :t])
        m_t = jnp.asarray(np.broadcast_to(np.arange(S) < P + t, (B, 1, S)))
        alone = jax.jit(CpuOps().attend)(
            q[:, t:t + 1], kc_t, vc_t, m_t, kn[:, :, t:t + 1], vn[:, :, t:t + 1], jnp.ones((B, 1, 1), bool))
        np.testing.assert_array_equal(np.asarray(alone[:, 0]), np.asarray(tree[:, t]))


def test_attention_switch(monkeypatch):
    args = _attention_inputs(np.random.default_rng(3), 1, 2, 4, 2, 8, 16)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    hlo = lambda ops: jax.jit(ops.attend).lower(*args).as_text()  # noqa: E731
    assert few_rows.ATTENTION_TARGET in hlo(init_target(cfg).ops)
    monkeypatch.setenv(ATTENTION_SWITCH, "0")  # read when the target is loaded: a field of its ops
    ops = init_target(cfg).ops
    assert isinstance(ops, CpuOps) and not ops.attention
    assert few_rows.ATTENTION_TARGET not in hlo(ops)
