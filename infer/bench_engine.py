"""Benchmark the serving engine in process (no HTTP, token ids): EAGLE vs vanilla mode at fixed
concurrency, for models without a tokenizer (random weights of a published shape) and accelerators.

    python -m infer.bench_engine --model random:llama-3.1-8b --draft random --dtype bfloat16 \
        --concurrency 1,8,32 --requests 32 --max-tokens 128

For each mode, an Engine with --max-batch slots is warmed up (compile seconds reported apart), then
for each concurrency c a closed loop keeps c requests busy (random prompt ids of --prompt-len
tokens, greedy) until --requests have finished; reported: completion tokens/s, dispatches, and
wall time per dispatched round. JSON and markdown under --out. The figures are the engine's own
(scheduling, prefill, insert and rounds), without the HTTP layer `infer.bench_serve` adds.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from eagle2_jax.decoding.programs import enable_compile_cache
from eagle2_jax.serving import Engine
from infer.cli import (Parser, add_backend_args, add_model_args, load_models, positive_int, positive_ints,
                       writable_dir)


def parse(argv=None):
    ap = Parser(prog="python -m infer.bench_engine", description=__doc__)
    add_model_args(ap)
    ap.add_argument("--modes", default="eagle,vanilla", help="comma list of engine modes (default eagle,vanilla)")
    ap.add_argument("--concurrency", type=positive_ints, default="1,4,8", help="requests kept busy (default 1,4,8)")
    ap.add_argument("--requests", type=positive_int, default=16, help="requests finished per load (default 16)")
    ap.add_argument("--max-tokens", type=positive_int, default=128, help="completion tokens per request (default 128)")
    ap.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens (random ids; default 64)")
    ap.add_argument("--max-batch", type=positive_int, default=None, help="engine slots (default: the largest load)")
    ap.add_argument("--rounds-per-dispatch", type=positive_int, default=4, help="(default 4)")
    ap.add_argument("--out", type=writable_dir, default="runs/bench_engine", help="output directory")
    add_backend_args(ap, attention=False, gpu_graphs=False)
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or any(m not in ("eagle", "vanilla") for m in args.modes):
        ap.error(f"--modes takes eagle and/or vanilla, got {','.join(args.modes)!r}")
    return args


def closed_loop(engine: Engine, prompts, concurrency: int, requests: int, max_tokens: int) -> dict:
    """Keep `concurrency` requests busy until `requests` have finished; the figures of that load."""
    before = sum(engine.dispatches.values())
    pending = list(prompts[:requests])
    live, done = [], []
    t0 = time.perf_counter()
    while len(done) < requests:
        while pending and len(live) < concurrency:
            live.append(engine.submit(pending.pop(), max_tokens))
        engine.step()
        done += [r for r in live if r.finished]
        live = [r for r in live if not r.finished]
    wall = time.perf_counter() - t0
    tokens = sum(len(r.tokens) for r in done)
    rounds = sum(len(r.accept_lengths) for r in done)
    return dict(concurrency=concurrency, requests=len(done), completion_tokens=tokens, wall_s=wall,
                tokens_per_s=tokens / wall, dispatches=sum(engine.dispatches.values()) - before,
                mean_rounds_per_request=rounds / max(len(done), 1),
                tau=sum(sum(r.accept_lengths) for r in done) / max(rounds, 1))  # the prefill's token is no round's


def main(argv=None):
    args = parse(argv)
    enable_compile_cache()
    target, draft = load_models(args, need_draft=True)
    rng = np.random.default_rng(0)
    V = target.config.vocab_size
    prompts = [rng.integers(0, V, args.prompt_len).tolist() for _ in range(args.requests)]
    slots = args.max_batch or max(args.concurrency)
    rows, meta = [], dict(model=args.model, draft=args.draft, dtype=args.dtype, slots=slots, max_tokens=args.max_tokens,
                          prompt_len=args.prompt_len, requests=args.requests, date=time.strftime("%Y-%m-%d"))
    os.makedirs(args.out, exist_ok=True)
    for mode in args.modes:
        engine = Engine(target, draft, slots=slots, max_len=args.prompt_len + args.max_tokens, mode=mode,
                        rounds_per_dispatch=args.rounds_per_dispatch, sampling=False)
        t0 = time.perf_counter()
        n = engine.warmup()
        compile_s = time.perf_counter() - t0
        print(f"{mode}: {n} programs warmed up in {compile_s:.1f} s; plan {engine.describe_plan()}", flush=True)
        for c in args.concurrency:
            r = dict(mode=mode, warmup_s=compile_s, **closed_loop(engine, prompts, c, args.requests, args.max_tokens))
            rows.append(r)
            print(f"{mode}, concurrency {c}: {r['tokens_per_s']:.1f} tokens/s, tau {r['tau']:.2f}, "
                  f"{r['dispatches']} dispatches", flush=True)
            with open(os.path.join(args.out, "bench_engine.json"), "w") as f:  # rewritten as it goes
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = ["| mode | concurrency | tokens/s | tokens per round | dispatches | warm-up s |", "|" + "---|" * 6]
    lines += [f"| {r['mode']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['tau']:.2f} | {r['dispatches']} | "
              f"{r['warmup_s']:.0f} |" for r in rows]
    if set(args.modes) == {"eagle", "vanilla"}:
        lines += ["", "| concurrency | eagle tokens/s over vanilla |", "|---|---|"]
        for c in args.concurrency:
            e, v = (next(r for r in rows if r["mode"] == m and r["concurrency"] == c) for m in ("eagle", "vanilla"))
            lines.append(f"| {c} | {e['tokens_per_s'] / v['tokens_per_s']:.2f}x |")
    with open(os.path.join(args.out, "bench_engine.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
