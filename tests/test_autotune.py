"""--total-tokens auto: expected tau grows with the tree, the choice is one of the candidates."""
import pytest

from eagle2_jax import TreeConfig, generate, generate_vanilla
from eagle2_jax.decoding.autotune import choose_tree
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


@pytest.mark.slow  # keeps the default suite within its time (README, top)
def test_calibration_reads_off_what_every_smaller_tree_accepts():
    """autotune's measured acceptance: a round of the big tree, read for size n, must equal a real
    round of the n-node tree from the same state (row by row, over several states of a walk)."""
    import numpy as np
    from eagle2_jax.decoding.autotune import ACCEPT_RANKS
    from eagle2_jax.config import SamplingConfig
    from eagle2_jax.decoding.eagle import STEP, start
    from eagle2_jax.decoding.sampling import SamplingParams
    from eagle2_jax.decoding.spec import RoundSpec, params_of
    t, d, _ = permutation_oracle(0, layer_scale=1.5)  # partly predictable: acceptance varies with n
    big, sizes = TreeConfig(3, 3, 20), (2, 3, 4, 8, 20)
    s = SamplingConfig()
    params = params_of(t, d)
    st, _ = start(t, d, [[1, 2, 3], [4, 5], [7, 8, 9, 10], [11]], max_new_tokens=32, tree=big, sampling=s)
    seen = set()
    for _ in range(3):
        ranks, _, act = (np.asarray(x) for x in ACCEPT_RANKS(params, st, spec=RoundSpec.of(t, d, big)))
        rows, r0 = np.arange(len(act)), np.asarray(st.rounds_B)
        for n in sizes:
            real = STEP(params, st, SamplingParams.of(s), spec=RoundSpec.of(t, d, TreeConfig(3, 3, n)))
            got = np.asarray(real.accept_BR)[rows, r0]
            want = 1 + (ranks < n - 1).sum(axis=1)
            assert np.array_equal(got[act], want[act]), (n, got, want)
            seen.update(want[act].tolist())
        st = STEP(params, st, SamplingParams.of(s), spec=RoundSpec.of(t, d, big))
    assert len(seen) >= 3  # the check covered different acceptance lengths
