"""Which tree a generation runs: flags over the head's tree.json (per platform, per batch size) over the
reference tree; a batch size where the head's table says no tree pays decodes plainly, losslessly."""
import json

import pytest

import eagle2_jax as e2
from eagle2_jax.decoding.autotune import resolve_tree
from eagle2_jax.decoding.defaults import REFERENCE_TREE, for_batch
from eagle2_jax.platform import platform
from helpers import tiny_pair

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [4, 4, 4, 4]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny pair with its head saved and loaded back from a directory holding a tree.json."""
    t, d = tiny_pair(0)
    src = tmp_path_factory.mktemp("head") / "h"
    e2.save_draft(d, str(src), format="eagle")
    table = {"depth": 2, "top_k": 2, "total_tokens": 6, "by_batch": {"1": 4, "3": "plain"}}
    (src / "tree.json").write_text(json.dumps({platform(): table}))
    return t, e2.load_draft(str(src), t)


def test_for_batch_takes_the_largest_listed_size_at_or_below():
    table = {1: 4, 3: "plain", 8: 2}
    assert [for_batch(table, b) for b in (1, 2, 3, 7, 8, 64)] == [4, 4, "plain", "plain", 2, 2]
    assert for_batch({4: 8}, 1) == 8  # below every listed size: the smallest's


def test_flags_over_the_batch_table_over_the_head_over_the_reference(pair):
    _, d = pair
    assert resolve_tree(d) == e2.TreeConfig(2, 2, 6)  # no batch given: the head's tree
    assert resolve_tree(d, batch=2) == e2.TreeConfig(2, 2, 4)
    assert resolve_tree(d, batch=3) is None and resolve_tree(d, batch=16) is None
    assert resolve_tree(d, total_tokens=5, batch=16) == e2.TreeConfig(2, 2, 5)  # a flag wins
    assert resolve_tree(None, batch=16) == REFERENCE_TREE


def test_a_batch_where_no_tree_pays_decodes_plainly_and_losslessly(pair):
    t, d = pair
    ref = e2.generate_vanilla(t, PROMPTS, max_new_tokens=12)
    out = e2.generate(t, d, PROMPTS, max_new_tokens=12)  # 4 rows: "plain" from 3 rows up
    assert out.tokens == ref.tokens
    assert out.tau == 1.0 and out.rounds == [len(x) - 1 for x in out.tokens]
    two = e2.generate(t, d, PROMPTS[:2], max_new_tokens=12)  # 2 rows: the 4-token tree
    assert two.tokens == [r for r in ref.tokens[:2]]
    assert all(1 <= a <= 4 for row in two.accept_lengths for a in row)  # depth 2: at most 4 a round


def test_a_corrupt_batch_table_is_one_line(tmp_path, pair):
    t, _ = pair
    src = tmp_path / "h"
    e2.save_draft(tiny_pair(0)[1], str(src), format="eagle")
    (src / "tree.json").write_text(json.dumps({platform(): {"by_batch": {"one": 2}}}))
    with pytest.raises(ValueError, match="by_batch maps batch sizes"):
        resolve_tree(e2.load_draft(str(src), t), batch=1)
