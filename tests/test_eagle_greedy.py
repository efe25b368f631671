"""EAGLE-2 at temperature 0 is token-identical to plain greedy decoding; oracle drafts reach tau = depth + 2."""
import dataclasses

import pytest

from eagle2_jax import TreeConfig, generate, generate_vanilla
from eagle2_jax.decoding.eagle import LOOP
from eagle2_jax.models.layer_list import per_layer
from eagle2_jax.models.ops import XLA, XLA_TPU
from helpers import permutation_oracle, tiny_pair

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]

# (depth, top_k, total_tokens): extremes of each axis, chains, N = 1 and N = pool maximum
GRID = [(1, 1, 1), (1, 1, 2), (1, 2, 7), (2, 3, 8), (3, 1, 4), (5, 10, 60), (6, 2, 11), (4, 8, 20),
        (2, 8, 137), (6, 3, 30), (5, 4, 85)]
SLOW_GRID = [(d, k, n) for d in range(1, 7) for k in (1, 3, 8)  # N = 1, 5 (when the pool allows it), the pool maximum
             for n in sorted({1, min(5, 1 + k + d * k * k), 1 + k + d * k * k})]


@pytest.fixture(scope="module")
def models():
    rand = tiny_pair(0)
    t, d, _ = permutation_oracle(0, layer_scale=2.0)  # a good but imperfect draft: varied accept lengths
    # the GPU path: `ops.XLA` over per-layer weight buffers, where tree forwards write each layer's
    # keys/values into the cache and then attend over the cache alone (`Ops.cache_first`); the
    # CPU's own ops attend over two blocks
    accel = (per_layer(dataclasses.replace(t, ops=XLA)), dataclasses.replace(d, ops=XLA))
    # the TPU path: `ops.XLA_TPU`, a scan over stacked layers, scores laid out by query head
    tpu = (dataclasses.replace(t, ops=XLA_TPU), dataclasses.replace(d, ops=XLA_TPU))
    return {"random": rand, "noisy_oracle": (t, d), "noisy_oracle_xla": accel, "noisy_oracle_tpu": tpu}


@pytest.fixture(scope="module")
def reference(models):
    return {k: generate_vanilla(t, PROMPTS, max_new_tokens=23).tokens for k, (t, _) in models.items()}


def test_accelerator_paths_decode_as_the_cpu_path(reference):
    """The GPU path (query-row scores, per-layer buffers) and the TPU path (query-head scores, a
    scan over stacked layers) decode the same greedy tokens as the CPU's own ops."""
    assert reference["noisy_oracle_xla"] == reference["noisy_oracle"]
    assert reference["noisy_oracle_tpu"] == reference["noisy_oracle"]


def _check(models, reference, kind, cfg, max_new=23, prompts=PROMPTS):
    t, d = models[kind]
    out = generate(t, d, prompts, max_new_tokens=max_new, tree=TreeConfig(*cfg))
    assert out.tokens == [r[:max_new] for r in reference[kind]], (kind, cfg)
    for toks, acc in zip(out.tokens, out.accept_lengths):
        assert sum(acc) + 1 >= len(toks)  # first token from prefill, then rounds
        assert all(1 <= a <= cfg[0] + 2 for a in acc)
    return out


# Acceptance and the tree on their own are checked against a NumPy reference over random pools and
# trees (tests/test_round_reference.py); this grid checks what only a whole generation shows: cache
# compaction, catch-up, positions, masks and padded rows in a batch. By default the noisy oracle
# (varied accept lengths) runs the whole grid on the CPU's ops; the random draft (mostly rejected) and
# the GPU and TPU paths (same algorithm, other layouts) a spread of it: a chain, one-token and
# full-pool trees, the reference tree, the widest. The rest runs with -m slow.
ACCEL_DEFAULT = {(1, 1, 1), (1, 1, 2), (2, 3, 8), (5, 10, 60), (2, 8, 137), (6, 3, 30)}
RANDOM_DEFAULT = {(1, 1, 1), (5, 10, 60), (2, 8, 137)}
GRID_CASES = [pytest.param(kind, cfg, marks=() if kind == "noisy_oracle" or cfg in ACCEL_DEFAULT
                           and (kind != "random" or cfg in RANDOM_DEFAULT) else pytest.mark.slow,
                           id="%s-d%d_k%d_n%d" % (kind, *cfg))
              for kind in ("random", "noisy_oracle", "noisy_oracle_xla", "noisy_oracle_tpu") for cfg in GRID]


