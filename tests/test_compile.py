"""Compile once per shape that matters: prompt length re-keys only the prefill, sampling values are
traced, layers are scanned (program size flat in depth), and programs compile from abstract params."""
import json

import numpy as np
import pytest

import eagle2_jax as e2
from eagle2_jax.decoding import eagle, vanilla
from helpers import permutation_oracle, tiny_config, tiny_pair


def test_decode_loop_compiles_once_per_cache_bucket_and_mode():
    # a vocabulary no other test uses, so these programs are compiled here for the first time
    target, draft = tiny_pair(3, vocab_size=72)
    tree = e2.TreeConfig(2, 3, 5)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 72, n).tolist() for n in (3, 10, 20, 40, 70)]  # prompt buckets 16..128
    loops, prefills = eagle.LOOP.num_compiled, eagle.PREFILL.num_compiled
    vloops = vanilla.LOOP.num_compiled
    for p in prompts:
        out = e2.generate(target, draft, [p], max_new_tokens=20, tree=tree)
        assert out.tokens == e2.generate_vanilla(target, [p], max_new_tokens=20).tokens
    assert eagle.LOOP.num_compiled - loops == 1, "greedy decode loop: one compile for five prompt lengths"
    assert vanilla.LOOP.num_compiled - vloops == 1
    assert eagle.PREFILL.num_compiled - prefills == 4  # prompt buckets 16, 32, 64, 128
    for temperature, top_p, top_k in ((0.5, 1.0, 0), (1.0, 0.9, 0), (1.3, 0.8, 5)):
        e2.generate(target, draft, [prompts[1]], max_new_tokens=12, tree=tree, temperature=temperature,
                    top_p=top_p, top_k=top_k, seed=1)
        e2.generate_vanilla(target, [prompts[1]], max_new_tokens=12, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=1)
    assert eagle.LOOP.num_compiled - loops == 2, "sampling: one more decode loop for all three settings"
    assert vanilla.LOOP.num_compiled - vloops == 2
    e2.generate(target, draft, [prompts[0]], max_new_tokens=7, tree=tree)  # another max_new, same bucket
    assert eagle.LOOP.num_compiled - loops == 2


def test_sampling_values_change_the_output_not_the_program():
    target, draft, _ = permutation_oracle(4)  # sharp logits: a small temperature is greedy
    tree = e2.TreeConfig(2, 3, 5)
    outs = {t: e2.generate_vanilla(target, [[1, 2, 3]], max_new_tokens=16, temperature=t, seed=5).tokens[0]
            for t in (0.05, 50.0)}
    greedy = e2.generate_vanilla(target, [[1, 2, 3]], max_new_tokens=16).tokens[0]
    assert outs[0.05] == greedy  # nearly greedy at a tiny temperature (traced, not baked in)
    assert outs[50.0] != greedy  # nearly uniform at a huge one
    e2.generate(target, draft, [[1, 2, 3]], max_new_tokens=8, tree=tree, temperature=0.7, seed=2)


def test_abstract_target_compiles_without_weights():
    cfg = tiny_config(vocab_size=80, num_hidden_layers=3)
    target = e2.init_target(cfg, dtype="bfloat16", abstract=True)
    assert target.abstract
    draft = e2.init_draft(target)
    tree = e2.TreeConfig(2, 3, 6)
    loops = eagle.LOOP.num_compiled
    assert e2.generate(target, draft, [[1, 2, 3]], max_new_tokens=8, tree=tree, compile_only=True) is None
    assert eagle.LOOP.num_compiled == loops + 1
    assert e2.generate_vanilla(target, [[1, 2, 3]], max_new_tokens=8, compile_only=True) is None
    with pytest.raises(ValueError, match="abstract"):
        e2.generate(target, draft, [[1, 2, 3]], max_new_tokens=8, tree=tree)
    with pytest.raises(ValueError, match="abstract"):
        e2.generate_vanilla(target, [[1, 2, 3]], max_new_tokens=8)
    big = e2.load_target("random:llama-3.1-8b", dtype="bfloat16", abstract=True)
    assert big.params["layers"]["mlp"]["gate"]["kernel"].shape == (32, 4096, 14336)


def test_compile_report_program_size_flat_in_depth(tmp_path):
    from infer import compile_report
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny_config(vocab_size=96).to_hf_dict()))
    out = tmp_path / "report.json"
    assert compile_report.main(["--model", f"random:{cfg}", "--dtype", "float32", "--layers", "2,7",
                                "--depth", "2", "--top-k", "3", "--total-tokens", "6", "--max-new-tokens", "16",
                                "--prompt-len", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    by = {(r["layers"], r["program"]): r for r in rows}
    assert {p for _, p in by} == {"prefill", "plain decode", "eagle2 prefill", "eagle2 decode"}
    for prog in ("prefill", "plain decode", "eagle2 decode"):
        one, six = by[(2, prog)], by[(7, prog)]  # a 1-layer scan is simplified away: compare 2
        assert six["hlo_ops"] <= 1.05 * one["hlo_ops"], (prog, one, six)
        assert six["lowered_ops"] <= 1.05 * one["lowered_ops"], (prog, one, six)
