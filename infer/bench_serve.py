"""Benchmark a running OpenAI-compatible server (python -m infer.serve, or any other) over MT-bench prompts.

    python -m infer.serve &                                  # in another shell: the server under test
    python -m infer.bench_serve --url http://127.0.0.1:8000 --concurrency 1,4,8 --limit 16

For each load (a fixed number of clients, or Poisson arrivals at --rate requests/s) every request is a
streamed chat completion at temperature 0; reported per load: completion tokens/s over the wall
time, requests/s, time to first token and inter-token latency (p50 / p99). Writes JSON and a
markdown table under --out; the same quantities SGLang's bench_serving reports. Request loops are
bounded: each load sends --limit requests and stops.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import threading
import time
import urllib.request

import numpy as np

from infer.cli import Parser, fail, positive_float, positive_int, positive_ints, writable_dir
from infer.prompts import DEFAULT_QUESTIONS, load_questions


def parse(argv=None):
    ap = Parser(prog="python -m infer.bench_serve", description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    ap.add_argument("--model", default=None, help="model id to ask for (default: the server's first)")
    ap.add_argument("--questions", default=DEFAULT_QUESTIONS, help="EAGLE/MT-bench jsonl; first turns are the prompts")
    ap.add_argument("--limit", type=positive_int, default=16, help="requests per load (default 16)")
    ap.add_argument("--max-tokens", type=positive_int, default=128, help="completion tokens per request (default 128)")
    ap.add_argument("--concurrency", type=positive_ints, default="1,4,8",
                    help="comma list of client counts, one load each (default 1,4,8)")
    ap.add_argument("--rate", type=positive_float, default=None,
                    help="instead: Poisson arrivals at this many requests/s (one load)")
    ap.add_argument("--timeout", type=positive_float, default=600, help="seconds a request may take (default 600)")
    ap.add_argument("--out", type=writable_dir, default="runs/bench_serve", help="output directory")
    return ap.parse_args(argv)


def stream_one(url, model, prompt, max_tokens, timeout):
    """One streamed chat completion: (start, arrival time of each content chunk, completion tokens)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0, times, tokens = time.perf_counter(), [], 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return t0, times, tokens


def run_load(url, model, prompts, max_tokens, timeout, concurrency=None, rate=None, seed=0):
    """Send every prompt (bounded: len(prompts) requests) with `concurrency` clients, or arrivals
    of a Poisson process at `rate`; returns the per-load figures."""
    results, lock = [], threading.Lock()
    rng = random.Random(seed)

    def one(p):
        r = stream_one(url, model, p, max_tokens, timeout)
        with lock:
            results.append(r)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency or len(prompts)) as pool:
        futures = []
        for p in prompts:
            if rate is not None:
                time.sleep(rng.expovariate(rate))
            futures.append(pool.submit(one, p))
        for f in futures:
            f.result()
    wall = time.perf_counter() - start
    ttft = [ts[0] - t0 for t0, ts, _ in results if ts]
    itl = [b - a for _, ts, _ in results for a, b in zip(ts, ts[1:])]  # between streamed chunks
    tokens = sum(n for _, _, n in results)
    pct = lambda xs, q: float(np.percentile(xs, q) * 1e3) if xs else None  # noqa: E731
    return dict(concurrency=concurrency, rate=rate, requests=len(results), wall_s=wall,
                requests_per_s=len(results) / wall, completion_tokens=tokens, tokens_per_s=tokens / wall,
                ttft_ms_p50=pct(ttft, 50), ttft_ms_p99=pct(ttft, 99), itl_ms_p50=pct(itl, 50), itl_ms_p99=pct(itl, 99))


def main(argv=None):
    args = parse(argv)
    qs = load_questions(args.questions, args.limit, None)
    if not qs:
        fail("no questions selected")
    prompts = [q["turns"][0] for q in qs]
    try:
        with urllib.request.urlopen(args.url + "/v1/models", timeout=30) as r:
            model = args.model or json.loads(r.read())["data"][0]["id"]
    except OSError as e:
        fail(f"no server at {args.url}: {e}")
    loads = [dict(rate=args.rate)] if args.rate else [dict(concurrency=c) for c in args.concurrency]
    rows = []
    for load in loads:
        rows.append(run_load(args.url, model, prompts, args.max_tokens, args.timeout, **load))
        r = rows[-1]
        print(f"{'rate ' + str(r['rate']) if r['rate'] else 'concurrency ' + str(r['concurrency'])}: "
              f"{r['tokens_per_s']:.1f} tokens/s, {r['requests_per_s']:.2f} req/s, TTFT p50 {r['ttft_ms_p50']:.0f} ms "
              f"p99 {r['ttft_ms_p99']:.0f} ms, ITL p50 {r['itl_ms_p50']:.1f} ms p99 {r['itl_ms_p99']:.1f} ms", flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(url=args.url, model=model, questions=args.questions, limit=args.limit, max_tokens=args.max_tokens)
    with open(os.path.join(args.out, "bench_serve.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = ["| load | tokens/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |", "|" + "---|" * 7]
    for r in rows:
        load = f"rate {r['rate']}/s" if r["rate"] else f"{r['concurrency']} clients"
        lines.append(f"| {load} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | {r['ttft_ms_p50']:.0f} | "
                     f"{r['ttft_ms_p99']:.0f} | {r['itl_ms_p50']:.1f} | {r['itl_ms_p99']:.1f} |")
    with open(os.path.join(args.out, "bench_serve.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}/bench_serve.json, bench_serve.md")


if __name__ == "__main__":
    main()