@pytest.mark.parametrize("kind,cfg", GRID_CASES)
def test_greedy_identity_grid(models, reference, kind, cfg):
    _check(models, reference, kind, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", SLOW_GRID, ids=lambda c: "d%d_k%d_n%d" % c)
def test_greedy_identity_full_grid(models, reference, cfg):
    _check(models, reference, "noisy_oracle", cfg)


def test_noisy_oracle_accepts_varied_lengths(models):
    t, d = models["noisy_oracle"]
    out = generate(t, d, PROMPTS, max_new_tokens=40, tree=TreeConfig(4, 3, 20))
    lens = {a for row in out.accept_lengths for a in row}
    assert len(lens) >= 3 and max(lens) >= 4  # the identity grid exercises many accept lengths


@pytest.mark.parametrize("max_new", [1, 2, 7, 13])
def test_max_new_tokens(models, reference, max_new):
    _check(models, reference, "noisy_oracle", (3, 2, 9), max_new=max_new)


def test_batch_equals_each_alone(models, reference):
    t, d = models["noisy_oracle"]
    for i, p in enumerate(PROMPTS):
        out = generate(t, d, [p], max_new_tokens=23, tree=TreeConfig(3, 2, 9))
        assert out.tokens[0] == reference["noisy_oracle"][i]


def test_eos_mid_round(models, reference):
    t, d = models["noisy_oracle"]
    ref = reference["noisy_oracle"]
    for row in range(3):  # an EOS that the draft gets right lands inside an accepted run
        eos = ref[row][5]
        out = generate(t, d, PROMPTS, max_new_tokens=23, eos_token_id=eos, tree=TreeConfig(4, 2, 12))
        for r, o in zip(ref, out.tokens):
            assert o == (r[:r.index(eos) + 1] if eos in r else r)


def test_prompt_near_end_of_cache():
    t, d, _ = permutation_oracle(1, layer_scale=2.0)
    limit = t.config.max_position_embeddings  # 512
    prompt = [(i * 7) % 64 for i in range(limit - 20)]
    ref = generate_vanilla(t, [prompt], max_new_tokens=20).tokens
    out = generate(t, d, [prompt], max_new_tokens=20, tree=TreeConfig(5, 3, 16))
    assert out.tokens == ref


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_oracle_full_acceptance(depth):
    t, d, perm = permutation_oracle(0)
    out = generate(t, d, PROMPTS, max_new_tokens=4 * (depth + 2) + 1, tree=TreeConfig(depth, 2, 2 * depth + 3))
    for p, toks, acc in zip(PROMPTS, out.tokens, out.accept_lengths):
        assert acc == [depth + 2] * 4  # depth+1 draft tokens + bonus every round
        expect, x = [], p[-1]
        for _ in range(len(toks)):
            x = int(perm[x])
            expect.append(x)
        assert toks == expect
    assert out.tau == depth + 2


def test_one_compile_per_bucket(models):
    t, d = models["random"]
    cfg = TreeConfig(2, 2, 5)
    generate(t, d, [[1, 2, 3]], max_new_tokens=5, tree=cfg)
    n = LOOP.num_compiled
    generate(t, d, [[4, 5, 6, 7, 8, 9, 10]], max_new_tokens=5, tree=cfg)  # same prompt bucket
    generate(t, d, [[4, 5]], max_new_tokens=11, temperature=0.0, seed=9, tree=cfg)  # same max_new bucket
    assert LOOP.num_compiled == n
    generate(t, d, [[4, 5]] * 2, max_new_tokens=5, tree=cfg)  # new batch bucket
    assert LOOP.num_compiled == n + 1


def test_compile_only_compiles_what_the_run_uses(models, reference):
    t, d = models["noisy_oracle"]
    cfg = TreeConfig(2, 3, 7)
    tm = {}
    assert generate(t, d, PROMPTS, max_new_tokens=23, tree=cfg, timings=tm, compile_only=True) is None
    assert tm["compile_s"] > 0 and "run_s" not in tm
    n = LOOP.num_compiled
    tm = {}
    out = generate(t, d, PROMPTS, max_new_tokens=23, tree=cfg, timings=tm)
    assert LOOP.num_compiled == n and "compile_s" not in tm  # nothing left to compile
    assert out.tokens == reference["noisy_oracle"]
    with pytest.raises(ValueError, match="stream"):
        generate(t, d, PROMPTS, max_new_tokens=23, tree=cfg, stream=lambda r, x: None, compile_only=True)


def test_bad_tree_configs():
    with pytest.raises(ValueError, match="exceeds the candidate pool"):
        TreeConfig(depth=1, top_k=2, total_tokens=8)
    for bad in (dict(depth=0), dict(top_k=-1), dict(total_tokens=0), dict(depth=1.5)):
        with pytest.raises(ValueError, match="positive integer"):
            TreeConfig(**bad)


def test_mismatched_draft_refused():
    from eagle2_jax import init_draft
    t, _ = tiny_pair(0)
    t2, _ = tiny_pair(0, vocab_size=80)
    d2 = init_draft(t2, 0)
    with pytest.raises(ValueError, match="vocabulary 80 does not match the target's 64"):
        generate(t, d2, [[1]], max_new_tokens=3)
    t3, _ = tiny_pair(0, hidden_size=48, num_attention_heads=4)
    with pytest.raises(ValueError, match="hidden size 48 does not match"):
        generate(t, init_draft(t3, 0), [[1]], max_new_tokens=3)


def test_stream_matches_loop_and_timings(models, reference):
    t, d = models["noisy_oracle"]
    seen, timings = {}, {}
    out = generate(t, d, PROMPTS, max_new_tokens=23, tree=TreeConfig(3, 2, 9), timings=timings,
                   stream=lambda r, toks: seen.setdefault(r, []).extend(toks))
    assert [seen[i] for i in range(3)] == out.tokens == reference["noisy_oracle"]
    assert timings["run_s"] > 0 and "compile_s" in timings


@pytest.mark.parametrize("cfg", [(3, 2, 9), (5, 4, 30), (1, 1, 2)], ids=lambda c: "d%d_k%d_n%d" % c)
def test_draft_vocab_subset_is_lossless(models, reference, cfg, tmp_path):
    from eagle2_jax import load_draft, save_draft
    from eagle2_jax.models.draft import with_draft_vocab
    t, d = models["noisy_oracle"]
    sub = with_draft_vocab(d, t, list(range(0, 64, 2)) + [reference["noisy_oracle"][0][0]])
    out = generate(t, sub, PROMPTS, max_new_tokens=23, tree=TreeConfig(*cfg))
    assert out.tokens == reference["noisy_oracle"]
    save_draft(sub, str(tmp_path / "h"), format="eagle", dtype="float32")
    again = load_draft(str(tmp_path / "h"), t)
    assert again.params["vocab_head"]["ids"].shape == sub.params["vocab_head"]["ids"].shape
    assert generate(t, again, PROMPTS, max_new_tokens=23, tree=TreeConfig(*cfg)).tokens == out.tokens


@pytest.mark.parametrize("cfg", [(3, 2, 9), (5, 4, 30)], ids=lambda c: "d%d_k%d_n%d" % c)
def test_bfloat16_draft_with_float32_target_is_lossless(models, reference, cfg, tmp_path):
    """The CLIs run the draft in bfloat16 by default: proposals change, outputs must not."""
    import jax.numpy as jnp
    from eagle2_jax import load_draft, save_draft
    from eagle2_jax.models.draft import with_draft_vocab
    t, d = models["noisy_oracle"]
    save_draft(with_draft_vocab(d, t, list(range(0, 64, 2)) + [reference["noisy_oracle"][0][0]]),
               str(tmp_path / "h"), format="eagle", dtype="float32")
    bf = load_draft(str(tmp_path / "h"), t, dtype="bfloat16")
    assert bf.params["vocab_head"]["w"].dtype == jnp.bfloat16
    out = generate(t, bf, PROMPTS, max_new_tokens=23, tree=TreeConfig(*cfg))
    assert out.tokens == reference["noisy_oracle"]
    assert max(max(a) for a in out.accept_lengths) > 1  # the bf16 draft still gets tokens accepted


@pytest.mark.parametrize("cfg", [(5, 10, 60), (2, 3, 8), (1, 1, 1)], ids=lambda c: "d%d_k%d_n%d" % c)
def test_two_block_attention_is_lossless(models, cfg):
    """The core's other attention form (`Ops.cache_first` off: the cache as it was and the new
    keys/values as two blocks, as the CPU kernel takes them), run with the XLA ops."""
    ops = dataclasses.replace(XLA, cache_first=False)
    t, d = (dataclasses.replace(m, ops=ops) for m in models["noisy_oracle"])
    t = per_layer(t)
    want = generate_vanilla(t, PROMPTS, max_new_tokens=23).tokens
    assert generate(t, d, PROMPTS, max_new_tokens=23, tree=TreeConfig(*cfg)).tokens == want
