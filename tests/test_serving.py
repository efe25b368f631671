"""The serving engine (eagle2_jax.serving): continuous batching of EAGLE-2 rounds stays lossless.

A greedy request's tokens equal plain decoding of its prompt alone, whatever else is in the batch
and whenever it arrived; after warm-up nothing compiles; cancelled and stopped requests free their
slots."""
import jax
import pytest

import eagle2_jax as e2
from eagle2_jax.eagle import PREFILL
from eagle2_jax.serving import Engine
from eagle2_jax.serving.programs import INSERT, RETIRE, ROUNDS
from helpers import permutation_oracle, tiny_config

TREE = e2.TreeConfig(3, 2, 6)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3], [5, 6, 7, 8],
           [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], [30, 31, 32]]
MAX_NEW = [12, 30, 7, 25, 18, 9, 21]


@pytest.fixture(scope="module")
def pair():
    t, d, _ = permutation_oracle(0, layer_scale=2.0)  # a good but imperfect draft: varied accept lengths
    return t, d


@pytest.fixture(scope="module")
def reference(pair):
    t, _ = pair
    return [e2.generate_vanilla(t, [p], max_new_tokens=n).tokens[0] for p, n in zip(PROMPTS, MAX_NEW)]


def compiles():
    return tuple(p.num_compiled for p in (PREFILL, INSERT, ROUNDS, RETIRE))


def test_staggered_arrivals_are_token_identical_to_plain_decoding_and_compile_nothing(pair, reference):
    t, d = pair
    engine = Engine(t, d, slots=4, max_len=64, tree=TREE, rounds_per_dispatch=3)
    engine.warmup()
    before = compiles()
    reqs = [engine.submit(p, n) for p, n in zip(PROMPTS[:3], MAX_NEW[:3])]
    engine.step()
    engine.step()  # arrivals into a partly busy batch, rows at different lengths
    reqs += [engine.submit(p, n) for p, n in zip(PROMPTS[3:5], MAX_NEW[3:5])]
    engine.step()
    reqs += [engine.submit(p, n) for p, n in zip(PROMPTS[5:], MAX_NEW[5:])]  # more than the free slots: they wait
    assert len(engine.queue) > 0
    engine.run(max_steps=500)
    assert [r.tokens for r in reqs] == reference
    assert all(r.finish_reason == "length" for r in reqs)
    assert any(a > 1 for r in reqs for a in r.accept_lengths)  # the drafts were accepted, not just plain steps
    assert engine.idle and not engine.running
    assert compiles() == before, "something compiled after warm-up"


def test_cancel_and_stop_ids_free_their_slots(pair, reference):
    t, d = pair
    engine = Engine(t, d, slots=2, max_len=64, tree=TREE, rounds_per_dispatch=2)
    stop_at = reference[1][4]  # a token request 1 emits: it stops there
    keep = engine.submit(PROMPTS[0], MAX_NEW[0])
    stopped = engine.submit(PROMPTS[1], MAX_NEW[1], stop_ids=[stop_at])
    waiting = engine.submit(PROMPTS[2], MAX_NEW[2])
    engine.step()
    engine.cancel(keep)
    assert keep.finish_reason == "cancelled" and keep.tokens == reference[0][:len(keep.tokens)]
    engine.run(max_steps=200)
    assert stopped.tokens == reference[1][:reference[1].index(stop_at) + 1] and stopped.finish_reason == "stop"
    assert waiting.tokens == reference[2]  # took a freed slot
    assert engine.idle


def test_bad_requests_fail_at_once_and_queue_nothing(pair):
    t, d = pair
    engine = Engine(t, d, slots=2, max_len=32, tree=TREE)
    for prompt, n, what in (([], 4, "empty"), ([1, 2], 0, "max_new_tokens"), ([1] * 30, 8, "max_len"),
                            ([10 ** 6], 4, "token ids")):
        with pytest.raises(ValueError, match=what):
            engine.submit(prompt, n)
    assert not engine.queue


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
def test_sharded_serving_gives_the_same_tokens():
    """The engine over an 8-device mesh (rows on "data", heads and MLP width on "model") serves the
    tokens plain decoding gives on one device."""
    cfg = tiny_config(num_attention_heads=8, num_key_value_heads=4, hidden_size=64, intermediate_size=128)
    t = e2.init_target(cfg, 0)
    want = [e2.generate_vanilla(t, [p], max_new_tokens=n).tokens[0] for p, n in zip(PROMPTS, MAX_NEW)]
    ts = e2.init_target(cfg, 0, mesh=e2.make_mesh(2, 4))
    engine = Engine(ts, e2.init_draft(ts, 1), slots=4, max_len=64, tree=TREE, rounds_per_dispatch=3)
    reqs = [engine.submit(p, n) for p, n in zip(PROMPTS[:4], MAX_NEW[:4])]
    engine.step()
    reqs += [engine.submit(p, n) for p, n in zip(PROMPTS[4:], MAX_NEW[4:])]
    engine.run(max_steps=500)
    assert [r.tokens for r in reqs] == want


def test_compile_only_for_a_shape_without_weights():
    """Every engine program compiles from abstract params (nothing allocated), as `infer.serve
    --compile-only` does for a deployment's shape."""
    from eagle2_jax.serving import compile_programs
    cfg = tiny_config(num_hidden_layers=3)
    t = e2.init_target(cfg, abstract=True)
    d = e2.init_draft(t)
    assert t.abstract
    n = compile_programs(t, d, slots=2, max_len=40, tree=TREE)
    assert n == 1 + 1 + 3 + 1 + 1  # the slots' prefill, retire, prompt buckets 16, 32 and 64, insert, rounds
