"""infer.bench bookkeeping with stand-in runners (no model, no timing asserts)."""
import json
import types

import eagle2_jax
from infer import bench


class FakeTokenizer:
    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return " | ".join(m["content"] for m in messages)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 97 for c in text][:32]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


class FakeRunner:
    """Plain and EAGLE-2 runners that produce the same tokens; every call reports 10 s of
    compilation and 2 s of running for the whole batch."""

    def __init__(self, name, target, draft, tree, args):
        self.name = name

    def __call__(self, prompts):
        toks = [[len(p), 1, 2] for p in prompts]
        acc = [[2, 1] for _ in prompts] if self.name == "eagle" else None
        return toks, 2.0, 10.0, acc


def fake_bench(tmp_path, monkeypatch, n, runner=FakeRunner, categories=1):
    """A question file of n questions and infer.bench wired to stand-ins (no model); returns its path."""
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": "c%d" % (i % categories) if categories > 1 else "c",
                                     "turns": [f"question {i}"]}) + "\n" for i in range(n)))
    target = types.SimpleNamespace(tokenizer=FakeTokenizer())
    monkeypatch.setattr(eagle2_jax, "load_target", lambda *a, **k: target)
    monkeypatch.setattr(eagle2_jax, "load_draft", lambda *a, **k: None)
    monkeypatch.setattr(bench, "Ours", runner)
    monkeypatch.setattr(bench, "tree_of", lambda *a, **k: eagle2_jax.TreeConfig(2, 2, 4))
    return q


def test_batch_costs_are_counted_once_per_batch(tmp_path, monkeypatch):
    q = fake_bench(tmp_path, monkeypatch, 4, categories=2)
    out = tmp_path / "out"
    bench.main(["--questions", str(q), "--methods", "plain,eagle", "--batch", "2", "--out", str(out)])
    s = json.load(open(out / "results.json"))["summary"]
    for m in ("plain", "eagle"):
        d = s["methods"][m]
        assert d["new_tokens"] == 12  # 4 answers x 3 tokens
        assert abs(d["seconds"] - 4.0) < 1e-9  # two batches of 2 s
        assert abs(d["compile_s"] - 20.0) < 1e-9  # two batches of 10 s, not 10 s per answer
    assert abs(s["methods"]["eagle"]["tau"] - 1.5) < 1e-9  # 12 tokens in 8 rounds
    assert s["methods"]["eagle"]["per_category_tau"] == {"c0": 1.5, "c1": 1.5}
    assert "per_category_tau" not in s["methods"]["plain"]
    assert s["greedy_identical"] is True
    assert abs(s["speedup_eagle_vs_plain"] - 1.0) < 1e-9
    assert (out / "results.md").exists() and (out / "results.png").exists()


class SlowHF:
    """A transformers stand-in: the same tokens, 4 s per answer."""

    def __init__(self, name, target, args, pld=False):
        pass

    def __call__(self, prompts):
        return [[len(p), 1, 2] for p in prompts], 4.0 * len(prompts), 0.0, None


def test_hf_limit_compares_on_the_same_answers(tmp_path, monkeypatch):
    q = fake_bench(tmp_path, monkeypatch, 5)
    monkeypatch.setattr(bench, "HF", SlowHF)
    out = tmp_path / "out"
    bench.main(["--questions", str(q), "--methods", "plain,eagle,hf", "--hf-limit", "2", "--out", str(out)])
    data = json.load(open(out / "results.json"))
    s = data["summary"]
    assert sum(r["method"] == "hf" for r in data["rows"]) == 2  # only the first two questions
    assert sum(r["method"] == "plain" for r in data["rows"]) == 5
    assert s["hf_answers"] == 2
    assert abs(s["speedup_plain_vs_hf"] - 2.0) < 1e-9  # 2 s vs 4 s per answer of 3 tokens
    assert abs(s["speedup_eagle_vs_hf"] - 2.0) < 1e-9


def test_compile_cache_directory_and_switch(monkeypatch, tmp_path):
    import jax
    from eagle2_jax.decoding import programs
    monkeypatch.setenv("EAGLE2_JAX_COMPILE_CACHE", "0")
    assert programs.enable_compile_cache() is None
    monkeypatch.setenv("EAGLE2_JAX_COMPILE_CACHE", "1")
    monkeypatch.setenv("EAGLE2_JAX_CACHE", str(tmp_path))
    old_dir = jax.config.jax_compilation_cache_dir
    old_min = jax.config.jax_persistent_cache_min_compile_time_secs
    try:  # (nothing compiles in between, so the process's cache state is untouched)
        jax.config.update("jax_compilation_cache_dir", None)
        path = programs.enable_compile_cache()
        assert path.startswith(str(tmp_path / "xla" / jax.default_backend()))
        assert jax.config.jax_compilation_cache_dir == path
        assert programs.enable_compile_cache() == path  # a configured directory is left alone
    finally:
        jax.config.update("jax_compilation_cache_dir", old_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old_min)


class CountingRunner(FakeRunner):
    """FakeRunner that records every prompt it answers, and fails on demand after some calls."""
    calls = []
    fail_after = None

    def __call__(self, prompts):
        if CountingRunner.fail_after is not None and len(CountingRunner.calls) >= CountingRunner.fail_after:
            raise KeyboardInterrupt  # the run is stopped part-way
        CountingRunner.calls.append((self.name, tuple(prompts)))
        return super().__call__(prompts)


def test_resume_answers_only_the_missing_batches(tmp_path, monkeypatch):
    import pytest
    q = fake_bench(tmp_path, monkeypatch, 7, CountingRunner)
    monkeypatch.setattr(CountingRunner, "warm", lambda self, p: None, raising=False)
    common = ["--questions", str(q), "--methods", "plain,eagle", "--batch", "2"]

    whole = tmp_path / "whole"
    bench.main(common + ["--out", str(whole)])
    expected = json.load(open(whole / "results.json"))

    part = tmp_path / "part"
    CountingRunner.calls = []
    bench.main(common + ["--limit", "3", "--out", str(part)])  # batches {0, 1} and {2}
    CountingRunner.calls, CountingRunner.fail_after = [], 2  # then one more batch before it is stopped
    with pytest.raises(KeyboardInterrupt):
        bench.main(common + ["--out", str(part), "--resume"])
    assert [c[0] for c in CountingRunner.calls] == ["plain", "eagle"]  # only the batch {2, 3}, not {0, 1}
    CountingRunner.calls, CountingRunner.fail_after = [], None
    bench.main(common + ["--out", str(part), "--resume"])
    assert len(CountingRunner.calls) == 4  # batches {4, 5} and {6}, each by both methods
    got = json.load(open(part / "results.json"))
    key = lambda r: (r["method"], r["question_id"])
    assert sorted(map(key, got["rows"])) == sorted(map(key, expected["rows"]))  # no answer twice or missing
    assert sorted(got["rows"], key=key) == sorted(expected["rows"], key=key)
    assert got["summary"]["methods"] == expected["summary"]["methods"]

    CountingRunner.calls = []  # rerun with a smaller --limit (as a rerun script does): nothing asked, nothing lost
    bench.main(common + ["--limit", "2", "--out", str(part), "--resume"])
    assert CountingRunner.calls == []
    again = json.load(open(part / "results.json"))
    assert sorted(again["rows"], key=key) == sorted(expected["rows"], key=key)
    assert again["summary"]["methods"] == expected["summary"]["methods"]

    with pytest.raises(SystemExit, match="other settings.*temperature"):
        bench.main(common + ["--out", str(part), "--resume", "--temperature", "1"])
