"""EAGLE-3 heads: the published layout (key names and shapes of the official code, written here),
a NumPy reference of the head's forward against the drafted tree, losslessness, clear errors."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle2_jax as e2
from eagle2_jax.models.cache import init_cache
from eagle2_jax.loading.convert import CheckpointError
from eagle2_jax.decoding.eagle import draft_catch_up
from eagle2_jax.models.target import target_apply
from eagle2_jax.models.layers import causal_mask
from eagle2_jax.models.layer_list import per_layer
from eagle2_jax.models.ops import XLA
from eagle2_jax.decoding.spec import RoundSpec, params_of
from eagle2_jax.decoding.tree import expand

H, I, NH, NKV, V, VD = 32, 64, 4, 2, 64, 40
HD = H // NH


def _target(layers=4, seed=0):
    cfg = e2.ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=layers,
                         num_attention_heads=NH, num_key_value_heads=NKV, rms_norm_eps=1e-5,
                         max_position_embeddings=512)
    return e2.init_target(cfg, seed)


def published_head(rng, vd=VD):
    """State dict of an EAGLE-3 head in the official layout (torch [out, in] matrices)."""
    w = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    ids = np.sort(rng.choice(V, vd, replace=False))
    sd = {
        "fc.weight": w(H, 3 * H),
        "midlayer.self_attn.q_proj.weight": w(NH * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(NKV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(NKV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, NH * HD),
        "midlayer.mlp.gate_proj.weight": w(I, H),
        "midlayer.mlp.up_proj.weight": w(I, H),
        "midlayer.mlp.down_proj.weight": w(H, I),
        "midlayer.input_layernorm.weight": 1 + w(H),
        "midlayer.hidden_norm.weight": 1 + w(H),
        "midlayer.post_attention_layernorm.weight": 1 + w(H),
        "norm.weight": 1 + w(H),
        "lm_head.weight": w(vd, H) * 5,
        "d2t": (ids - np.arange(vd)).astype(np.int64),
        "t2d": np.isin(np.arange(V), ids),
    }
    return sd


def published_config(vd=VD, **over):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H, "intermediate_size": I,
           "num_attention_heads": NH, "num_key_value_heads": NKV, "num_hidden_layers": 1, "vocab_size": V,
           "draft_vocab_size": vd, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048,
           "tie_word_embeddings": False, "model_type": "llama", "hidden_act": "silu"}
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def write_head(d, sd, cfg):
    from safetensors.numpy import save_file
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


# ---- a NumPy reference of the head ---------------------------------------------------------------

def _rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x_TND, pos_T, theta=10000.0):
    d = x_TND.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos_T[:, None] * inv[None]  # [T, d/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x_TND[..., :d // 2], x_TND[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def ref_layer(sd, emb_TD, h_TD, pos_T, kv_cache, see_TS):
    """One midlayer step for T new tokens attending to cached keys (kv_cache: lists of [NKV, HD] per
    slot) and themselves (see_TS[t, s]: token t sees slot s; slots: cache, then the new tokens)."""
    x = np.concatenate([_rms(emb_TD, sd["midlayer.input_layernorm.weight"]),
                        _rms(h_TD, sd["midlayer.hidden_norm.weight"])], axis=-1)
    T = x.shape[0]
    q = _rope((x @ sd["midlayer.self_attn.q_proj.weight"].T).reshape(T, NH, HD), pos_T)
    k = _rope((x @ sd["midlayer.self_attn.k_proj.weight"].T).reshape(T, NKV, HD), pos_T)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).reshape(T, NKV, HD)
    K = np.concatenate([np.array(kv_cache[0]).reshape(-1, NKV, HD), k]) if kv_cache[0] else k
    Vv = np.concatenate([np.array(kv_cache[1]).reshape(-1, NKV, HD), v]) if kv_cache[1] else v
    out = np.zeros((T, NH, HD))
    for t in range(T):
        for hh in range(NH):
            g = hh // (NH // NKV)
            s = K[:, g] @ q[t, hh] / np.sqrt(HD)
            s = np.where(see_TS[t], s, -np.inf)
            p = np.exp(s - s.max())
            out[t, hh] = (p / p.sum()) @ Vv[:, g]
    h = h_TD + out.reshape(T, NH * HD) @ sd["midlayer.self_attn.o_proj.weight"].T
    m = _rms(h, sd["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ sd["midlayer.mlp.gate_proj.weight"].T, m @ sd["midlayer.mlp.up_proj.weight"].T
    h = h + (gate / (1 + np.exp(-gate)) * up) @ sd["midlayer.mlp.down_proj.weight"].T
    return h, k, v


def ref_topk(sd, h_D, k):
    logits = _rms(h_D, sd["norm.weight"]) @ sd["lm_head.weight"].T
    logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    idx = np.argsort(-logp, kind="stable")[:k]
    return logp[idx], idx + sd["d2t"][idx]


def test_published_layout_loads_every_tensor(tmp_path):
    target = _target()
    sd = published_head(np.random.default_rng(0))
    d = e2.load_draft(write_head(tmp_path / "h", sd, published_config()), target)
    assert d.arch == "eagle3" and d.draft_vocab_size == VD and d.aux_layers == (2, 2, 1)
    p = jax.tree_util.tree_map(np.asarray, d.params)
    L = p["layers_0"]
    np.testing.assert_array_equal(p["fc"]["kernel"], sd["fc.weight"].T)
    np.testing.assert_array_equal(L["attn"]["q"]["kernel"].reshape(2 * H, -1), sd["midlayer.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(L["attn"]["k"]["kernel"].reshape(2 * H, -1), sd["midlayer.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(L["attn"]["v"]["kernel"].reshape(2 * H, -1), sd["midlayer.self_attn.v_proj.weight"].T)
    np.testing.assert_array_equal(L["attn"]["o"]["kernel"].reshape(-1, H), sd["midlayer.self_attn.o_proj.weight"].T)
    for n in ("gate", "up", "down"):
        np.testing.assert_array_equal(L["mlp"][n]["kernel"], sd[f"midlayer.mlp.{n}_proj.weight"].T)
    for ours, theirs in (("input_norm", "input_layernorm"), ("hidden_norm", "hidden_norm"),
                         ("post_norm", "post_attention_layernorm")):
        np.testing.assert_array_equal(L[ours]["scale"], sd[f"midlayer.{theirs}.weight"])
    np.testing.assert_array_equal(p["norm"]["scale"], sd["norm.weight"])
    np.testing.assert_array_equal(p["lm_head"], sd["lm_head.weight"].T)
    np.testing.assert_array_equal(p["d2t"], sd["d2t"])


@pytest.mark.parametrize("accel", [False, True], ids=["cpu_ops", "xla_ops"])
def test_drafted_tree_matches_numpy_reference(tmp_path, accel):
    target = _target(seed=1)
    sd = published_head(np.random.default_rng(1))
    draft = e2.load_draft(write_head(tmp_path / "h", sd, published_config()), target)
    if accel:
        target, draft = per_layer(dataclasses.replace(target, ops=XLA)), dataclasses.replace(draft, ops=XLA)
    tm, tp, dm, dp = target.module, target.params, draft.module, draft.params
    prompt = [5, 9, 2, 33, 17, 8]
    P, K = len(prompt), 4
    ids = jnp.asarray([prompt])
    cache = init_cache(4, 1, 16, NKV, HD, jnp.float32)
    _, _, aux = target_apply(tm, tp, ids, jnp.arange(P)[None], cache, causal_mask(1, P), aux_layers=draft.aux_layers)
    root = 21
    dtok = prompt[1:] + [root]  # pairs (feature j, token j+1), the root last
    dcache = init_cache(1, 1, 64, NKV, HD, jnp.float32)
    spec = RoundSpec.of(target, draft, e2.TreeConfig(depth=1, top_k=K, total_tokens=K + K * K + 1))
    params = params_of(target, draft)
    hidden, dcache = draft_catch_up(spec, params, dcache, jnp.asarray([dtok]), aux, jnp.asarray([P]))
    pool, _ = expand(spec, params, dcache, hidden)
    # reference: catch-up
    emb = np.asarray(tp["embed"])
    f = np.asarray(aux[0]) @ sd["fc.weight"].T
    h, k, v = ref_layer(sd, emb[dtok], f, np.arange(P, dtype=np.float64), ([], []), np.tril(np.ones((P, P), bool)))
    np.testing.assert_allclose(np.asarray(hidden[0]), h[-1], rtol=1e-4, atol=1e-4)
    cache_kv = (list(k), list(v))
    s0, t0 = ref_topk(sd, h[-1], K)
    np.testing.assert_array_equal(np.asarray(pool.tokens_BQ[0, :K]), t0)
    np.testing.assert_allclose(np.asarray(pool.scores_BQ[0, :K]), s0, rtol=1e-4, atol=1e-4)
    # one draft pass: the K children at position P, each seeing the committed prefix and itself
    see = np.concatenate([np.ones((K, P), bool), np.eye(K, dtype=bool)], axis=1)
    hk, _, _ = ref_layer(sd, emb[t0], np.repeat(h[-1:], K, 0), np.full(K, P, np.float64), cache_kv, see)
    for j in range(K):
        s1, t1 = ref_topk(sd, hk[j], K)
        np.testing.assert_array_equal(np.asarray(pool.tokens_BQ[0, K + j * K:K + (j + 1) * K]), t1)
        np.testing.assert_allclose(np.asarray(pool.scores_BQ[0, K + j * K:K + (j + 1) * K]), s0[j] + s1,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tree,accel", [
    pytest.param(e2.TreeConfig(*c), accel, marks=pytest.mark.slow if (c, accel) == ((1, 1, 2), False) else (),
                 id="d%d_k%d_n%d-%s" % (*c, "xla_ops" if accel else "cpu_ops"))
    for c in ((1, 1, 2), (3, 3, 8), (4, 4, 20)) for accel in (False, True)])
def test_eagle3_head_is_lossless_greedy(tree, accel):
    target = _target(seed=2)
    draft = e2.init_draft(target, 3, arch="eagle3", draft_vocab_size=VD)
    if accel:  # the GPU path: tree forwards write the cache first, then attend over it alone
        target, draft = per_layer(dataclasses.replace(target, ops=XLA)), dataclasses.replace(draft, ops=XLA)
    prompts = [[1, 2, 3], [4, 5], [7, 8, 9, 10, 11]]
    out = e2.generate(target, draft, prompts, max_new_tokens=24, tree=tree)
    assert out.tokens == e2.generate_vanilla(target, prompts, max_new_tokens=24).tokens


@pytest.mark.parametrize("accel", [False, True], ids=["cpu_ops", "xla_ops"])
def test_aux_layer_after_the_last_is_the_stream_before_the_final_norm(accel):
    """Aux index L (= the number of layers) reads the stream leaving the last layer: the final
    norm of it gives the target's features; a head reading it stays lossless."""
    target = _target(seed=4)
    draft = e2.init_draft(target, 5, arch="eagle3", draft_vocab_size=VD, aux_layers=(1, 2, 4))
    if accel:
        target, draft = per_layer(dataclasses.replace(target, ops=XLA)), dataclasses.replace(draft, ops=XLA)
    ids = jnp.asarray([[3, 1, 4, 1, 5, 9]])
    cache = init_cache(4, 1, 16, NKV, HD, jnp.float32)
    feats, _, aux = target_apply(target.module, target.params, ids, jnp.arange(6)[None], cache, causal_mask(1, 6),
                                 aux_layers=draft.aux_layers)
    x = np.asarray(aux[0, :, 2 * H:], np.float64)  # the third slot: index 4 of a 4-layer target
    w = np.asarray(target.params["norm"]["scale"], np.float64)
    normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(normed, np.asarray(feats[0]), rtol=1e-4, atol=1e-5)
    assert not np.allclose(np.asarray(aux[0, :, H:2 * H]), x, atol=1e-3)  # layer 2's input is another stream
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    out = e2.generate(target, draft, prompts, max_new_tokens=16, tree=e2.TreeConfig(3, 3, 8))
    assert out.tokens == e2.generate_vanilla(target, prompts, max_new_tokens=16).tokens
    with pytest.raises(ValueError, match=r"in \[0, 4\], got \(1, 2, 5\)"):
        e2.init_draft(target, 5, arch="eagle3", draft_vocab_size=VD, aux_layers=(1, 2, 5))


