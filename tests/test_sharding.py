"""Sharded (8 host CPU devices, several mesh layouts) equals unsharded, token for token."""
import jax
import pytest

from eagle2_jax import TreeConfig, generate, generate_vanilla, init_draft, init_target, make_mesh, parse_mesh
from eagle2_jax.sharding import param_shardings
from helpers import tiny_config

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
# (2, 4) shards data and model at once and runs by default; (1, 8) splits 4 KV heads over 8 devices,
# (4, 2) the batch 4 ways, and the two-device layouts run with -m slow.
LAYOUTS = [(2, 4)] + [pytest.param(*dm, marks=pytest.mark.slow) for dm in ((1, 8), (4, 2), (1, 2), (2, 1))]
CFG = tiny_config(num_attention_heads=8, num_key_value_heads=4, hidden_size=64, intermediate_size=128)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS host device count)")


@pytest.fixture(scope="module")
def reference():
    t = init_target(CFG, 0)
    d = init_draft(t, 1)
    van = generate_vanilla(t, PROMPTS, max_new_tokens=12).tokens
    eag = generate(t, d, PROMPTS, max_new_tokens=12, tree=TreeConfig(3, 3, 12)).tokens
    smp = generate(t, d, PROMPTS, max_new_tokens=12, temperature=1.0, seed=4, tree=TreeConfig(3, 3, 12)).tokens
    return van, eag, smp


@pytest.mark.parametrize("data,model", LAYOUTS)
def test_sharded_equals_unsharded(reference, data, model):
    mesh = make_mesh(data, model)
    t = init_target(CFG, 0, mesh=mesh)
    d = init_draft(t, 1)
    spec = param_shardings(t.params, mesh)["layers"]["mlp"]["gate"]["kernel"].spec  # [L, D, F]
    assert spec == jax.sharding.PartitionSpec(None, None, "model" if model > 1 else None)
    assert t.params["layers"]["mlp"]["gate"]["kernel"].sharding.mesh.shape == mesh.shape
    van, eag, smp = reference
    assert generate_vanilla(t, PROMPTS, max_new_tokens=12).tokens == van
    assert generate(t, d, PROMPTS, max_new_tokens=12, tree=TreeConfig(3, 3, 12)).tokens == eag
    assert generate(t, d, PROMPTS, max_new_tokens=12, temperature=1.0, seed=4, tree=TreeConfig(3, 3, 12)).tokens == smp


def test_parse_mesh():
    assert parse_mesh(None) is None
    assert dict(parse_mesh("data=2,model=4").shape) == {"data": 2, "model": 4}
    with pytest.raises(ValueError, match="bad --mesh"):
        parse_mesh("data=two")
    with pytest.raises(ValueError, match="at most once"):
        parse_mesh("data=2,data=4")
    with pytest.raises(ValueError, match="needs 16 devices"):
        parse_mesh("data=4,model=4")


@pytest.mark.parametrize("data,model", [(2, 4), pytest.param(1, 8, marks=pytest.mark.slow)])
def test_tpu_path_sharded_equals_unsharded(reference, data, model):
    """The TPU path (`ops.XLA_TPU`: scores laid out by query head, [B, K, G, T, slots], from a
    reshape of the head-sharded queries) gives the same tokens sharded as on one device, and as
    the default ops."""
    import dataclasses
    from eagle2_jax.models.ops import XLA_TPU

    def run(mesh):
        t = init_target(CFG, 0, mesh=mesh)
        t = dataclasses.replace(t, ops=XLA_TPU)
        d = dataclasses.replace(init_draft(t, 1), ops=XLA_TPU)
        return (generate_vanilla(t, PROMPTS, max_new_tokens=12).tokens,
                generate(t, d, PROMPTS, max_new_tokens=12, tree=TreeConfig(3, 3, 12)).tokens)
    assert run(make_mesh(data, model)) == run(None) == reference[:2]
