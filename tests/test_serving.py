"""The serving engine (eagle2_jax.serving): continuous batching of EAGLE-2 rounds stays lossless.

A greedy request's tokens equal plain decoding of its prompt alone, whatever else is in the batch
(greedy or sampled rows), whenever it arrived and whichever tree or plain rounds the load picks; a
seeded sampled request equals `generate` of its prompt alone with that seed; per-row sampling in the
engine's rounds follows the target's exact distribution (chi-square); after warm-up nothing
compiles; cancelled and stopped requests free their slots."""
import jax
import numpy as np
import pytest

import eagle2_jax as e2
from eagle2_jax.decoding.eagle import PREFILL, program_inputs, scratch_slots
from eagle2_jax.decoding.sampling import SamplingParams
from eagle2_jax.decoding.spec import RoundSpec
from eagle2_jax.serving import Engine
from eagle2_jax.serving.slots import INSERT, MOVE, RESIZE, RETIRE, ROUNDS
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
    return tuple(p.num_compiled for p in (PREFILL, INSERT, MOVE, RESIZE, ROUNDS, RETIRE))


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "dispatch-ahead"])
def test_staggered_arrivals_are_token_identical_to_plain_decoding_and_compile_nothing(pair, reference, ahead):
    t, d = pair
    engine = Engine(t, d, slots=4, max_len=64, tree=TREE, rounds_per_dispatch=3, ahead=ahead)
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


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "dispatch-ahead"])
def test_cancel_and_stop_ids_free_their_slots(pair, reference, ahead):
    t, d = pair
    engine = Engine(t, d, slots=2, max_len=64, tree=TREE, rounds_per_dispatch=2, ahead=ahead)
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
    for kw, what in ((dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
                     (dict(seed=-1), "seed")):
        with pytest.raises(ValueError, match=what):
            engine.submit([1, 2], 4, **kw)
    greedy_only = Engine(t, d, slots=2, max_len=32, tree=TREE, sampling=False)
    with pytest.raises(ValueError, match="greedy requests only"):
        greedy_only.submit([1, 2], 4, temperature=0.5)
    assert not engine.queue and not greedy_only.queue


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
    # the idle slots' prefill; prompt buckets 16, 32 and 64 greedy and sampling; per slot bucket (1 and
    # 2 rows) insert, move, retire, and rounds of the tree and plain, greedy and sampling; resizes
    # 1 -> 2 and 2 -> 1
    assert n == 1 + 3 * 2 + 2 * (3 + 2 * 2) + 2


def test_mixed_greedy_and_sampled_rows_under_a_load_plan(pair, reference):
    """Greedy and sampled requests share the batch; a table picks a tree for one busy row and plain
    rounds for more. Greedy rows equal plain decoding; a seeded sampled request equals `generate` of
    its prompt alone; nothing compiles after warm-up though sampling values change per request."""
    t, d = pair
    engine = Engine(t, d, slots=4, max_len=64, tree={1: TREE, 2: None}, rounds_per_dispatch=2)
    assert engine.plan == {1: TREE, 2: None, 4: None}
    engine.warmup()
    before = compiles()
    sampled = [dict(temperature=0.8, top_p=0.9, seed=11), dict(temperature=1.3, top_k=5, seed=12)]
    reference_first = e2.generate_vanilla(t, [PROMPTS[0]], max_new_tokens=56).tokens[0]
    want = [e2.generate(t, d, [PROMPTS[1]], max_new_tokens=MAX_NEW[1], tree=TREE, **kw).tokens[0]
            for kw in sampled]
    first = engine.submit(PROMPTS[0], 56)  # long enough to outlive the burst
    engine.step()
    engine.step()  # alone: tree rounds
    assert engine.dispatches == {(1, TREE): 2}
    reqs = [engine.submit(PROMPTS[1], MAX_NEW[1], **kw) for kw in sampled] + [engine.submit(PROMPTS[3], MAX_NEW[3])]
    engine.step()  # busy: plain rounds over 4 rows (their draft follows every token)
    assert engine.dispatches[4, None] == 1
    seen = len(first.accept_lengths)
    engine.run(max_steps=500)
    assert first.tokens == reference_first and reqs[2].tokens == reference[3]
    # `first`, alone again after the burst, drafts trees again, and they are accepted
    assert engine.dispatches[1, TREE] > 2 and engine.dispatches[1, None] == 0
    assert any(a > 1 for a in first.accept_lengths[seen:])
    alone = engine.submit(PROMPTS[1], MAX_NEW[1], **sampled[0])  # the seeded request again, alone: tree rounds
    engine.run(max_steps=500)
    assert alone.tokens == want[0]
    assert len({tuple(r.tokens) for r in reqs[:2]}) == 2  # each row its own settings and key
    assert engine.idle and compiles() == before


def test_a_busy_row_left_high_moves_down_to_a_smaller_bucket(pair, reference):
    t, d = pair
    engine = Engine(t, d, slots=4, max_len=64, tree=TREE, rounds_per_dispatch=2)
    reqs = [engine.submit(p, n) for p, n in zip(PROMPTS[:4], (2, 2, 2, MAX_NEW[3]))]
    engine.step()  # all four admitted; the three short ones finish in the first round
    assert [r.finished for r in reqs] == [True, True, True, False] and reqs[3].slot == 3
    engine.step()
    assert reqs[3].slot == 0 and engine.rows == 1  # moved down, the state shrunk: batch-1 rounds
    engine.run(max_steps=500)
    assert reqs[3].tokens == reference[3]
    assert engine.dispatches == {(4, TREE): 1, (1, TREE): engine.dispatches[1, TREE]}


@pytest.mark.parametrize("tree", [e2.TreeConfig(2, 3, 8), None], ids=["tree", "plain"])
def test_engine_rounds_sample_each_row_from_its_own_settings(tree):
    """The engine's rounds program with per-row sampling values: rows of three sampling settings and
    greedy rows interleaved in one batch; each sampled group's first three tokens follow the target's
    exact distribution under its own settings (chi-square, as tests/test_sampling_lossless.py), the
    greedy rows give the greedy tokens."""
    from test_sampling_lossless import PROMPT, P_THRESHOLD, V, chi_square_p, exact_distribution
    from helpers import tiny_pair
    t, d = tiny_pair(3, vocab_size=V, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=32)
    t.params = dict(t.params, lm_head=t.params["lm_head"] * 40.0)
    d.params = jax.tree_util.tree_map(lambda x: x * 3.0, d.params)
    settings = [e2.SamplingConfig(0.7, 0, 1.0), e2.SamplingConfig(1.0, 0, 0.8), e2.SamplingConfig(1.0, 3, 1.0),
                e2.SamplingConfig()]
    R = 8192
    group = np.arange(R) % len(settings)
    s = SamplingParams.rows([settings[g].temperature for g in group], [settings[g].top_k for g in group],
                            [settings[g].top_p for g in group])
    counts = np.zeros((len(settings), V ** 3), np.int64)
    greedy = e2.generate_vanilla(t, [PROMPT], max_new_tokens=3).tokens[0]
    for call in range(4):
        _, args, static = program_inputs(t, d, [PROMPT] * R, 3, None, 100 + call, s, scratch_slots(tree or TREE),
                                         cache_len=64)
        st = PREFILL(*args, **static)
        for _ in range(3):  # each call returns once some row finishes
            st, _ = ROUNDS(args[0], st, s, spec=RoundSpec.of(t, d, tree), max_rounds=10)
        toks = np.asarray(st.out_BM)[:, :3]
        assert (np.asarray(st.n_out_B) == 3).all()
        np.add.at(counts, (group, toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2]), 1)
        assert (toks[group == 3] == greedy).all()
    for g in range(3):
        p, stat, k = chi_square_p(counts[g], exact_distribution(t, settings[g]))
        assert p > P_THRESHOLD, f"setting {settings[g]}: chi2={stat:.1f} on {k} dof, p={p:.2e}"


