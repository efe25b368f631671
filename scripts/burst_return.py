"""Does a lone request draft trees again after a burst? (a measurement, not a test)

    python scripts/burst_return.py

SmolLM2-135M-Instruct with its shipped head and its CPU table (a tree for one busy row, plain rounds
from two), an 8-slot engine: one long greedy request runs alone, then 7 more arrive and run beside it
(plain rounds), then it is alone again. Prints its tokens per round in each phase, the dispatches by
(rows, tree), and whether its tokens equal plain decoding of its prompt alone.
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402

import eagle2_jax as e2  # noqa: E402
from eagle2_jax.serving import Engine  # noqa: E402
from eagle2_jax.serving.plan import calibration_prompts  # noqa: E402


def main():
    target = e2.load_target("smollm2-135m-instruct")
    draft = e2.load_draft("smollm2-135m-instruct", target)
    tok = target.tokenizer
    prompts = calibration_prompts(tok)
    engine = Engine(target, draft, slots=8, max_len=512, eos_token_id=None, rounds_per_dispatch=4, sampling=False)
    engine.warmup()
    long = engine.submit(prompts[0], 300)
    for _ in range(10):
        engine.step()
    alone_before = list(long.accept_lengths)
    burst = [engine.submit(prompts[1 + i % 3], 40) for i in range(7)]
    while not all(r.finished for r in burst):
        engine.step()
    during = long.accept_lengths[len(alone_before):]
    mark = len(long.accept_lengths)
    engine.run()
    after = long.accept_lengths[mark:]
    want = e2.generate_vanilla(target, [prompts[0]], max_new_tokens=300).tokens[0]
    print(json.dumps({
        "plan": engine.describe_plan(),
        "tokens_per_round_alone_before": round(float(np.mean(alone_before)), 3),
        "tokens_per_round_during_burst": round(float(np.mean(during)), 3),
        "tokens_per_round_alone_after": round(float(np.mean(after)), 3) if after else None,
        "rounds": [len(alone_before), len(during), len(after)],
        "dispatches": {f"{rows} rows, {'plain' if t is None else f'{t.depth}/{t.top_k}/{t.total_tokens}'}": n
                       for (rows, t), n in engine.dispatches.items()},
        "equal_to_plain_decoding": long.tokens == want}, indent=1))


if __name__ == "__main__":
    main()
