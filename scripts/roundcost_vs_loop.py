"""infer.roundcost's round time against the decode loop's own time per round, on the CPU defaults.

What: the shipped SmolLM2 target and head with the head's tree for this platform, the first MT-bench
first turn; roundcost's `measure` times the round program (the best of 20 calls on one
mid-generation state), and the generation loop's time per round is (best run of 320 new tokens -
best run of 1) / rounds, EOS off. Writes a small JSON (docs/results/roundcost_vs_loop.json holds
three runs). Takes about a minute on the 2-core dev machine.

    python scripts/roundcost_vs_loop.py out.json
"""
import json
import sys

import eagle2_jax as e2
from eagle2_jax.decoding.autotune import resolve_tree
from infer.prompts import DEFAULT_QUESTIONS, load_questions, render
from infer.roundcost import measure

target = e2.load_target("smollm2-135m-instruct")
draft = e2.load_draft("smollm2-135m-instruct", target)
tree = resolve_tree(draft)
q = load_questions(DEFAULT_QUESTIONS, 1, None)[0]
prompt = render(target.tokenizer, [{"role": "user", "content": q["turns"][0]}])
rows = measure(target, draft, [prompt], tree.depth, tree.top_k, [tree.total_tokens], repeats=20, max_new=320,
               calibration_rounds=4, parts="round")


def best_run(n, tries=8):
    """(best seconds, rounds) of a generation of n new tokens."""
    best = None
    for _ in range(tries):
        tm = {}
        out = e2.generate(target, draft, [prompt], max_new_tokens=n, eos_token_id=None, tree=tree, timings=tm)
        if best is None or tm["run_s"] < best[0]:
            best = (tm["run_s"], out.rounds[0])
    return best


(t1, r1), (t2, r2) = best_run(1), best_run(320)
loop_ms = (t2 - t1) / (r2 - r1) * 1e3
res = dict(tree=str(tree), prompt_tokens=len(prompt), roundcost_round_ms=rows[0]["round_ms"], loop_round_ms=loop_ms,
           loop=dict(max_new=[1, 320], run_s=[t1, t2], rounds=[r1, r2]), ratio=rows[0]["round_ms"] / loop_ms)
print(json.dumps(res, indent=1))
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)
