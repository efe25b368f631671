"""What a plain round's draft catch-up costs (a measurement, not a test): the serving engine's plain
rounds with the draft fed the committed token (what lets rows draft again after a burst) against
plain rounds that leave the draft behind (what the vanilla server runs), per busy-row count.

    python scripts/plain_catch_up_cost.py --rows 1,8 --max-len 512

SmolLM2-135M-Instruct and its head; each figure is the best of 5 dispatches of 4 rounds over that many
busy rows (the engine's ROUNDS program, its state donated, a fresh copy per call; compile excluded).
Prints one JSON line per row count.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import eagle2_jax as e2  # noqa: E402
from eagle2_jax.config import SamplingConfig  # noqa: E402
from eagle2_jax.decoding.eagle import PREFILL  # noqa: E402
from eagle2_jax.decoding.sampling import SamplingParams  # noqa: E402
from eagle2_jax.decoding.spec import RoundSpec  # noqa: E402
from eagle2_jax.serving import Engine  # noqa: E402
from eagle2_jax.serving.plan import calibration_prompts, time_rounds  # noqa: E402
from eagle2_jax.serving.slots import ROUNDS  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--max-len", type=int, default=512)
    args = ap.parse_args(argv)
    target = e2.load_target("smollm2-135m-instruct")
    draft = e2.load_draft("smollm2-135m-instruct", target)
    rows = [int(r) for r in args.rows.split(",")]
    engine = Engine(target, draft, slots=max(rows), max_len=args.max_len, plan={1: None})
    prompt = calibration_prompts(target.tokenizer)[0]
    greedy = SamplingParams.of(SamplingConfig())
    for b in rows:
        a, static = engine._prefill_args([prompt] * b, args.max_len - len(prompt), 0, SamplingConfig())
        busy = PREFILL(*a, **static)
        ms = {}
        for catch_up in (False, True):
            spec = RoundSpec.of(target, draft, None, catch_up=catch_up)
            ms[catch_up] = time_rounds(lambda s: ROUNDS(engine.params, s, greedy, spec=spec, max_rounds=4)[0], busy,
                                       repeats=5)
        print(json.dumps({"rows": b, "plain_round_ms": round(ms[False], 2), "with_catch_up_ms": round(ms[True], 2),
                          "ratio": round(ms[True] / ms[False], 3)}), flush=True)


if __name__ == "__main__":
    main()
