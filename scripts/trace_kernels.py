"""Kernel times of a plain decoding step and of an EAGLE-2 round on the device at hand, from the JAX
profiler: what `infer.analytic.GPU_KERNEL_FLOOR_S` (2.5 us a kernel, fitted to one run) stands for,
measured. scripts/gpu_bench.sh (call a) runs it on a lent GPU; docs/performance.md ("The round at 8B
scale") says what it is for.

    PYTHONPATH=. python scripts/trace_kernels.py --model random:llama-3.1-8b --dtype bfloat16 --total-tokens 60 --out DIR

Each program (the step as `vanilla.STREAM_STEP`, the round as `infer.phases.ROUND`, the round program
infer.roundcost times, both donating their state as generation does) runs twice untraced, then --trips
times under `jax.profiler.trace(DIR/<program>)`, each trip timed on the host. DIR/kernels.json gets, per
program: the wall time per trip, the device events per trip (on a GPU the kernels and copies of the
device planes; elsewhere the XLA ops of the host threads, so a CPU dry run exercises the same code)
with their summed and median durations, how many last under 5 us and what they sum to, and the idle
time between them ((wall - busy) / events). The raw traces stay under DIR for a closer look. Compare
events per trip with the compiled kernel count (`infer.roundcost --analytic --compile-for h200`:
~624 a step, ~734 a round at batch 1): far fewer means the profiler saw CUDA graphs, not their kernels.

Time: not timed on its own; scripts/gpu_bench.sh gives it at most 90 s at the 8B shape on a GPU,
most of it the two compiles unless the compile cache already holds them.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time


def device_events(trace_dir):
    """Durations (ns) of the events a traced run put on the device planes, or, with no device plane
    (CPU), of the XLA ops on the host's XLA threads."""
    from jax.profiler import ProfileData
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    planes = list(ProfileData.from_file(path).planes)
    dev = [line for p in planes if p.name.startswith("/device:") for line in p.lines]
    streams = [line for line in dev if line.name.startswith("Stream")]  # (not "XLA Modules"/"XLA Ops",
    if streams or dev:                                                   # which span the kernels again)
        return [ev.duration_ns for line in (streams or dev) for ev in line.events], "device streams"
    return [ev.duration_ns for p in planes for line in p.lines if line.name.startswith("tf_XLA")
            for ev in line.events if not ev.name.startswith(("ThunkExecutor", "end: "))], "host XLA threads"


def summarise(durations_ns, walls_s, trips):
    n = len(durations_ns) / trips
    busy = sum(durations_ns) / trips / 1e3
    wall = statistics.median(walls_s) * 1e6
    small = [d for d in durations_ns if d < 5_000]
    return {"trips": trips, "wall_us": wall, "events_per_trip": n, "busy_us": busy,
            "median_event_us": statistics.median(durations_ns) / 1e3 if durations_ns else 0.0,
            "events_under_5us_per_trip": len(small) / trips, "under_5us_busy_us": sum(small) / trips / 1e3,
            "idle_between_events_us": (wall - busy) / n if n else 0.0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--total-tokens", type=int, default=60)
    ap.add_argument("--trips", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    import jax
    import numpy as np
    import eagle2_jax as e2
    from eagle2_jax.decoding import eagle, vanilla
    from eagle2_jax.decoding.autotune import fresh_copy
    from eagle2_jax.config import SamplingConfig, TreeConfig
    from eagle2_jax.decoding.sampling import SamplingParams
    from eagle2_jax.decoding.spec import RoundSpec, params_of
    from infer import phases

    target = e2.load_target(a.model, dtype=a.dtype)
    draft = e2.load_draft("random", target)  # (a 32,000-token draft vocabulary for larger vocabularies, as roundcost's)
    V = target.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, V, a.prompt_len).tolist() for _ in range(a.batch)]
    tree, s = TreeConfig(a.depth, a.top_k, a.total_tokens), SamplingConfig()
    greedy = SamplingParams.of(s)
    params, plain_params = params_of(target, draft), params_of(target)
    spec, plain_spec = RoundSpec.of(target, draft, tree), RoundSpec.of(target)
    programs = {
        "step": (lambda st: vanilla.STREAM_STEP(plain_params, st, greedy, spec=plain_spec),
                 vanilla.start(target, prompts, max_new_tokens=a.max_new_tokens, sampling=s)[0]),
        "round": (lambda st: phases.ROUND(params, st, greedy, spec=spec),
                  eagle.start(target, draft, prompts, max_new_tokens=a.max_new_tokens, tree=tree, sampling=s)[0]),
    }
    os.makedirs(a.out, exist_ok=True)
    report = {"model": a.model, "dtype": a.dtype, "batch": a.batch, "prompt_len": a.prompt_len,
              "tree": [a.depth, a.top_k, a.total_tokens], "device": str(jax.devices()[0])}
    for name, (fn, st0) in programs.items():
        for _ in range(2):  # compile and warm
            jax.block_until_ready(fn(fresh_copy(st0)))
        states = [fresh_copy(st0) for _ in range(a.trips)]
        walls = []
        with jax.profiler.trace(os.path.join(a.out, name)):
            for st in states:
                t0 = time.perf_counter()
                jax.block_until_ready(fn(st))
                walls.append(time.perf_counter() - t0)
        durations, source = device_events(os.path.join(a.out, name))
        report[name] = {**summarise(durations, walls, a.trips), "events_from": source}
        r = report[name]
        print(f"{name}: wall {r['wall_us']:.0f} us, {r['events_per_trip']:.0f} events ({source}) busy "
              f"{r['busy_us']:.0f} us, median {r['median_event_us']:.1f} us, {r['events_under_5us_per_trip']:.0f} "
              f"under 5 us ({r['under_5us_busy_us']:.0f} us), idle {r['idle_between_events_us']:.2f} us between events",
              flush=True)
        with open(os.path.join(a.out, "kernels.json"), "w") as f:  # after each program: a run cut off keeps it
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