def test_bench_engine_runs_both_modes(tmp_path):
    """infer.bench_engine on a tiny random config: both modes at two loads, every request finished."""
    import json
    from infer.bench_engine import main
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny_config(num_hidden_layers=2).to_hf_dict()))
    main(["--model", f"random:{cfg}", "--draft", "random", "--concurrency", "1,2", "--requests", "3",
          "--max-tokens", "6", "--prompt-len", "5", "--out", str(tmp_path / "out")])
    rows = json.loads((tmp_path / "out" / "bench_engine.json").read_text())["rows"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("eagle", 1), ("eagle", 2), ("vanilla", 1), ("vanilla", 2)]
    assert all(r["requests"] == 3 and r["completion_tokens"] == 18 for r in rows)
    assert all(r["tau"] == 1.0 for r in rows if r["mode"] == "vanilla")


def test_an_auto_plan_is_measured_at_warm_up_and_serves_the_same_tokens(pair, reference):
    """plan="auto": every candidate tree and plain rounds compiled and timed at each bucket during
    warm-up, a choice per bucket among them; greedy requests still equal plain decoding, and nothing
    compiles after warm-up."""
    t, d = pair
    engine = Engine(t, d, slots=2, max_len=64, plan="auto", rounds_per_dispatch=2, sampling=False)
    assert engine.auto and all(None in cs and len(cs) >= 3 for cs in engine.choices.values())
    engine.warmup()
    assert engine.planner is not None and set(engine.plan) == {1, 2}
    assert all(engine.plan[b] in engine.choices[b] for b in engine.buckets)
    assert all(c.round_ms > 0 for cs in engine.planner.table.values() for c in cs)
    assert "rows:" in engine.describe_plan()
    before = compiles()
    reqs = [engine.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    engine.run(max_steps=800)
    assert [r.tokens for r in reqs] == reference
    assert compiles() == before, "something compiled after warm-up"


def test_the_planner_follows_observed_acceptance_with_hysteresis():
    """A tree that promises more than plain rounds is chosen; when its rounds accept nothing beyond the
    bonus the bucket moves to plain rounds once, after DWELL dispatches, and does not move back on its
    own (plain rounds teach nothing about acceptance); choices within the margin never move."""
    from eagle2_jax.serving.plan import DWELL, Choice, Planner
    tree = e2.TreeConfig(3, 2, 6)
    p = Planner({1: [Choice(tree, 12.0, 1.5), Choice(None, 10.0, 1.0)]})
    assert p.plan[1] == tree  # 1.5 / 12 > 1 / 10
    for _ in range(3 * DWELL):
        assert p.choose(1) is not None or p.moves == 1
        p.observe(1, p.plan[1], [1, 1, 1, 1] if p.plan[1] is not None else [])
    assert p.plan[1] is None and p.moves == 1
    close = Planner({1: [Choice(tree, 10.5, 1.1), Choice(None, 10.0, 1.0)]})  # 1.1 / 10.5 is within the margin
    start = close.plan[1]
    for _ in range(3 * DWELL):
        close.choose(1)
        close.observe(1, close.plan[1], [1, 2] if close.plan[1] is not None else [])
    assert close.plan[1] == start and close.moves == 0


def test_plans_from_the_command_line():
    from eagle2_jax.serving.plan import parse_plan
    assert parse_plan("auto") == "auto" and parse_plan("head") is None
    assert parse_plan("1=5/10/60,4=plain") == {1: e2.TreeConfig(5, 10, 60), 4: None}
    for bad in ("1=5/10", "x=plain", "0=plain", "1=5/10/60/2"):
        with pytest.raises(ValueError, match="plan"):
            parse_plan(bad)


def test_plain_rounds_feed_the_draft_only_where_a_tree_may_follow(pair):
    """Catch-up in plain rounds is work only a later tree needs: a plan with a tree somewhere keeps it,
    a plan of plain rounds everywhere (and vanilla mode) skips it."""
    t, d = pair
    assert Engine(t, d, slots=2, max_len=64, plan={1: TREE, 2: None}).catch_up
    assert not Engine(t, d, slots=2, max_len=64, plan={1: None}).catch_up
    assert not Engine(t, d, slots=2, max_len=64, plan=TREE, mode="vanilla").catch_up