def test_save_eagle3_round_trip_gives_identical_trees(tmp_path):
    target = _target(seed=4)
    sd = published_head(np.random.default_rng(4))
    src = e2.load_draft(write_head(tmp_path / "pub", sd, published_config()), target)
    ours = e2.load_draft(e2.save_draft(src, str(tmp_path / "ours"), format="eagle3", dtype="float32"), target)
    orbax = e2.load_draft(e2.save_draft(src, str(tmp_path / "orbax"), format="orbax"), target)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    tree = e2.TreeConfig(3, 3, 10)
    want = e2.generate(target, src, prompts, max_new_tokens=20, tree=tree)
    for d in (ours, orbax):
        assert d.arch == "eagle3" and d.aux_layers == src.aux_layers
        got = e2.generate(target, d, prompts, max_new_tokens=20, tree=tree)
        assert got.tokens == want.tokens and got.accept_lengths == want.accept_lengths


def test_wrong_files_fail_with_one_line_errors(tmp_path):
    target = _target()
    rng = np.random.default_rng(5)
    sd = published_head(rng)
    eagle2_cfg = {k: v for k, v in published_config().items() if k not in ("draft_vocab_size", "architectures")}
    with pytest.raises(CheckpointError, match="EAGLE-3 weights .*no draft_vocab_size") as e:
        e2.load_draft(write_head(tmp_path / "a", sd, eagle2_cfg), target)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="hidden size 48 does not match") as e:
        e2.load_draft(write_head(tmp_path / "b", sd, published_config(hidden_size=48)), target)
    assert "\n" not in str(e.value)
    no_d2t = {k: v for k, v in sd.items() if k != "d2t"}
    with pytest.raises(CheckpointError, match="needs the d2t map") as e:
        e2.load_draft(write_head(tmp_path / "c", no_d2t, published_config()), target)
    assert "\n" not in str(e.value)
    full = published_head(rng, vd=V)  # a full draft vocabulary needs no map (the official code drops it)
    full.pop("d2t")
    assert e2.load_draft(write_head(tmp_path / "d", full, published_config(vd=V)), target).draft_vocab_size == V
    with pytest.raises(CheckpointError, match="missing tensor"):
        e2.load_draft(write_head(tmp_path / "e", {k: v for k, v in sd.items() if k != "norm.weight"},
                                 published_config()), target)
    small = e2.load_draft(write_head(tmp_path / "f", published_head(rng, vd=4), published_config(vd=4)), target)
    with pytest.raises(ValueError, match="top_k 5 exceeds the draft head's vocabulary \\(4\\)") as e:
        e2.generate(target, small, [[1, 2, 3]], max_new_tokens=4, tree=e2.TreeConfig(depth=2, top_k=5, total_tokens=8))
    assert "\n" not in str(e.value)


