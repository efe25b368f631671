"""infer.roundcost: the round-cost table on a tiny random pair (no timing asserts)."""
import json

import pytest

from helpers import tiny_pair
from infer import roundcost


@pytest.mark.slow  # keeps the default suite within its time (README, top)
def test_roundcost_rows_and_outputs(tmp_path):
    t, d = tiny_pair(0)
    prompts = roundcost.load_prompts(t, None, 2)  # random tokens: the tiny target has no tokenizer
    calib = roundcost.load_prompts(t, None, 3)  # acceptance measured over more prompts than the batch
    rows = roundcost.measure(t, d, prompts, depth=2, top_k=2, sizes=[2, 4, 99], repeats=1, calibration_rounds=2,
                             calibration_prompts=calib)
    assert [r["total_tokens"] for r in rows] == [2, 4, 11]  # capped at the pool size + 1
    for r in rows:
        assert r["batch"] == 2
        for k in ("draft_ms", "verify_ms", "accept_ms", "round_ms", "plain_step_ms"):
            assert r[k] > 0
        assert 1.0 <= r["expected_tau"] <= 1 + (r["total_tokens"] - 1)
        assert 1.0 <= r["estimated_tau"] <= 1 + (r["total_tokens"] - 1)
    assert [r["expected_tau"] for r in rows] == sorted(r["expected_tau"] for r in rows)  # nested trees
    roundcost.write(rows, str(tmp_path))
    saved = json.load(open(tmp_path / "roundcost.json"))
    assert saved["chosen"]["2"]["total_tokens"] in (2, 4, 11)
    assert "**chosen**" in (tmp_path / "roundcost.md").read_text()
    assert (tmp_path / "roundcost.png").exists()


def test_round_only_and_random_shapes(tmp_path):
    from eagle2_jax import load_draft, load_target
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)))
    t = load_target(f"random:{cfg}")
    assert t.tokenizer is None and t.config.hidden_size == 32 and t.source == f"random:{cfg}"
    d = load_draft("random", t)
    assert d.config.hidden_size == 32
    rows = roundcost.measure(t, d, roundcost.load_prompts(t, None, 1), depth=2, top_k=2, sizes=[2, 4], repeats=1,
                             calibration_rounds=1, parts="round")
    assert all(r["draft_ms"] is None and r["round_ms"] > 0 for r in rows)
    roundcost.write(rows, str(tmp_path))
    assert " - | - | - |" in (tmp_path / "roundcost.md").read_text()


def test_unknown_random_shape_is_refused():
    import pytest
    from eagle2_jax import CheckpointError, load_target
    with pytest.raises(CheckpointError, match="random:llama-3.1-8b"):
        load_target("random:no-such-shape")


def test_by_batch_takes_the_best_tree_or_plain_where_none_beats_it():
    from infer.roundcost import by_batch
    rows = [dict(batch=1, total_tokens=2, tokens_per_s=60.0, plain_tokens_per_s=55.0),
            dict(batch=1, total_tokens=4, tokens_per_s=58.0, plain_tokens_per_s=55.0),
            dict(batch=8, total_tokens=2, tokens_per_s=90.0, plain_tokens_per_s=170.0),
            dict(batch=8, total_tokens=4, tokens_per_s=80.0, plain_tokens_per_s=170.0)]
    assert by_batch(rows) == {"1": 2, "8": "plain"}
