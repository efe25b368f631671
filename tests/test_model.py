"""Target model: against Hugging Face's PyTorch Llama, Qwen2 and Qwen3 (tiny random, built here), cache
paths, errors."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import have_torch
from eagle2_jax import ModelConfig, forward, init_target, load_target
from eagle2_jax.models.cache import advance, init_cache
from eagle2_jax.loading.convert import CheckpointError
from eagle2_jax.models.layers import causal_mask
from eagle2_jax.models.target import target_apply, target_logits
from eagle2_jax.models.ops import XLA
from helpers import tiny_config

HF_CASES = {
    "gqa_untied": dict(),
    "tied": dict(tie_word_embeddings=True),
    "mha": dict(num_key_value_heads=4),
    "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                        rope_theta=500000.0),
    "qwen2_bias": dict(model_type="qwen2"),
    "qwen3_qk_norm": dict(model_type="qwen3", head_dim=24),  # head_dim from the config, not hidden / heads
    # local layers (window 8, their own RoPE base) among global ones; 40 tokens cross the window
    "gemma3_text": dict(model_type="gemma3_text", head_dim=24, num_hidden_layers=3, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        query_pre_attn_scalar=20, tie_word_embeddings=True, rope_theta=100000.0,
                        rope_local_base_freq=1000.0),
}


def _hf_model(tmp_path, case):
    import torch
    import transformers
    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False, rms_norm_eps=1e-5)
    kw.update(HF_CASES[case])
    torch.manual_seed(0)
    if kw.get("model_type") == "gemma3_text":
        kw.pop("model_type")
        rope = dict(full_attention=dict(rope_type="default", rope_theta=kw.pop("rope_theta")),
                    sliding_attention=dict(rope_type="default", rope_theta=kw.pop("rope_local_base_freq")))
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kw, rope_parameters=rope))
    elif kw.get("model_type") in ("qwen2", "qwen3"):
        arch = kw.pop("model_type").capitalize()
        model = getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, f"{arch}Config")(**kw))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    with torch.no_grad():  # non-trivial norms and biases (Gemma's norms start at 0: scale 1 + weight)
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    d = tmp_path / case
    model.save_pretrained(d, safe_serialization=True)
    return model, d


@pytest.mark.skipif(not have_torch(), reason="torch not installed (test extra)")
@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_logits_match_hf(tmp_path, case):
    import torch
    model, d = _hf_model(tmp_path, case)
    target = load_target(str(d))
    ids = np.random.default_rng(0).integers(0, 96, size=(2, 40))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(forward(target, ids))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.skipif(not have_torch(), reason="torch not installed (test extra)")
def test_sharded_safetensors_index(tmp_path):
    import torch
    model, _ = _hf_model(tmp_path, "gqa_untied")
    d = tmp_path / "sharded"
    model.save_pretrained(d, safe_serialization=True, max_shard_size="20KB")
    assert os.path.exists(d / "model.safetensors.index.json")
    ids = np.arange(10)[None]
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(forward(load_target(str(d)), ids)), ref, atol=1e-4, rtol=0)


ATTENTION_FORMS = {"default": None, "cache_first": XLA, "two_blocks": dataclasses.replace(XLA, cache_first=False)}


def _with_form(t, form):
    """The target computing with one attention form; cache-first needs the layer loop unrolled
    (per-layer weight buffers, the GPU layout)."""
    from eagle2_jax.models.layer_list import per_layer
    if ATTENTION_FORMS[form] is None:
        return t
    return per_layer(dataclasses.replace(t, ops=ATTENTION_FORMS[form]))


@pytest.mark.parametrize("form", ATTENTION_FORMS)
def test_cache_path_equals_full_forward(form):
    t = _with_form(init_target(tiny_config(), 0), form)
    m = t.module
    ids = np.random.default_rng(1).integers(0, 64, size=(2, 12)).astype(np.int32)
    full = np.asarray(forward(t, ids))
    cache = init_cache(2, 2, 32, 2, 8, jnp.float32)
    # prefill 5 tokens, then 1, then 6 at once through the cache
    outs = []
    apply = jax.jit(target_apply, static_argnums=0)
    for lo, hi in ((0, 5), (5, 6), (6, 12)):
        T = hi - lo
        pos = jnp.broadcast_to(jnp.arange(lo, hi), (2, T)).astype(jnp.int32)
        f, cache = apply(m, t.params, jnp.asarray(ids[:, lo:hi]), pos, cache, causal_mask(2, T))
        cache = advance(cache, jnp.full((2,), T, jnp.int32))
        outs.append(np.asarray(target_logits(m, t.params, f)))
    np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5, rtol=0)


def test_bfloat16_params_close_to_float32():
    cfg = tiny_config()
    import dataclasses
    import jax
    t32 = init_target(cfg, 0)
    assert init_target(cfg, 0, dtype="bfloat16").params["embed"].dtype == jnp.bfloat16
    t16 = dataclasses.replace(t32, dtype=jnp.bfloat16,
                              params=jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), t32.params))
    ids = np.arange(8)[None]
    a, b = np.asarray(forward(t32, ids)), np.asarray(forward(t16, ids))
    assert b.dtype == np.float32
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max() + 0.05


def test_half_precision_dense_rounds_once():
    """bf16 Dense products accumulate in f32 and round once: the accelerator path asks for a bf16
    result (matrix units round on write), XLA:CPU's flavour for an f32 result and a rounding op;
    both give the float32 product rounded to bf16."""
    import jax
    from eagle2_jax.models.ops import XLA, XLA_CPU
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 300)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((300, 7)), jnp.bfloat16)
    assert "preferred_element_type=bfloat16" in str(jax.make_jaxpr(XLA.dense)(x, w))
    assert "preferred_element_type=float32" in str(jax.make_jaxpr(XLA_CPU.dense)(x, w))
    f32 = np.asarray(jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision="highest"))
    for ops in (XLA, XLA_CPU):
        y = ops.dense(x, w)
        assert y.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(y, np.float64), f32, rtol=2 ** -8, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(XLA.dense(x, w), np.float32), np.asarray(XLA_CPU.dense(x, w), np.float32))
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)  # float32 operands: the plain product
    dims = (((1,), (0,)), ((), ()))
    np.testing.assert_array_equal(np.asarray(XLA.dense(x32, w32)), np.asarray(jax.lax.dot_general(x32, w32, dims)))


def test_unknown_model_name():
    with pytest.raises(CheckpointError, match="unknown model 'no-such-model'"):
        load_target("no-such-model")


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be one of"):
        init_target(tiny_config(), dtype="float16")


def test_corrupt_files(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="corrupt GGUF file"):
        load_target(str(bad))
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_target(str(d))
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="corrupt safetensors"):
        load_target(str(d))
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt config"):
        load_target(str(d))


def test_unsupported_architecture(tmp_path):
    d = tmp_path / "gpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_target(str(d))


def test_missing_tensor(tmp_path):
    from safetensors.numpy import save_file
    cfg = tiny_config(num_hidden_layers=1)
    d = tmp_path / "partial"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file({"model.embed_tokens.weight": np.zeros((64, 32), np.float32)}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor"):
        load_target(str(d))


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of"):
        ModelConfig(num_attention_heads=4, num_key_value_heads=3, hidden_size=32)


def test_save_hf_dir_round_trip(tmp_path):
    from eagle2_jax.loading.hf_files import save_hf_dir
    t = init_target(tiny_config(attention_bias=True), 0)
    t2 = load_target(save_hf_dir(t, str(tmp_path / "m")))
    ids = np.arange(9)[None]
    np.testing.assert_allclose(np.asarray(forward(t2, ids)), np.asarray(forward(t, ids)), atol=1e-6)


def test_attention_score_layouts_agree_with_a_numpy_softmax():
    """The three score layouts (GPU's query rows, TPU's query heads, XLA:CPU's slots) give the same
    attention, which is the float64 NumPy softmax over the allowed cache slots and new keys, with
    masks as given or as each layout's `loop_masks` makes them."""
    from eagle2_jax.models.ops import XLA, XLA_CPU, XLA_TPU, attend_xla
    assert (XLA.scores, XLA_TPU.scores, XLA_CPU.scores) == ("rows", "heads", "slots")
    rng = np.random.default_rng(1)
    B, T, H, K, Dh, S = 2, 5, 6, 2, 8, 11
    q, k, v = (rng.standard_normal(s) for s in [(B, T, H, Dh), (B, K, S, Dh), (B, K, S, Dh)])
    kn, vn = rng.standard_normal((B, K, T, Dh)), rng.standard_normal((B, K, T, Dh))
    m, mn = rng.random((B, T, S)) < 0.5, np.tril(np.ones((T, T), bool)) & (rng.random((B, T, T)) < 0.7)
    mn[:, np.arange(T), np.arange(T)] = True  # each token sees itself
    keys, vals = np.concatenate([k, kn], 2), np.concatenate([v, vn], 2)  # [B, K, S + T, Dh]
    allowed = np.concatenate([m, mn], 2)  # [B, T, S + T]
    want = np.zeros((B, T, H, Dh))
    for b, t, h in np.ndindex(B, T, H):
        s = keys[b, h // (H // K)] @ q[b, t, h] / np.sqrt(Dh)
        p = np.where(allowed[b, t], np.exp(s - s[allowed[b, t]].max()), 0.0)
        want[b, t, h] = p @ vals[b, h // (H // K)] / p.sum()
    args = [jnp.asarray(a, jnp.float32) for a in (q, k, v)] + [jnp.asarray(m)] + [
        jnp.asarray(a, jnp.float32) for a in (kn, vn)] + [jnp.asarray(mn)]
    one_block = [args[0], jnp.asarray(keys, jnp.float32), jnp.asarray(vals, jnp.float32), jnp.asarray(allowed)]
    for ops in (XLA, XLA_TPU, XLA_CPU):
        np.testing.assert_allclose(np.asarray(ops.attend(*args)), want, atol=2e-5)
        np.testing.assert_allclose(np.asarray(ops.attend(*one_block)), want, atol=2e-5)
        looped = args[:3] + [ops.loop_masks((args[3],), H // K)[0]] + args[4:6] + [ops.loop_masks((args[6],), H // K)[0]]
        np.testing.assert_allclose(np.asarray(ops.attend(*looped)), want, atol=2e-5)
    with pytest.raises(ValueError, match="scores must be rows, heads or slots"):
        attend_xla(*args, scores="cols")


def test_cache_first_forward_equals_two_blocks():
    """A tree-shaped forward (offset scratch slots, a random ancestor mask, rows at different
    lengths, aux features): writing into the cache first and attending over it alone gives the
    features of the two-block form and the same cache."""
    t = init_target(tiny_config(num_hidden_layers=3), 2)
    rng = np.random.default_rng(3)
    B, S, T, off = 2, 40, 6, 3
    cache = init_cache(3, B, S, 2, 8, jnp.float32)
    pre = jnp.asarray(rng.integers(0, 64, size=(B, 9)), jnp.int32)
    _, cache = target_apply(t.module, t.params, pre, jnp.broadcast_to(jnp.arange(9), (B, 9)), cache,
                            causal_mask(B, 9), fresh=True)
    cache = advance(cache, jnp.asarray([9, 6], jnp.int32))  # row 1 keeps 6 of its 9 (stale slots after)
    _, cache = target_apply(t.module, t.params, pre[:, :off], cache.length[:, None] + jnp.arange(off)[None], cache,
                            causal_mask(B, off))  # scratch slots 0..off-1, written by an earlier call
    local = np.tril(np.ones((T + off, T + off), bool)) & (rng.random((B, T + off, T + off)) < 0.6)
    local[:, np.arange(T + off), np.arange(T + off)] = True
    local = jnp.asarray(local[:, off:])  # [B, T, U]: the new tokens see some earlier scratch, themselves
    ids = jnp.asarray(rng.integers(0, 64, size=(B, T)), jnp.int32)
    pos = cache.length[:, None] + off + jnp.asarray(rng.integers(0, 3, size=(B, T)), jnp.int32)
    outs = {}
    for form in ("cache_first", "two_blocks"):
        tf = _with_form(t, form)
        outs[form] = jax.jit(target_apply, static_argnums=(0, 6, 7, 8))(tf.module, tf.params, ids, pos, cache, local,
                                                                    off, False, (0, 2))
    (f1, c1, a1), (f2, c2, a2) = outs["cache_first"], outs["two_blocks"]
    np.testing.assert_allclose(np.asarray(f1), np.asarray(f2), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(a1), np.asarray(a2), atol=2e-5, rtol=0)
    for x, y in ((c1.k, c2.k), (c1.v, c2.v)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5, rtol=0)
    assert not np.array_equal(np.asarray(c1.k), np.asarray(cache.k))  # (the new entries were written)
    from eagle2_jax.models.target import writes_first
    assert writes_first(XLA, T, False, True) and not writes_first(XLA, T, False, False)  # (two forms compared)
