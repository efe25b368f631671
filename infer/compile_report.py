"""Ahead-of-time compile report: lowering and compile seconds and HLO size of each program, per
layer count, with abstract params (no weights are allocated, any machine can run it).

    python -m infer.compile_report --model random:llama-3.1-8b --dtype bfloat16 --layers 2,8,32,80

Programs: plain prefill, plain decode (the whole `lax.while_loop`), EAGLE-2 prefill (target prefill
+ draft catch-up over the prompt), EAGLE-2 decode (the whole loop of rounds). `hlo_ops` counts the
instructions of the optimised HLO module XLA compiled for this machine's backend; `lowered_ops`
those of the program as lowered, before XLA's passes.
Layers run under `lax.scan` over stacked weights, so neither should grow with depth; except where
the programs run with per-layer weight buffers (`--layer-layout list`, the GPU's default: eagle2_jax.models.ops),
one copy per layer.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
import time

import jax
import numpy as np

import eagle2_jax as e2
from eagle2_jax.decoding import eagle, vanilla
from eagle2_jax.models import layer_list
from eagle2_jax.config import SamplingConfig
from eagle2_jax.decoding.spec import RoundSpec
from eagle2_jax.loading.registry import random_config
from infer.cli import Parser, add_layer_layout, ensure_parent, nonneg_float, positive_int, positive_ints, writable_file

_INSTR = re.compile(r"^\s*(ROOT\s+)?[%\w.\-]+\s*=\s*\S")


def count_instructions(hlo_text: str) -> int:
    """Instructions in an HLO module's text (every `name = op(...)` line of every computation)."""
    return sum(1 for line in hlo_text.splitlines() if _INSTR.match(line) and not line.rstrip().endswith("{"))


def _measure(program, args, static, compile_: bool):
    t0 = time.perf_counter()
    lowered = program._jit.lower(*args, **static)
    t1 = time.perf_counter()
    row = dict(lower_s=round(t1 - t0, 3), lowered_ops=count_instructions(lowered.as_text(dialect="hlo")))
    out = None
    if compile_:
        compiled = lowered.compile()
        row.update(compile_s=round(time.perf_counter() - t1, 3), hlo_ops=count_instructions(compiled.as_text()))
        out = compiled.out_info
    else:
        out = lowered.out_info
    return row, out


def report(model: str, dtype: str, layers, batch: int, prompt_len: int, max_new: int, tree, temperature: float,
           compile_: bool = True, progress=print, layer_layout: str = "auto"):
    base = random_config(model if model.startswith("random:") else "random:" + model)
    sampling = SamplingConfig(temperature)
    rows = []
    rng = np.random.default_rng(0)
    for L in layers:
        config = dataclasses.replace(base, num_hidden_layers=L)
        target = e2.init_target(config, dtype=dtype, abstract=True)
        if layer_layout != "auto":
            target = dataclasses.replace(target, ops=dataclasses.replace(target.ops, layers=layer_layout))
        if target.ops.layers == "list":
            target = layer_list.per_layer(target)  # as load_target gives it on this platform
        draft = e2.init_draft(target)
        prompts = [rng.integers(3, config.vocab_size, prompt_len).tolist() for _ in range(batch)]
        b, args, static = vanilla.program_inputs(target, prompts, max_new, None, 0, sampling)
        r, state = _measure(vanilla.PREFILL, args, static, compile_)
        rows.append(dict(layers=L, program="prefill", **r))
        progress(rows[-1])
        r, _ = _measure(vanilla.LOOP, (args[0], state, args[-1]), dict(spec=static["spec"]), compile_)
        rows.append(dict(layers=L, program="plain decode", **r))
        progress(rows[-1])
        b, args, static = eagle.program_inputs(target, draft, prompts, max_new, None, 0, sampling,
                                               eagle.scratch_slots(tree))
        r, state = _measure(eagle.PREFILL, args, static, compile_)
        rows.append(dict(layers=L, program="eagle2 prefill", **r))
        progress(rows[-1])
        r, _ = _measure(eagle.LOOP, (args[0], state, args[-1]), dict(spec=RoundSpec.of(target, draft, tree)),
                        compile_)
        rows.append(dict(layers=L, program="eagle2 decode", **r))
        progress(rows[-1])
    return rows


def main(argv=None):
    ap = Parser(
        prog="python -m infer.compile_report",
        description="Lower and compile the prefill, plain-decode and EAGLE-2 programs for a model shape with "
                    "abstract params (nothing allocated) at several layer counts; print seconds and HLO "
                    "instruction counts and write JSON.")
    ap.add_argument("--model", default="random:llama-3.1-8b",
                    help="random:<shape> or random:<config.json> (the shape; its layer count is replaced)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="parameter and cache dtype of the lowered programs (default bfloat16)")
    ap.add_argument("--layers", type=positive_ints, default="2,8,32,80",
                    help="comma-separated layer counts (default 2,8,32,80)")
    ap.add_argument("--batch", type=positive_int, default=1, help="rows decoded together (default 1)")
    ap.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens (sets the prompt bucket)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=256,
                    help="new tokens (with --prompt-len: the cache bucket; default 256)")
    ap.add_argument("--depth", type=positive_int, default=5, help="EAGLE-2 draft passes after the root's children (default 5)")
    ap.add_argument("--top-k", type=positive_int, default=10, help="EAGLE-2 children per node / frontier width (default 10)")
    ap.add_argument("--total-tokens", type=positive_int, default=60,
                    help="EAGLE-2 tokens verified per round, root included (default 60)")
    ap.add_argument("--temperature", type=nonneg_float, default=0.0, help="0: the greedy programs, > 0: sampling")
    ap.add_argument("--lower-only", action="store_true", help="lower, do not compile (no hlo_ops, compile_s)")
    add_layer_layout(ap)
    ap.add_argument("--json", type=writable_file, default="runs/compile_report.json",
                    help="where to write the rows (default runs/compile_report.json)")
    args = ap.parse_args(argv)
    layers = args.layers
    try:
        tree = e2.TreeConfig(args.depth, args.top_k, args.total_tokens)
        random_config(args.model if args.model.startswith("random:") else "random:" + args.model)
    except ValueError as e:
        ap.error(str(e))
    print(f"backend {jax.default_backend()}, {args.model} {args.dtype}, batch {args.batch}, prompt {args.prompt_len}, "
          f"max_new {args.max_new_tokens}, tree {args.depth}/{args.top_k}/{args.total_tokens}", flush=True)
    print(f"{'layers':>6} {'program':<15} {'lower s':>8} {'compile s':>9} {'lowered ops':>11} {'hlo ops':>8}", flush=True)

    def show(r):
        print(f"{r['layers']:>6} {r['program']:<15} {r['lower_s']:>8.2f} {r.get('compile_s', float('nan')):>9.2f} "
              f"{r['lowered_ops']:>11} {r.get('hlo_ops', 0):>8}", flush=True)
    rows = report(args.model, args.dtype, layers, args.batch, args.prompt_len, args.max_new_tokens, tree,
                  args.temperature, compile_=not args.lower_only, progress=show, layer_layout=args.layer_layout)
    meta = dict(model=args.model, dtype=args.dtype, batch=args.batch, prompt_len=args.prompt_len,
                max_new_tokens=args.max_new_tokens, tree=[args.depth, args.top_k, args.total_tokens],
                temperature=args.temperature, backend=jax.default_backend(), jax=jax.__version__)
    with open(ensure_parent(args.json), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
