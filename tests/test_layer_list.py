"""Per-layer weight buffers (GPU's layout, eagle2_jax.models.layer_list) give the same tokens as stacked weights."""
import dataclasses

import jax
import numpy as np
import pytest

import eagle2_jax as e2
from eagle2_jax.models import layer_list
from eagle2_jax.models.layer_list import LayerList, per_layer
from eagle2_jax.models.ops import XLA, XLA_CPU, Ops, xla_for
from helpers import tiny_config

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def _xla(m, ops):
    return dataclasses.replace(m, ops=ops)


@pytest.mark.parametrize("ops", [pytest.param(XLA_CPU, marks=pytest.mark.slow), XLA], ids=["xla-cpu", "xla"])
def test_per_layer_buffers_give_the_same_tokens(ops):
    t = _xla(e2.init_target(tiny_config(num_hidden_layers=3), 0), ops)
    d = _xla(e2.init_draft(t, 1), ops)
    tl = per_layer(t)
    q = tl.params["layers"]["attn"]["q"]["kernel"]
    assert isinstance(q, LayerList) and len(q) == 3 and q.shape == t.params["layers"]["attn"]["q"]["kernel"].shape
    np.testing.assert_array_equal(np.asarray(q[1]), np.asarray(t.params["layers"]["attn"]["q"]["kernel"][1]))
    assert per_layer(tl) is tl
    mlp, stacked = tl.params["layers"]["mlp"], t.params["layers"]["mlp"]
    assert set(mlp) == {"gate_up", "down"}  # gate and up as one [D, 2F] matmul per layer
    np.testing.assert_array_equal(np.asarray(mlp["gate_up"]["kernel"][2]), np.concatenate(
        [np.asarray(stacked["gate"]["kernel"][2]), np.asarray(stacked["up"]["kernel"][2])], axis=-1))
    plain = e2.generate_vanilla(t, PROMPTS, max_new_tokens=14).tokens
    assert e2.generate_vanilla(tl, PROMPTS, max_new_tokens=14).tokens == plain
    for tree in (e2.TreeConfig(3, 3, 10), e2.TreeConfig(5, 10, 60)):
        assert e2.generate(tl, d, PROMPTS, max_new_tokens=14, tree=tree).tokens == plain
    sampled = dict(max_new_tokens=14, temperature=1.0, seed=3, tree=e2.TreeConfig(3, 3, 10))
    assert e2.generate(tl, d, PROMPTS, **sampled).tokens == e2.generate(t, d, PROMPTS, **sampled).tokens


def test_draft_gate_up_fused_beside_a_per_layer_target(tmp_path):
    """Beside a per-layer target the draft's gate and up become one buffer too: same tokens and
    accept lengths, and the written head holds them apart as before."""
    t = _xla(e2.init_target(tiny_config(num_hidden_layers=2), 0), XLA)
    d = _xla(e2.init_draft(t, 1), XLA)
    assert layer_list.draft_like(d, t) is d  # stacked target: unchanged
    tl = per_layer(t)
    df = layer_list.draft_like(d, tl)
    mlp, apart = df.params["layers_0"]["mlp"], d.params["layers_0"]["mlp"]
    assert set(mlp) == {"gate_up", "down"}
    np.testing.assert_array_equal(np.asarray(mlp["gate_up"]["kernel"]), np.concatenate(
        [np.asarray(apart["gate"]["kernel"]), np.asarray(apart["up"]["kernel"])], axis=-1))
    tree = e2.TreeConfig(3, 3, 10)
    ref = e2.generate(t, d, PROMPTS, max_new_tokens=14, tree=tree)
    out = e2.generate(tl, df, PROMPTS, max_new_tokens=14, tree=tree)
    assert out.tokens == ref.tokens and out.accept_lengths == ref.accept_lengths
    e2.save_draft(df, str(tmp_path / "head"), dtype="float32")
    back = e2.load_draft(str(tmp_path / "head"), t)  # (a stacked target: loaded apart)
    for n in ("gate", "up", "down"):
        np.testing.assert_array_equal(np.asarray(back.params["layers_0"]["mlp"][n]["kernel"]),
                                      np.asarray(apart[n]["kernel"]))
    assert set(e2.load_draft(str(tmp_path / "head"), tl).params["layers_0"]["mlp"]) == {"gate_up", "down"}


