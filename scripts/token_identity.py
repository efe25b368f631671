"""Greedy tokens and accept lengths before and after a change to the core (a check, not a test).

    python scripts/token_identity.py --save /tmp/before.json          # on the old code
    python scripts/token_identity.py --compare /tmp/before.json --out docs/results/x.json   # on the new

The first 20 MT-bench first turns (../shared/data/eval/mt_bench.jsonl), SmolLM2-135M-Instruct with
its shipped head, 96 new tokens, one batch of 20, greedy: plain decoding, EAGLE-2 with the head's CPU
tree (4/4/2) and with the reference tree (5/10/60). --compare writes whether every token and every
accept length is the same.
"""
import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import eagle2_jax as e2  # noqa: E402
from infer.prompts import DEFAULT_QUESTIONS, load_questions, render  # noqa: E402

TREES = {"cpu": e2.TreeConfig(depth=4, top_k=4, total_tokens=2), "reference": e2.TreeConfig(5, 10, 60)}


def run(limit: int, max_new: int) -> dict:
    target = e2.load_target("smollm2-135m-instruct")
    draft = e2.load_draft("smollm2-135m-instruct", target)
    tok = target.tokenizer
    prompts = [render(tok, [{"role": "user", "content": q["turns"][0]}])
               for q in load_questions(DEFAULT_QUESTIONS, limit, None)]
    eos = tok.eos_token_id
    out = {"plain": e2.generate_vanilla(target, prompts, max_new_tokens=max_new, eos_token_id=eos).tokens}
    for name, tree in TREES.items():
        g = e2.generate(target, draft, prompts, max_new_tokens=max_new, eos_token_id=eos, tree=tree)
        out[name] = {"tokens": g.tokens, "accept_lengths": g.accept_lengths}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--save", help="write this run's tokens here")
    ap.add_argument("--compare", help="a file --save wrote: compare this run with it")
    ap.add_argument("--out", help="with --compare: the comparison's JSON")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    now = run(args.limit, args.max_new_tokens)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(now, f)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        report = {"what": f"greedy tokens, first {args.limit} MT-bench first turns, {args.max_new_tokens} new tokens, "
                          f"batch {args.limit}: before and after", "date": str(datetime.date.today()),
                  "command": "python scripts/token_identity.py --compare BEFORE.json",
                  "plain_identical": before["plain"] == now["plain"], "trees": {}}
        for name, tree in TREES.items():
            report["trees"][name] = {"tree": repr(tree), "tokens": sum(map(len, now[name]["tokens"])),
                                     "identical": before[name]["tokens"] == now[name]["tokens"],
                                     "accept_lengths_identical":
                                         before[name]["accept_lengths"] == now[name]["accept_lengths"],
                                     "equal_to_plain": now[name]["tokens"] == now["plain"]}
        print(json.dumps(report, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        ok = report["plain_identical"] and all(t["identical"] and t["accept_lengths_identical"]
                                               for t in report["trees"].values())
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
