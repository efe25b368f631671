"""Qwen3 targets (per-head q/k RMSNorm, head_dim from the config, no attention bias): EAGLE-2 stays
greedy-identical and lossless in sampling, sharded equals unsharded, and an EAGLE-3 head in the
published layout with Qwen3's head_dim loads. Logit parity with transformers' Qwen3 is in
tests/test_model.py."""
import jax
import numpy as np
import pytest

import eagle2_jax as e2
from helpers import tiny_config

TREE = e2.TreeConfig(3, 3, 10)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3]]


def qwen3_config(**kw):
    base = dict(model_type="qwen3", qk_norm=True, num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    return tiny_config(**{**base, **kw})


def qwen3_target(seed=0, mesh=None, **kw):
    """A tiny Qwen3 with q/k norm scales away from 1 (so a missing norm would show)."""
    t = e2.init_target(qwen3_config(**kw), seed)
    rng = np.random.default_rng(seed)
    attn = dict(t.params["layers"]["attn"])
    for n in ("q_norm", "k_norm"):
        scale = attn[n]["scale"]
        attn[n] = {"scale": np.asarray(1 + 0.5 * rng.standard_normal(scale.shape), np.float32)}
    params = dict(t.params, layers=dict(t.params["layers"], attn=attn))
    if mesh is None:
        t.params = jax.tree_util.tree_map(jax.numpy.asarray, params)
        return t
    from eagle2_jax.sharding import shard_params
    ts = e2.init_target(qwen3_config(**kw), seed, mesh=mesh)
    ts.params = shard_params(jax.tree_util.tree_map(np.asarray, params), mesh)
    return ts


def test_config_reads_qwen3():
    c = e2.ModelConfig.from_hf_dict(dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=12, attention_bias=False))
    assert c.qk_norm and c.head_dim == 12 and not c.attention_bias
    assert c.to_hf_dict()["architectures"] == ["Qwen3ForCausalLM"]
    with pytest.raises(ValueError, match="sliding-window"):
        e2.ModelConfig.from_hf_dict(dict(model_type="qwen3", use_sliding_window=True, sliding_window=64))


def test_greedy_eagle_equals_plain_decoding():
    t = qwen3_target()
    d = e2.init_draft(t, 1)
    assert "q_norm" in t.params["layers"]["attn"] and "q_norm" not in d.params["layers_0"]["attn"]
    want = e2.generate_vanilla(t, PROMPTS, max_new_tokens=20).tokens
    got = e2.generate(t, d, PROMPTS, max_new_tokens=20, tree=TREE)
    assert got.tokens == want


@pytest.mark.optimized
def test_sampling_matches_target_distribution():
    from test_sampling_lossless import PROMPT, P_THRESHOLD, V, chi_square_p, exact_distribution
    t = qwen3_target(3, vocab_size=V, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=12)
    t.params = dict(t.params, lm_head=t.params["lm_head"] * 40.0)
    d = e2.init_draft(t, 4)
    d.params = jax.tree_util.tree_map(lambda x: x * 3.0, d.params)
    counts = np.zeros(V ** 3, np.int64)
    for seed in range(4):
        toks = np.array(e2.generate(t, d, [PROMPT] * 16384, max_new_tokens=3, temperature=1.0, top_p=0.8,
                                    seed=2000 + seed, tree=e2.TreeConfig(2, 3, 8)).tokens)
        np.add.at(counts, toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], 1)
    p, stat, k = chi_square_p(counts, exact_distribution(t, e2.SamplingConfig(1.0, 0, 0.8)))
    assert p > P_THRESHOLD, f"chi2={stat:.1f} on {k} dof, p={p:.2e}"


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
def test_sharded_equals_unsharded():
    kw = dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=64, intermediate_size=128, head_dim=12)
    t = qwen3_target(**kw)
    d = e2.init_draft(t, 1)
    want = e2.generate(t, d, PROMPTS, max_new_tokens=12, tree=TREE).tokens
    ts = qwen3_target(mesh=e2.make_mesh(2, 4), **kw)
    ds = e2.init_draft(ts, 1)
    assert e2.generate(ts, ds, PROMPTS, max_new_tokens=12, tree=TREE).tokens == want


def test_eagle3_head_in_the_published_layout_with_qwen3_head_dim(tmp_path):
    """An EAGLE-3 head made for a Qwen3 target: the official layout (fc, midlayer.*, d2t, t2d) with the
    target's head_dim (here 12, not hidden / heads = 8) in its config."""
    from test_eagle3 import write_head
    t = qwen3_target(num_hidden_layers=4)
    H, I, NH, NKV, HD, V, VD = 32, 64, 4, 2, 12, 64, 40
    rng = np.random.default_rng(0)
    w = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    ids = np.sort(rng.choice(V, VD, replace=False))
    sd = {"fc.weight": w(H, 3 * H), "midlayer.self_attn.q_proj.weight": w(NH * HD, 2 * H),
          "midlayer.self_attn.k_proj.weight": w(NKV * HD, 2 * H), "midlayer.self_attn.v_proj.weight": w(NKV * HD, 2 * H),
          "midlayer.self_attn.o_proj.weight": w(H, NH * HD), "midlayer.mlp.gate_proj.weight": w(I, H),
          "midlayer.mlp.up_proj.weight": w(I, H), "midlayer.mlp.down_proj.weight": w(H, I),
          "midlayer.input_layernorm.weight": 1 + w(H), "midlayer.hidden_norm.weight": 1 + w(H),
          "midlayer.post_attention_layernorm.weight": 1 + w(H), "norm.weight": 1 + w(H),
          "lm_head.weight": w(VD, H) * 5, "d2t": (ids - np.arange(VD)).astype(np.int64),
          "t2d": np.isin(np.arange(V), ids)}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H, "intermediate_size": I,
           "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD, "num_hidden_layers": 1,
           "vocab_size": V, "draft_vocab_size": VD, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
           "tie_word_embeddings": False, "model_type": "llama"}
    d = e2.load_draft(write_head(tmp_path / "h", sd, cfg), t)
    assert d.arch == "eagle3" and d.config.head_dim == HD
    q = np.asarray(d.params["layers_0"]["attn"]["q"]["kernel"])
    np.testing.assert_array_equal(q.reshape(2 * H, -1), sd["midlayer.self_attn.q_proj.weight"].T)
    want = e2.generate_vanilla(t, PROMPTS, max_new_tokens=16).tokens
    assert e2.generate(t, d, PROMPTS, max_new_tokens=16, tree=TREE).tokens == want
