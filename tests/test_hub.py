"""Hub ids (`org/name[@revision]`) load from a Hugging Face Hub cache laid out here (no network):
targets and heads by id, offline; a missing id is one line naming the id and the cache."""
import os

import numpy as np
import pytest

import eagle2_jax as e2
from eagle2_jax.loading.convert import CheckpointError
from eagle2_jax.loading.draft_io import save_draft
from eagle2_jax.loading.hf_files import save_hf_dir
from helpers import tiny_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_entry(cache, repo_id, write, revision="main"):
    """The cache's layout for one model repo: models--org--name/{refs/<revision>, snapshots/<commit>/...}."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snap = root / "snapshots" / COMMIT
    write(str(snap))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / revision).write_text(COMMIT)
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_target_and_head_load_by_hub_id_offline(offline_cache):
    t = e2.init_target(tiny_config(), 0)
    d = e2.init_draft(t, 1)
    hub_entry(offline_cache, "tiny-org/tiny-llama", lambda p: save_hf_dir(t, p))
    hub_entry(offline_cache, "tiny-org/tiny-llama-eagle", lambda p: save_draft(d, p, dtype="float32"), revision="v1")
    loaded = e2.load_target("tiny-org/tiny-llama")
    ids = np.arange(12)[None] % 64
    np.testing.assert_allclose(np.asarray(e2.forward(loaded, ids)), np.asarray(e2.forward(t, ids)), atol=1e-5)
    head = e2.load_draft("tiny-org/tiny-llama-eagle@v1", loaded)
    want = e2.generate(t, d, [[1, 2, 3]], max_new_tokens=8, tree=e2.TreeConfig(2, 2, 4))
    got = e2.generate(loaded, head, [[1, 2, 3]], max_new_tokens=8, tree=e2.TreeConfig(2, 2, 4))
    assert got.tokens == want.tokens and got.accept_lengths == want.accept_lengths


def test_a_missing_id_offline_is_one_line_naming_the_id_and_the_cache(offline_cache):
    with pytest.raises(CheckpointError) as e:
        e2.load_target("nobody/no-such-model")
    msg = str(e.value)
    assert "nobody/no-such-model" in msg and str(offline_cache) in msg and "\n" not in msg
    with pytest.raises(CheckpointError, match="nobody/no-head"):
        e2.load_draft("nobody/no-head", e2.init_target(tiny_config(), 0))


def test_paths_and_names_are_not_taken_for_hub_ids(tmp_path, monkeypatch):
    from eagle2_jax.loading.hub import is_hub_id
    monkeypatch.chdir(tmp_path)
    os.makedirs("local/model")
    assert not is_hub_id("local/model")  # a directory here wins
    assert is_hub_id("meta-llama/Llama-3.1-8B-Instruct") and is_hub_id("org/name@v1.0")
    assert not is_hub_id("random:llama-3.1-8b") and not is_hub_id("model.gguf") and not is_hub_id("/abs/path")
