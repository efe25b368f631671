"""--total-tokens auto: expected tau grows with the tree, the choice is one of the candidates."""
from eagle2_jax import TreeConfig, generate, generate_vanilla
from eagle2_jax.autotune import choose_tree
from helpers import permutation_oracle


def test_choose_tree_oracle():
    t, d, _ = permutation_oracle(0, layer_scale=1.0)
    prompts = [[1, 2, 3], [4, 5]]
    choice = choose_tree(t, d, prompts, depth=3, top_k=2, candidates=(2, 4, 8), calibration_rounds=3,
                         max_new_tokens=16)
    taus = [r["expected_tau"] for r in choice.table]
    assert [r["total_tokens"] for r in choice.table] == [2, 4, 8]
    assert taus == sorted(taus) and taus[0] >= 1.0
    assert all(r["round_ms"] > 0 for r in choice.table)
    assert isinstance(choice.tree, TreeConfig) and choice.tree.total_tokens in (2, 4, 8)
    # the chosen tree is still lossless
    ref = generate_vanilla(t, prompts, max_new_tokens=12).tokens
    assert generate(t, d, prompts, max_new_tokens=12, tree=choice.tree).tokens == ref
