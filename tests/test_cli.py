"""The command-line tools reject bad input with one line, before a model loads, writing nothing."""
import json
import os

import numpy as np
import pytest

from infer import bench, compile_report, generate, roundcost
from train import data as train_data
from train import draft as train_draft


@pytest.fixture
def no_model_load(monkeypatch):
    """Bad input must stop the tools before a model loads or a program compiles: here either fails
    the test at once (without the checks they would go on to load SmolLM2 and run)."""
    import eagle2_jax
    from eagle2_jax.loading import checkpoints

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was rejected")
    monkeypatch.setattr(eagle2_jax, "load_target", refuse)
    monkeypatch.setattr(checkpoints, "load_target", refuse)
    monkeypatch.setattr(compile_report, "report", refuse)


def one_line_error(capsys, fn, argv, code=None):
    with pytest.raises(SystemExit) as e:
        fn(argv)
    err = capsys.readouterr().err.strip()
    text = err or str(e.value.code)  # sys.exit("error: ...") carries its message in the exception
    assert text.startswith("error:") and "\n" not in text, text
    assert "Traceback" not in text
    if code is not None:
        assert e.value.code == code
    return text


@pytest.mark.parametrize("argv, what", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "2"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--sample-top-k", "-3"], "--sample-top-k"),
    (["--depth", "0"], "--depth"),
    (["--total-tokens", "abc"], "--total-tokens"),
    (["--temperature", "nan"], "--temperature"),
])
def test_generate_rejects_bad_values_while_parsing(capsys, argv, what):
    msg = one_line_error(capsys, generate.build_parser().parse_args, argv, code=2)
    assert what in msg


