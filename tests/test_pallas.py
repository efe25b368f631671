"""The Pallas tree-attention kernel (eagle2_jax.backends.pallas): equal to the XLA attention on random masks,
lossless in generation (interpret mode on CPU), sharded per device, and lowerable for GPU (Triton)
and TPU (Mosaic) from this machine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle2_jax as e2
from eagle2_jax.backends import pallas
from eagle2_jax.models.ops import attend_xla
from eagle2_jax.backends.pallas.attention import live_blocks, split_count, tree_attention
from helpers import tiny_config

# the kernel as this machine runs it: interpret mode on a CPU, Triton / Mosaic on a GPU / TPU
BACKEND = "interpret" if jax.default_backend() == "cpu" else ("tpu" if jax.default_backend() == "tpu" else "gpu")


def _inputs(rng, B, T, H, K, S, Dh, dtype, lengths, scratch=0):
    """Committed prefix per row (lengths), `scratch` slots after it seen by some queries only, and a
    random tree mask (every token sees itself) over the new tokens."""
    r = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    mask = np.zeros((B, T, S), bool)
    for b, n in enumerate(lengths):
        mask[b, :, :n] = True
        mask[b, :, n:n + scratch] = rng.random((T, min(scratch, S - n))) < 0.5
    new = (np.tril(np.ones((T, T), bool))[None] & (rng.random((B, T, T)) < 0.6)) | np.eye(T, dtype=bool)[None]
    return r(B, T, H, Dh), r(B, K, S, Dh), r(B, K, S, Dh), jnp.asarray(mask), r(B, K, T, Dh), r(B, K, T, Dh), jnp.asarray(new)


@pytest.mark.parametrize("B,T,H,K,S,Dh,lengths,scratch", [
    (2, 5, 4, 2, 48, 16, [20, 0], 6),      # a row with an empty prefix: only scratch and new keys
    (3, 1, 6, 2, 40, 8, [40, 7, 33], 0),   # decoding steps; a full cache
    (1, 20, 4, 1, 64, 32, [50], 9),        # a tree of 20 tokens, one KV head
    (2, 3, 2, 2, 0, 16, [0, 0], 0),        # a prefill's empty cache view
])
def test_kernel_equals_xla_attention(B, T, H, K, S, Dh, lengths, scratch):
    args = _inputs(np.random.default_rng(S + T), B, T, H, K, S, Dh, jnp.float32, lengths, scratch)
    want = attend_xla(*args)
    for block, splits in ((16, 1), (128, 1), (16, 3), (16, 5)):  # the walk whole, or split (flash-decoding)
        got = tree_attention(*args, block=block, backend=BACKEND, splits=splits)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)
    if S:  # the cache alone (a forward that wrote its keys/values first): the new block moved into it
        one = (args[0], jnp.concatenate([args[1], args[4]], 2), jnp.concatenate([args[2], args[5]], 2),
               jnp.concatenate([args[3], args[6]], 2))
        for splits in (1, 2):
            got = tree_attention(*one, block=16, backend=BACKEND, splits=splits)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)


def test_kernel_bfloat16_and_live_blocks():
    args = _inputs(np.random.default_rng(0), 2, 6, 4, 2, 256, 32, jnp.bfloat16, [100, 3], 4)
    want = np.asarray(attend_xla(*args), np.float32)
    for splits in (1, 4):
        got = np.asarray(tree_attention(*args, block=32, backend=BACKEND, splits=splits), np.float32)
        np.testing.assert_allclose(got, want, atol=1.6e-2, rtol=1.6e-2)  # bf16 output rounding
    # the walk stops at the last slot any query may see: committed + the scratch in use
    assert live_blocks(args[3], 32).tolist() == [int(np.ceil((args[3][0].any(0).nonzero()[0].max() + 1) / 32)), 1]


def test_split_count():
    """GPU: about one program per SM; a TPU core runs the grid in sequence and keeps one walk."""
    assert split_count(1, 8, 48, "gpu") == 12  # 8B verify, batch 1, a 6,144-slot (4K) bucket
    assert split_count(1, 8, 3, "gpu") == 1    # a 384-slot bucket: 3 blocks, nothing to split
    assert split_count(4, 8, 48, "gpu") == 4
    assert split_count(16, 8, 48, "gpu") == 1  # 128 programs already
    assert split_count(1, 8, 48, "tpu") == 1


@pytest.mark.parametrize("arch", ["eagle", pytest.param("eagle3", marks=pytest.mark.slow)])
def test_generation_with_the_kernel_is_lossless(arch):
    t = e2.init_target(tiny_config(num_hidden_layers=3), 0)
    d = e2.init_draft(t, 1, arch=arch) if arch == "eagle3" else e2.init_draft(t, 1)
    tk, dk = pallas.use(t, d, backend=BACKEND)
    assert tk.ops.name == "pallas" and dk.ops == tk.ops
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    plain = e2.generate_vanilla(t, prompts, max_new_tokens=20).tokens
    assert e2.generate_vanilla(tk, prompts, max_new_tokens=20).tokens == plain
    assert e2.generate(tk, dk, prompts, max_new_tokens=20, tree=e2.TreeConfig(3, 3, 8)).tokens == plain


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
def test_kernel_per_shard():
    cfg = tiny_config(num_attention_heads=8, num_key_value_heads=4, hidden_size=64, intermediate_size=128)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    t = e2.init_target(cfg, 0)
    plain = e2.generate_vanilla(t, prompts, max_new_tokens=10).tokens
    mesh = e2.make_mesh(2, 4)
    ts = e2.init_target(cfg, 0, mesh=mesh)
    tk, dk = pallas.use(ts, e2.init_draft(ts, 1), backend="interpret")
    assert tk.ops.mesh is mesh
    assert e2.generate(tk, dk, prompts, max_new_tokens=10, tree=e2.TreeConfig(2, 2, 4)).tokens == plain


@pytest.mark.parametrize("backend,platform,S", [("gpu", "cuda", 384), ("gpu", "cuda", 6144), ("tpu", "tpu", 384)])
def test_kernel_lowers_for_gpu_and_tpu(backend, platform, S):
    """Triton / Mosaic lowering runs here (compiling needs the device): the 8B verify shape, at a
    6,144-slot cache with the walk split in 12."""
    from jax import export
    sd = jax.ShapeDtypeStruct
    B, T, H, K, Dh, dt = 1, 60, 32, 8, 128, jnp.bfloat16
    shapes = (sd((B, T, H, Dh), dt), sd((B, K, S, Dh), dt), sd((B, K, S, Dh), dt), sd((B, T, S), bool),
              sd((B, K, T, Dh), dt), sd((B, K, T, Dh), dt), sd((B, T, T), bool))
    f = jax.jit(lambda *a: tree_attention(*a, backend=backend))
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    ex = export.export(f, platforms=[platform], disabled_checks=checks)(*shapes)
    text = ex.mlir_module()
    assert ("triton" in text) if backend == "gpu" else ("tpu_custom_call" in text)
    # the kernel's cost estimate reaches XLA's cost analysis (no -1 for an unknown custom call)
    cost = f.trace(*shapes).lower(lowering_platforms=(platform,)).cost_analysis()
    assert cost["bytes accessed"] >= 2 * B * K * S * Dh * 2


def test_switch(monkeypatch):
    monkeypatch.setenv(pallas.SWITCH, "fast")
    with pytest.raises(ValueError, match="EAGLE2_JAX_ATTENTION='fast': one of xla, pallas, pallas-interpret"):
        e2.init_target(tiny_config(), 0)
    monkeypatch.setenv(pallas.SWITCH, "pallas")  # no GPU/TPU here: the plain XLA path
    assert e2.init_target(tiny_config(), 0).ops.name != "pallas"
    monkeypatch.setenv(pallas.SWITCH, "pallas-interpret")
    assert e2.init_target(tiny_config(), 0).ops == pallas.PallasOps(backend="interpret")


def test_long_calls_keep_the_xla_attention():
    """A prefill (more than max_new new tokens) is not the kernel's: its [T, T] block would not fit."""
    ops = pallas.PallasOps(backend="interpret", max_new=4)
    args = _inputs(np.random.default_rng(1), 1, 6, 4, 2, 16, 8, jnp.float32, [5])
    text = str(jax.make_jaxpr(ops.attend)(*args))
    assert "pallas_call" not in text
    assert "pallas_call" in str(jax.make_jaxpr(pallas.PallasOps(backend="interpret", max_new=8).attend)(*args))


