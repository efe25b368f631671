"""Plain decoding: greedy vs step-by-step argmax, ragged batches, EOS, sampling, buckets, errors."""
import numpy as np
import pytest

from eagle2_jax import forward, generate_vanilla, init_target
from eagle2_jax.decoding.vanilla import LOOP
from helpers import tiny_config

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]


@pytest.fixture(scope="module")
def target():
    return init_target(tiny_config(), 0)


def _reference_greedy(target, prompt, n, width=32):
    """Argmax of full causal forwards, right-padded to one width (one compile; causal: padding after
    the last real token cannot change its logits)."""
    ids = list(prompt)
    for _ in range(n):
        assert len(ids) <= width
        logits = np.asarray(forward(target, [ids + [0] * (width - len(ids))]))[0, len(ids) - 1]
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt):]


def test_greedy_matches_full_forward_argmax(target):
    out = generate_vanilla(target, PROMPTS, max_new_tokens=9)
    for p, toks in zip(PROMPTS, out.tokens):
        assert toks == _reference_greedy(target, p, 9)


def test_batch_equals_each_alone(target):
    both = generate_vanilla(target, PROMPTS, max_new_tokens=7, temperature=0.8, seed=5).tokens
    # rows draw from per-row keys: the same row index gives the same stream alone or batched
    alone0 = generate_vanilla(target, PROMPTS[:1], max_new_tokens=7, temperature=0.8, seed=5).tokens
    assert both[0] == alone0[0]
    greedy = generate_vanilla(target, PROMPTS, max_new_tokens=7).tokens
    for i, p in enumerate(PROMPTS):
        assert generate_vanilla(target, [p], max_new_tokens=7).tokens[0] == greedy[i]


def test_eos_stops_row_and_is_kept(target):
    ref = generate_vanilla(target, PROMPTS, max_new_tokens=12).tokens
    eos = ref[0][4]
    out = generate_vanilla(target, PROMPTS, max_new_tokens=12, eos_token_id=eos).tokens
    for r, o in zip(ref, out):
        cut = r.index(eos) + 1 if eos in r else len(r)
        assert o == r[:cut]


def test_max_new_tokens_one(target):
    out = generate_vanilla(target, PROMPTS, max_new_tokens=1).tokens
    assert [len(o) for o in out] == [1, 1, 1]


def test_sampling_seeded_and_rows_differ(target):
    a = generate_vanilla(target, [PROMPTS[0]] * 4, max_new_tokens=16, temperature=1.0, seed=1).tokens
    b = generate_vanilla(target, [PROMPTS[0]] * 4, max_new_tokens=16, temperature=1.0, seed=1).tokens
    c = generate_vanilla(target, [PROMPTS[0]] * 4, max_new_tokens=16, temperature=1.0, seed=2).tokens
    assert a == b and a != c
    assert len({tuple(x) for x in a}) > 1  # rows draw independent numbers


def test_top_k_one_is_greedy(target):
    g = generate_vanilla(target, PROMPTS, max_new_tokens=8).tokens
    s = generate_vanilla(target, PROMPTS, max_new_tokens=8, temperature=1.3, top_k=1, seed=3).tokens
    assert g == s
    s = generate_vanilla(target, PROMPTS, max_new_tokens=8, temperature=1.3, top_p=1e-6, seed=3).tokens
    assert g == s


def test_stream_matches_loop(target):
    seen = {}
    out = generate_vanilla(target, PROMPTS, max_new_tokens=6, stream=lambda r, t: seen.setdefault(r, []).extend(t))
    assert [seen[i] for i in range(3)] == out.tokens


def test_prompt_bucket_no_recompile(target):
    before = LOOP.num_compiled
    generate_vanilla(target, [[1, 2, 3]], max_new_tokens=5)
    mid = LOOP.num_compiled
    generate_vanilla(target, [[4, 5, 6, 7, 8, 9]], max_new_tokens=5)  # same bucket (16)
    generate_vanilla(target, [[4, 5]], max_new_tokens=9)  # same max_new bucket
    assert LOOP.num_compiled == mid <= before + 1


def test_bad_inputs(target):
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate_vanilla(target, [[]], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        generate_vanilla(target, [list(range(60)) * 9], max_new_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        generate_vanilla(target, [[1, 999]], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_vanilla(target, [[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="string"):
        generate_vanilla(target, ["hello"], max_new_tokens=3)
    with pytest.raises(ValueError, match="top_p"):
        generate_vanilla(target, [[1]], max_new_tokens=3, temperature=1.0, top_p=0.0)