def test_bench_rejects_bad_input_before_loading(tmp_path, capsys, no_model_load):
    out = tmp_path / "out"
    for argv in (["--limit", "0"], ["--turns", "0"], ["--batch", "-1"], ["--total-tokens", "x"]):
        one_line_error(capsys, bench.main, argv + ["--out", str(out)], code=2)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "not a directory" in one_line_error(capsys, bench.main, ["--out", str(a_file)], code=2)
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"turns": ["a question"]}\n{"turns": ["x"\n')
    assert "line 2" in one_line_error(capsys, bench.main, ["--questions", str(bad), "--out", str(out)])
    bad.write_text('{"question": "no turns"}\n')
    assert '"turns"' in one_line_error(capsys, bench.main, ["--questions", str(bad), "--out", str(out)])
    assert not out.exists()


def test_bench_names_a_missing_model_in_one_line(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text('{"turns": ["a question"]}\n')
    msg = one_line_error(capsys, bench.main, ["--questions", str(good), "--model", str(tmp_path / "nope"),
                                              "--out", str(tmp_path / "out")])
    assert "nope" in msg
    assert not (tmp_path / "out").exists()


def test_bench_resume_names_an_unreadable_results_file(tmp_path):
    (tmp_path / "results.json").write_text("{not json")
    with pytest.raises(ValueError, match="results.json is not a results file"):
        bench.resumed(str(tmp_path), {}, [])


def test_roundcost_and_compile_report_reject_bad_input(tmp_path, capsys, no_model_load):
    for argv in (["--batch", "0"], ["--batch", "1,x"], ["--repeats", "0"], ["--total-tokens", ""],
                 ["--analytic", "--tau", "0.5"], ["--analytic", "--depth", "2", "--top-k", "2", "--total-tokens", "99"],
                 ["--json", str(tmp_path)]):
        one_line_error(capsys, roundcost.main, argv + ["--out", str(tmp_path / "rc")], code=2)
    for argv in (["--batch", "0"], ["--prompt-len", "0"], ["--max-new-tokens", "-1"], ["--temperature", "-1"],
                 ["--layers", "2,x"]):
        one_line_error(capsys, compile_report.main, argv + ["--json", str(tmp_path / "c.json")], code=2)
    assert not (tmp_path / "rc").exists() and not (tmp_path / "c.json").exists()


def test_train_data_rejects_bad_input_before_loading(tmp_path, capsys, no_model_load):
    out = tmp_path / "data"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["hello"]}\n')
    for argv in (["--shard-size", "0"], ["--max-prompts", "0"], ["--batch-size", "0"], ["--max-new-tokens", "0"]):
        one_line_error(capsys, train_data.main, argv + ["--out", str(out), "--files", str(prompts)], code=2)
    assert not out.exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["hello"]}\nnot json\n')
    msg = one_line_error(capsys, train_data.main, ["--out", str(out), "--files", str(bad), "--responses", "dataset"])
    assert "bad.jsonl, line 2" in msg
    # a rerun into a run's directory with other settings would mix shards: refused
    out.mkdir()
    train_data.write_shard(str(out / "shard_00000.npz"), [(np.arange(4, dtype=np.int32), np.ones(4, np.uint8))])
    (out / "meta.json").write_text(json.dumps({"target": "smollm2-135m-instruct", "prompts": 1, "max_new_tokens": 256,
                                               "temperature": 0.0, "skip": 0}))
    msg = one_line_error(capsys, train_data.main, ["--out", str(out), "--files", str(prompts), "--max-new-tokens", "64"])
    assert "max_new_tokens" in msg
    assert sorted(os.listdir(out)) == ["meta.json", "shard_00000.npz"]


def test_train_data_resume_rules(tmp_path):
    """check_resume: the same settings resume; others, fewer prompts, growth past a partial last
    shard, or a shard size that does not match an older run's counts are refused."""
    out = tmp_path / "run"
    out.mkdir()
    train_data.write_shard(str(out / "shard_00000.npz"), [(np.arange(4, dtype=np.int32), np.ones(4, np.uint8))])
    common = {"target": "t", "skip": 0, "max_new_tokens": 256, "temperature": 0.0, "files": ["a.json"]}

    def check(old, new):
        (out / "meta.json").write_text(json.dumps(old))
        train_data.check_resume(str(out), new)

    new = dict(common, shard_size=64, max_prompt_tokens=384)
    check(dict(common, prompts=1200, shards=19), dict(new, prompts=1200, shards=19))  # an older run, same settings
    check(dict(common, prompts=1280, shards=20), dict(new, prompts=1500, shards=24))  # grows from a full last shard
    check(dict(common, prompts=1200, shards=19), dict(new))  # (before the prompts are counted)
    for old, changed, what in ((dict(common, prompts=1200, shards=19), dict(new, prompts=1500), "partial"),
                               (dict(common, prompts=1280, shards=20), dict(new, prompts=640), "1280 prompts"),
                               (dict(common, prompts=1200, shards=19), dict(new, shard_size=100), "shard_size"),
                               (dict(new, prompts=64), dict(new, shard_size=32), "shard_size"),
                               (dict(common, prompts=64), dict(new, temperature=1.0), "temperature")):
        with pytest.raises(SystemExit, match=what):
            check(old, changed)


def test_train_draft_rejects_bad_config_before_loading(tmp_path, capsys, no_model_load):
    base = ["--data", str(tmp_path / "d"), "--out", str(tmp_path / "o")]
    for argv, what in ((["--steps", "0"], "init-from"), (["--heldout-examples", "0"], "heldout_examples"),
                       (["--log-every", "0"], "log_every"), (["--batch-size", "0"], "batch_size"),
                       (["--clip-norm", "0"], "clip_norm"), (["--tree", "0,10,60"], "tree"),
                       (["--arch", "foo"], "arch"), (["--min-lr-ratio", "2"], "min_lr_ratio")):
        assert what in one_line_error(capsys, train_draft.load_config, argv + base)
    assert "--tree" in one_line_error(capsys, train_draft.load_config, ["--tree", "5,10"] + base, code=2)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("steps: many\n")
    assert "steps must be an integer" in one_line_error(capsys, train_draft.load_config, ["--config", str(cfg)] + base)
    assert not (tmp_path / "o").exists()
    # --steps 0 with --init-from is the evaluation-only run and passes the checks
    assert train_draft.load_config(["--steps", "0", "--init-from", "some/head"] + base).steps == 0
    (tmp_path / "o" / "checkpoints" / "40").mkdir(parents=True)  # ... but not over a run's checkpoints
    assert "checkpoints" in one_line_error(capsys, train_draft.load_config,
                                           ["--steps", "0", "--init-from", "some/head"] + base)
