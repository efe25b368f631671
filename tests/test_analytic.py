"""The analytic round-cost report: pre-optimisation bytes / FLOPs / kernels with abstract params."""
import json

import pytest

from helpers import tiny_config


@pytest.fixture(scope="module")
def shape(tmp_path_factory):
    d = tmp_path_factory.mktemp("shape")

    def write(layers):
        p = d / f"config{layers}.json"
        p.write_text(json.dumps(tiny_config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=layers).to_hf_dict()))
        return f"random:{p}"
    return write


def test_analytic_report_counts_every_layer_and_writes_json(shape, tmp_path):
    from infer import roundcost
    out = tmp_path / "r.json"
    roundcost.main(["--analytic", "--model", shape(2), "--dtype", "float32", "--batch", "1", "--depth", "2",
                    "--top-k", "3", "--total-tokens", "6", "--prompt-len", "8", "--max-new-tokens", "16",
                    "--draft-vocab", "128", "--tau", "2.5", "--json", str(out)])
    r = json.loads(out.read_text())
    assert set(r) >= {"step", "round", "roofline"}
    assert set(r["step"]) == {"bytes", "flops", "kernels", "bytes_by_kind"}
    for c in (r["step"], r["round"], *r["round"]["parts"].values()):  # the breakdown accounts for the bytes
        assert abs(sum(c["bytes_by_kind"].values()) - c["bytes"]) <= 0.05 * c["bytes"], c
    assert r["ratios"]["matmul_bytes"] < r["ratios"]["bytes"]
    assert set(r["round"]["parts"]) == {"draft", "verify", "accept"}
    assert r["roofline"]["accelerator"] == "h200" and r["roofline"]["tau"] == 2.5
    assert r["round"]["bytes"] > r["step"]["bytes"] > 0 and r["round"]["kernels"] > r["step"]["kernels"] > 0
    # the verify pass reads the target's weights once, as a step does (plus the tree's activations)
    assert r["round"]["parts"]["verify"]["bytes"] >= r["step"]["bytes"]
    assert r["round"]["parts"]["verify"]["flops"] > 3 * r["step"]["flops"]  # 6 tree rows against 1
    want = r["roofline"]["tau"] * r["roofline"]["step_ms"] / r["roofline"]["round_ms"]
    assert abs(r["roofline"]["speedup"] - want) < 1e-9


def test_analytic_bytes_grow_with_layers(shape):
    """A while loop's body is counted once by XLA: the analysis unrolls the layers, so every layer
    adds the same bytes (at least its weights: they are counted once, not sliced out of a stack)."""
    from infer.analytic import analyze
    b = {L: analyze(shape(L), "float32", 1, 8, 16, 2, 3, 6, 0, 2.0, "h200", kernels=False)["step"]["bytes"]
         for L in (2, 4, 6)}
    c = tiny_config(vocab_size=512, hidden_size=64, intermediate_size=128)
    layer_weights = 4 * (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                         + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    assert b[6] - b[4] == b[4] - b[2] >= 2 * layer_weights, b


def test_breakdown_counts_operands_and_results_by_kind():
    import jax
    import jax.numpy as jnp
    from infer.analytic import breakdown

    def f(x, w, table, ids):
        y = jnp.maximum(x @ w, 0.0)  # matmul, then elementwise
        return y.sum(axis=1), jnp.take(table, ids, axis=0)  # reduce; a gather reads its rows only
    args = (jnp.zeros((8, 32)), jnp.zeros((32, 16)), jnp.zeros((1000, 16)), jnp.zeros((3,), jnp.int32))
    lo = jax.jit(f).lower(*args)
    k = breakdown(lo.as_text(dialect="hlo"))
    assert k["matmul"] == 4 * (8 * 32 + 32 * 16 + 8 * 16)
    assert k["reduce"] >= 4 * (8 * 16 + 8) and k["elementwise"] >= 4 * 3 * 8 * 16
    assert k["data movement"] < 4 * 1000 * 16  # not the whole table
    assert abs(sum(k.values()) - lo.cost_analysis()["bytes accessed"]) <= 0.1 * sum(k.values())