def test_ops_split_walks_by_rule_or_as_asked():
    """PallasOps splits a long cache walk as `split_count` says (here 2 parts: 8 blocks, 2 heads), or
    as many times as its `splits` field asks (1: one walk, for A/B timing on a device)."""
    import re
    sd = jax.ShapeDtypeStruct
    args = (sd((1, 4, 4, 16), jnp.float32), sd((1, 2, 1024, 16), jnp.float32), sd((1, 2, 1024, 16), jnp.float32),
            sd((1, 4, 1024), bool))
    grid = lambda ops: re.search(r"GridMapping\(grid=\(([\d, ]+)\)", str(jax.make_jaxpr(ops.attend)(*args))).group(1)  # noqa: E731
    assert grid(pallas.PallasOps(backend="interpret")) == "1, 2, 2"
    assert grid(pallas.PallasOps(backend="interpret", splits=1)) == "1, 2"
    assert grid(pallas.PallasOps(backend="interpret", splits=5)) == "1, 2, 5"


def test_kernel_ops_fall_back_to_the_platforms_score_layout():
    """Calls with more new tokens than the kernel takes (prefill) use the XLA attention laid out as
    the platform's XLA path lays it out: by query head on TPU, by query row elsewhere."""
    assert pallas.ops_for(backend="tpu").scores == "heads"
    assert pallas.ops_for(backend="gpu").scores == pallas.ops_for(backend="interpret").scores == "rows"


def test_kernel_ops_keep_the_targets_layer_layout():
    """The kernel replaces attention only: a target loaded with per-layer weight buffers (the GPU's
    layout) keeps running its layers as a list under it, and decodes the same tokens."""
    from eagle2_jax.models.layer_list import per_layer
    from eagle2_jax.models.ops import XLA
    import dataclasses
    assert pallas.ops_for(backend="gpu").layers == "list" and pallas.ops_for(backend="tpu").layers == "scan"
    t = e2.init_target(tiny_config(num_hidden_layers=3), 0)
    tl = per_layer(dataclasses.replace(t, ops=XLA))
    tk, dk = pallas.use(tl, e2.init_draft(tl, 1), backend=BACKEND)
    assert tk.ops.layers == "list"
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    plain = e2.generate_vanilla(t, prompts, max_new_tokens=12).tokens
    assert e2.generate(tk, dk, prompts, max_new_tokens=12, tree=e2.TreeConfig(2, 2, 4)).tokens == plain