def test_eagle2_export_holds_the_embedding_for_the_strict_loader(tmp_path):
    from safetensors.numpy import load_file
    target = _target()
    d = e2.init_draft(target, 1)
    e2.save_draft(d, str(tmp_path / "x"), target=target, dtype="float32")
    sd = load_file(str(tmp_path / "x" / "model.safetensors"))
    np.testing.assert_array_equal(sd["embed_tokens.weight"], np.asarray(target.params["embed"]))
    again = e2.load_draft(str(tmp_path / "x"), target)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree_util.tree_leaves(again.params), jax.tree_util.tree_leaves(d.params)))


@pytest.mark.optimized  # ~100k samples: running, not compiling (tests/conftest.py)
def test_eagle3_sampling_matches_target_distribution():
    """The chi-square check of tests/test_sampling_lossless.py with an EAGLE-3 head drafting."""
    from eagle2_jax.config import SamplingConfig
    from test_sampling_lossless import P_THRESHOLD, TREES, V as SV, chi_square_p, exact_distribution, sample_counts
    from helpers import tiny_pair
    t, _ = tiny_pair(3, vocab_size=SV, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=32)
    t.params = dict(t.params, lm_head=t.params["lm_head"] * 40.0)  # peaked, context-dependent
    d = e2.init_draft(t, 7, arch="eagle3", draft_vocab_size=6)
    d.params = jax.tree_util.tree_map(lambda x: x * 3 if x.dtype == jnp.float32 else x, d.params)
    expected = exact_distribution(t, SamplingConfig(1.0, 0, 1.0))
    counts = sample_counts(t, d, TREES["tree"], 1.0, 1.0)
    p, stat, k = chi_square_p(counts, expected)
    assert p > P_THRESHOLD, f"chi2={stat:.1f} on {k} dof, p={p:.2e}"
