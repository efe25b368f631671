"""Benchmark OpenAI-compatible servers (python -m infer.serve, or any other) over MT-bench prompts.

    python -m infer.bench_serve --launch eagle,vanilla --concurrency 1,4,8 --limit 16
    python -m infer.serve &                                  # or a server already running
    python -m infer.bench_serve --url http://127.0.0.1:8000 --concurrency 1,4,8

--launch starts `python -m infer.serve --mode M` on 127.0.0.1 for each mode in turn (one at a time,
so servers never share the machine; --server-args passes it more flags), waits for its warm-up,
runs every load against it and stops it. For each load (a fixed number of clients, or Poisson
arrivals at each of --rate's request rates, as vllm bench serve and sglang.bench_serving send them)
every request is a streamed chat completion at temperature 0;
reported per server and load: completion tokens/s over the wall time, requests/s, time to first
token and inter-token latency (p50 / p99), and the XLA compiles the server made during the load
(read from its /metrics; 0 after warm-up). With two servers the table gives the first's tokens/s
over the second's. Writes JSON, markdown and PNG under --out; the quantities SGLang's bench_serving
reports. Request loops are bounded: each load sends --limit requests and stops.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

from infer.cli import Parser, fail, positive_float, positive_floats, positive_int, positive_ints, writable_dir
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
    ap.add_argument("--rate", type=positive_floats, default=None,
                    help="instead: Poisson arrivals at these request rates per second, one load each "
                         "(a comma list, e.g. 0.25,0.5,1)")
    ap.add_argument("--timeout", type=positive_float, default=600, help="seconds a request may take (default 600)")
    ap.add_argument("--out", type=writable_dir, default="runs/bench_serve", help="output directory")
    ap.add_argument("--launch", default=None,
                    help="comma list of infer.serve modes (eagle, vanilla) to start in turn on 127.0.0.1 and "
                         "benchmark, instead of --url")
    ap.add_argument("--server-args", default="--max-batch 8 --max-model-len 512",
                    help="more infer.serve flags for --launch (default '--max-batch 8 --max-model-len 512')")
    ap.add_argument("--startup-timeout", type=positive_float, default=1200,
                    help="seconds a launched server may take to compile and start (default 1200)")
    args = ap.parse_args(argv)
    if args.launch:
        modes = [m for m in args.launch.split(",") if m]
        if not modes or any(m not in ("eagle", "vanilla") for m in modes):
            ap.error(f"--launch takes modes among eagle, vanilla, got {args.launch!r}")
        args.launch = modes
    return args


def compiles(url):
    """The server's eagle2_xla_compiles metric, or None where it has none."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("eagle2_xla_compiles "):
                    return float(line.split()[-1])
    except OSError:
        return None
    return None


def plan(url):
    """The server's plan now, {busy rows: tokens per round (1: plain)}, from eagle2_plan_tokens; None if absent."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            out = {}
            for line in r.read().decode().splitlines():
                if line.startswith('eagle2_plan_tokens{rows="'):
                    out[int(line.split('"')[1])] = int(float(line.split()[-1]))
            return dict(sorted(out.items())) or None
    except OSError:
        return None


def launch(mode, server_args, timeout):
    """Start `python -m infer.serve --mode mode` on a free 127.0.0.1 port; (process, url) once it answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "infer.serve", "--mode", mode, "--host", "127.0.0.1", "--port", str(port),
           *shlex.split(server_args)]
    print("starting: " + " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            fail(f"the {mode} server exited with code {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return proc, url
        except OSError:
            time.sleep(1)
    proc.terminate()
    fail(f"the {mode} server did not start in {timeout:.0f} s")


def stop(proc):
    proc.terminate()  # SIGTERM: uvicorn drains and the engine thread ends
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


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


def bench_server(url, args, prompts, label):
    """Every load against one server; rows labelled `label`."""
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            model = args.model or json.loads(r.read())["data"][0]["id"]
    except OSError as e:
        fail(f"no server at {url}: {e}")
    loads = [dict(rate=r) for r in args.rate] if args.rate else [dict(concurrency=c) for c in args.concurrency]
    rows = []
    for load in loads:
        before = compiles(url)
        r = run_load(url, model, prompts, args.max_tokens, args.timeout, **load)
        after = compiles(url)
        r.update(server=label, model=model, compiles=None if before is None or after is None else after - before,
                 plan=plan(url))
        rows.append(r)
        print(f"{label}, {'rate ' + str(r['rate']) if r['rate'] else 'concurrency ' + str(r['concurrency'])}: "
              f"{r['tokens_per_s']:.1f} tokens/s, {r['requests_per_s']:.2f} req/s, TTFT p50 {r['ttft_ms_p50']:.0f} ms "
              f"p99 {r['ttft_ms_p99']:.0f} ms, ITL p50 {r['itl_ms_p50']:.1f} ms p99 {r['itl_ms_p99']:.1f} ms, "
              f"compiles {r['compiles']}", flush=True)
    return rows


def load_name(r):
    return f"rate {r['rate']}/s" if r["rate"] else f"{r['concurrency']} clients"


def write(rows, meta, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_serve.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    servers = list(dict.fromkeys(r["server"] for r in rows))
    lines = ["| server | load | tokens/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | compiles |",
             "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['server']} | {load_name(r)} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | "
                     f"{r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | {r['itl_ms_p50']:.1f} | {r['itl_ms_p99']:.1f} | "
                     f"{'-' if r['compiles'] is None else int(r['compiles'])} |")
    if len(servers) == 2:
        a, b = servers
        lines += ["", f"| load | {a} tokens/s over {b} tokens/s |", "|---|---|"]
        for ra in (r for r in rows if r["server"] == a):
            rb = next(r for r in rows if r["server"] == b and load_name(r) == load_name(ra))
            lines.append(f"| {load_name(ra)} | {ra['tokens_per_s'] / rb['tokens_per_s']:.2f}x |")
    with open(os.path.join(out, "bench_serve.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:  # optional: the figure only
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return lines
    loads = list(dict.fromkeys(load_name(r) for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(servers)
    for i, srv in enumerate(servers):
        ys = [next((r["tokens_per_s"] for r in rows if r["server"] == srv and load_name(r) == ld), 0) for ld in loads]
        ax.bar(np.arange(len(loads)) + i * width, ys, width, label=srv)
    ax.set_xticks(np.arange(len(loads)) + width * (len(servers) - 1) / 2, loads)
    ax.set_ylabel("completion tokens/s")
    ax.set_title(f"{meta.get('model', '')}: {meta['max_tokens']} tokens per request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bench_serve.png"), dpi=120)
    plt.close(fig)
    return lines


def main(argv=None):
    args = parse(argv)
    qs = load_questions(args.questions, args.limit, None)
    if not qs:
        fail("no questions selected")
    prompts = [q["turns"][0] for q in qs]
    rows = []
    if args.launch:
        for mode in args.launch:
            proc, url = launch(mode, args.server_args, args.startup_timeout)
            try:
                rows += bench_server(url, args, prompts, mode)
            finally:
                stop(proc)
    else:
        rows = bench_server(args.url, args, prompts, args.url)
    meta = dict(url=None if args.launch else args.url, launch=args.launch, server_args=args.server_args if args.launch
                else None, model=rows[0]["model"], questions=args.questions, limit=args.limit,
                max_tokens=args.max_tokens, date=time.strftime("%Y-%m-%d"))
    for line in write(rows, meta, args.out):
        print(line)
    print(f"wrote {args.out}/bench_serve.json, bench_serve.md, bench_serve.png")


if __name__ == "__main__":
    main()