def test_eagle3_aux_features_through_per_layer_buffers():
    """An EAGLE-3 head reads three layers' hidden states, picked inside the layer loop."""
    t = _xla(e2.init_target(tiny_config(num_hidden_layers=4), 2), XLA_CPU)
    d = _xla(e2.init_draft(t, 3, arch="eagle3", draft_vocab_size=40), XLA_CPU)
    tl = per_layer(t)
    tree = e2.TreeConfig(3, 3, 8)
    out = e2.generate(tl, layer_list.draft_like(d, tl), PROMPTS, max_new_tokens=16, tree=tree)
    assert out.tokens == e2.generate_vanilla(t, PROMPTS, max_new_tokens=16).tokens
    assert out.accept_lengths == e2.generate(t, d, PROMPTS, max_new_tokens=16, tree=tree).accept_lengths


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
def test_per_layer_buffers_keep_their_shards():
    mesh = e2.make_mesh(2, 4)
    cfg = tiny_config(num_attention_heads=8, num_key_value_heads=4, hidden_size=64, intermediate_size=128)
    t = e2.init_target(cfg, 0, mesh=mesh)
    d = e2.init_draft(t, 1)
    tl = per_layer(t)
    assert set(tl.params["layers"]["mlp"]) == {"gate", "up", "down"}  # split over "model": not concatenated
    assert layer_list.draft_like(d, tl) is d  # (nor the draft's)
    for a, b in (("mlp", "gate"), ("attn", "q"), ("attn", "o")):  # each buffer: the stack's shards, layer axis dropped
        stacked, one = t.params["layers"][a][b]["kernel"], tl.params["layers"][a][b]["kernel"][0]
        drop = lambda spec, n: tuple(spec) + (None,) * (n - len(spec))  # noqa: E731 (trailing Nones implied)
        assert drop(one.sharding.spec, one.ndim) == drop(stacked.sharding.spec, stacked.ndim)[1:]
        assert one.sharding.mesh.shape == mesh.shape
    tree = e2.TreeConfig(3, 3, 12)
    assert e2.generate(tl, d, PROMPTS, max_new_tokens=12, tree=tree).tokens == \
        e2.generate_vanilla(t, PROMPTS, max_new_tokens=12).tokens


def test_abstract_stacks_split_with_their_specs():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    spec = jax.sharding.PartitionSpec(None, None, "model")
    a = jax.ShapeDtypeStruct((4, 8, 16), np.float32, sharding=jax.sharding.NamedSharding(mesh, spec))
    ll = layer_list.unstack({"w": a})["w"]
    assert ll.shape == (4, 8, 16) and ll[2].shape == (8, 16)
    assert ll[2].sharding.spec == jax.sharding.PartitionSpec(None, "model")


def test_the_layer_layout_is_one_setting_of_the_ops():
    assert xla_for("gpu").layers == "list" and xla_for("cpu").layers == "scan" and xla_for("tpu").layers == "scan"
    with pytest.raises(ValueError, match="must be 'scan' or 'list'"):
        Ops(layers="unrolled")


def test_load_target_gives_per_layer_buffers_when_asked(monkeypatch, tmp_path):
    from eagle2_jax.loading.hf_files import save_hf_dir
    src = save_hf_dir(_xla(e2.init_target(tiny_config(), 0), XLA_CPU), str(tmp_path / "t"))
    monkeypatch.setenv("EAGLE2_JAX_CPU_KERNELS", "0")  # the plain XLA path (the CPU backend scans stacks itself)
    t = e2.load_target(src, layers="list")
    assert isinstance(t.params["layers"]["mlp"]["down"]["kernel"], LayerList) and t.ops.layers == "list"
    assert not isinstance(e2.load_target(src, layers="scan").params["layers"]["mlp"]["up"]["kernel"], LayerList)
    with pytest.raises(ValueError, match="'scan' or 'list'"):
        e2.load_target(src, layers="unrolled")


def test_the_cpu_backend_keeps_its_stacks(monkeypatch, tmp_path):
    t = e2.init_target(tiny_config(), 0)
    if type(t.ops).scan_layers is type(XLA).scan_layers:
        pytest.skip("no CPU backend here")
    with pytest.raises(ValueError, match="reads stacked layer weights itself"):
        per_layer(t)
    from eagle2_jax.loading.hf_files import save_hf_dir
    src = save_hf_dir(t, str(tmp_path / "t"))
    assert not isinstance(e2.load_target(src).params["layers"]["mlp"]["up"]["kernel"], LayerList)
    with pytest.raises(ValueError, match="reads stacked layer weights itself"):
        e2.load_target(src, layers="list")


def test_a_per_layer_target_saves_and_reloads(tmp_path):
    from eagle2_jax.loading.hf_files import save_hf_dir
    t = _xla(e2.init_target(tiny_config(), 0), XLA_CPU)
    src = save_hf_dir(per_layer(t), str(tmp_path / "t"))
    back = e2.load_target(src, tokenizer=False)
    for a, b in zip(jax.tree_util.tree_leaves(back.params), jax.tree_util.tree_leaves(t.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_release_frees_each_stack_once_split():
    """load_target's per_layer(release=True): the stacked weights are freed, the buffers are the same."""
    t = _xla(e2.init_target(tiny_config(num_hidden_layers=3), 0), XLA_CPU)
    kept = per_layer(t)  # from a copy of the stacks: the reference
    copy = dataclasses.replace(t, params=jax.tree_util.tree_map(lambda a: a.copy(), t.params))
    stacks = jax.tree_util.tree_leaves(copy.params["layers"])
    freed = per_layer(copy, release=True)
    assert all(a.is_deleted() for a in stacks) and not any(a.is_deleted() for a in jax.tree_util.tree_leaves(t.params))
    for a, b in zip(jax.tree_util.tree_leaves(freed.params), jax.tree_util.tree_leaves(kept.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert e2.generate_vanilla(freed, PROMPTS, max_new_tokens=8).tokens == \
        e2.generate_vanilla(t, PROMPTS, max_new_tokens=8).tokens
