"""Where a round's time goes on the CPU: per-XLA-op totals of one EAGLE-2 round against one plain
step, SmolLM2-135M-Instruct with the shipped head. Behind the op-by-op CPU figures of
docs/performance.md ("CPU backend") and the head's MEASUREMENTS.md.

    PYTHONPATH=. python scripts/profile_round.py [--batch 1] [--total-tokens 2] [--depth 4] [--top-k 4]
        [--steps 10] [--timeline] [--timeline-min-ms 0.2] [--timeline-until-ms INF] [--by-shape]

Traces --steps donated rounds (and plain steps) with the JAX profiler on a mid-generation state
of the shipped SmolLM2 head and prints, per program, the wall time of each traced execution, the
total per op kind (XLA threads only) and the top events (ms per step). Op names are XLA's
fusion/thunk names; `ffi_call` is the few-row kernel on the CPU backend. --timeline lists, in start
order, the events of the slowest traced execution (for finding gaps and slow layers). --by-shape
groups the kernel calls by operand shapes (x rows x K, the weight with its dtype, `q4` / `q8`: packed
weights, `T`: a tied LM head) and lists the costliest other ops with their HLO text, read from the
compiled program.

Time: not timed (the model load, two compiles, 8 untraced rounds, then --steps traced runs of each
program; a plain step is ~30 ms on a 2-core CPU).
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import tempfile


def _events(trace_dir):
    """(plane, line, name, start_ns, duration_ns) of every traced event."""
    from jax.profiler import ProfileData
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    return [(plane.name, line.name, ev.name, ev.start_ns, ev.duration_ns)
            for plane in ProfileData.from_file(path).planes for line in plane.lines for ev in line.events]


def _report(evs, steps, top, timeline, min_ms, until_ms):
    xla = [e for e in evs if e[1].startswith("tf_XLA")]
    execs = sorted((e for e in xla if e[2] == "ThunkExecutor::Execute" and e[4] > 1e6), key=lambda e: e[3])
    print("executions over 1 ms (wall ms):", " ".join(f"{e[4] / 1e6:.1f}" for e in execs))
    kinds = collections.Counter()
    for e in xla:
        if not e[2].startswith(("ThunkExecutor", "end: ")):
            kinds[re.sub(r"[.]\d+$", "", e[2])] += e[4]
    print("per op kind (ms per step):", ", ".join(f"{k} {v / steps / 1e6:.2f}" for k, v in kinds.most_common(12)))
    per = collections.Counter()
    for e in evs:
        per[(e[1], e[2])] += e[4]
    for (line, op), ns in per.most_common(top):
        print(f"{ns / steps / 1e6:9.3f}  {op[:90]}  [{line[:30]}]")
    if timeline and execs:
        slow = max(execs, key=lambda e: e[4])
        t0, t1 = slow[3], slow[3] + slow[4]
        print(f"timeline of the slowest execution ({slow[4] / 1e6:.1f} ms): start ms, +duration ms, thread, op")
        for e in sorted((e for e in xla if t0 <= e[3] <= t1), key=lambda e: e[3]):
            if e[4] >= min_ms * 1e6 and (e[3] - t0) / 1e6 <= until_ms and not e[2].startswith("end: "):
                print(f"{(e[3] - t0) / 1e6:8.2f} +{e[4] / 1e6:6.2f}  {e[1][-8:]}  {e[2]}")


_FFI_LINE = re.compile(r"%(ffi_call(?:\.\d+)?) = [^\n]*")
_KERNEL = {"eagle2_few_row_matmul": "", "eagle2_q4_matmul": "q4 ", "eagle2_q8_matmul_nt": "q8 T ",
           "eagle2_few_row_attention": "attention "}


def _ffi_shapes(hlo_text):
    """ffi_call name -> (x, w) labels: operand shapes of each kernel call in the compiled HLO."""
    out = {}
    for m in _FFI_LINE.finditer(hlo_text):
        line = m.group(0)
        target = re.search(r'custom_call_target="(\w+)"', line)
        ops = line.split("operand_layout_constraints=", 1)[-1]
        shapes = re.findall(r"(\w+)\[([\d,]*)\]\{", ops)
        if not target or len(shapes) < 2:
            continue
        kind = _KERNEL.get(target.group(1), target.group(1) + " ")
        t = "T" if re.search(r"transpose_w = true", line) else ""
        out[m.group(1)] = (kind + shapes[0][1], shapes[1][0] + "[" + shapes[1][1] + "]" + t)
    return out


def _by_shape(evs, steps, hlo_text, top):
    """Kernel calls per operand shapes, then the costliest other ops with their HLO lines."""
    shape_of = _ffi_shapes(hlo_text)
    lines = {m.group(1): m.group(0)[:200] for m in re.finditer(r"%([\w.-]+) = [^\n]*", hlo_text)}
    calls, other = collections.defaultdict(list), collections.Counter()
    for _, line, name, _, dur in evs:
        if not line.startswith("tf_XLA") or name.startswith(("ThunkExecutor", "end: ", "Threadpool")):
            continue
        if name.startswith("ffi_call"):
            calls[shape_of.get(name, ("?", "?"))].append(dur / 1e6)
        else:
            other[name] += dur / 1e6 / steps
    print("kernel calls by shape: x [rows, K], w; calls per step, median ms, ms per step")
    for (x, w), ds in sorted(calls.items(), key=lambda kv: -sum(kv[1])):
        ds.sort()
        print(f"  x[{x}] {w}: {len(ds) // steps}, {ds[len(ds) // 2]:.3f}, {sum(ds) / steps:.2f}")
    print(f"other ops (ms per step): {sum(other.values()):.2f} in all; the costliest:")
    for name, ms in other.most_common(top):
        print(f"  {ms:6.3f}  {lines.get(name, name)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--total-tokens", type=int, default=2)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=20, help="events listed per program")
    ap.add_argument("--timeline", action="store_true", help="list the slowest execution's events in order")
    ap.add_argument("--timeline-min-ms", type=float, default=0.2)
    ap.add_argument("--timeline-until-ms", type=float, default=float("inf"))
    ap.add_argument("--by-shape", action="store_true",
                    help="kernel calls by operand shapes and the costliest other ops with their HLO")
    args = ap.parse_args(argv)
    import jax
    from eagle2_jax import load_draft, load_target
    from eagle2_jax.decoding.autotune import fresh_copy
    from eagle2_jax.config import SamplingConfig, TreeConfig
    from eagle2_jax.decoding.eagle import STEP, STREAM_STEP, start
    from eagle2_jax.decoding.sampling import SamplingParams
    from eagle2_jax.decoding.spec import RoundSpec, params_of
    from eagle2_jax.decoding import vanilla
    from infer.roundcost import load_prompts

    target = load_target("smollm2-135m-instruct")
    draft = load_draft("smollm2-135m-instruct", target)
    params, plain_params = params_of(target, draft), params_of(target)
    tree, s, max_new = TreeConfig(args.depth, args.top_k, args.total_tokens), SamplingConfig(), 256
    prompts = load_prompts(target, None, args.batch)
    st, _ = start(target, draft, prompts, max_new_tokens=max_new, tree=tree, sampling=s)
    spec, plain_spec = RoundSpec.of(target, draft, tree), RoundSpec.of(target)
    for _ in range(8):
        st = STEP(params, st, SamplingParams.of(s), spec=spec)
    eagle = lambda x: STREAM_STEP(params, x, SamplingParams.of(s), spec=spec)  # noqa: E731
    eagle_hlo = lambda: STREAM_STEP.compile(params, st, SamplingParams.of(s), spec=spec).as_text()  # noqa: E731
    pst, _ = vanilla.start(target, prompts, max_new_tokens=max_new, sampling=s)
    plain = lambda x: vanilla.STREAM_STEP(plain_params, x, SamplingParams.of(s), spec=plain_spec)  # noqa: E731
    plain_hlo = lambda: vanilla.STREAM_STEP.compile(plain_params, pst, SamplingParams.of(s),  # noqa: E731
                                                    spec=plain_spec).as_text()
    for name, fn, state, hlo in (("eagle round", eagle, st, eagle_hlo), ("plain step", plain, pst, plain_hlo)):
        jax.block_until_ready(fn(fresh_copy(state)))  # compile + warm
        copies = [fresh_copy(state) for _ in range(args.steps)]
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d)
            for c in copies:
                jax.block_until_ready(fn(c))
            jax.profiler.stop_trace()
            evs = _events(d)
        print(f"\n== {name} (batch {args.batch}, tree {tree}) ==")
        _report(evs, args.steps, args.top, args.timeline, args.timeline_min_ms, args.timeline_until_ms)
        if args.by_shape:
            _by_shape(evs, args.steps, hlo(), args.top)


if __name__ == "__main__":
    main()
