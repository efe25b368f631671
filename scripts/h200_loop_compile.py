"""Deviceless H200 compile of the decode loops (vanilla.LOOP, eagle.LOOP) at a layer count and layout:
lower and compile seconds (wall and this process's CPU), optimised HLO size, compiled HBM bytes of one
trip (infer.analytic.hbm_traffic, loop=True). Lowered as infer.analytic.report.analyze lowers them
(random:llama-3.1-8b bf16 with num_hidden_layers replaced, abstract params, Ops xla_for('cuda') with
the layout, draft vocabulary 32000, batch 1, prompt 64, 256 new tokens, tree 5/10/60,
placement('h200')), compiled with a plain .compile() (XLA's default CUDA graphs). Needs the CUDA
plugin environment of scripts/analytic_compiled.sh; one process per layer count for clean timings.
Reproduces the compile seconds in docs/performance.md ("Scanned layers with dynamic-slice fusion");
each run takes 5-40 s on the 2-core dev machine (80 layers, per-layer buffers: the longest):

    JAX_PLATFORMS=cpu PYTHONPATH=. /tmp/gpuenv/bin/python scripts/h200_loop_compile.py list 80 --json out.json
"""
import argparse
import dataclasses
import gzip
import json
import os
import time

import jax
import numpy as np

import eagle2_jax as e2
from eagle2_jax.decoding import eagle, vanilla
from eagle2_jax.models import layer_list
from eagle2_jax.config import SamplingConfig
from eagle2_jax.models.draft import with_draft_vocab
from eagle2_jax.loading.registry import random_config
from eagle2_jax.decoding.sampling import SamplingParams
from eagle2_jax.decoding.spec import RoundSpec, params_of
from infer.analytic import placement
from infer.analytic.traffic import hbm_traffic
from infer.compile_report import count_instructions

ap = argparse.ArgumentParser()
ap.add_argument("layout", choices=["scan", "list"])
ap.add_argument("layers")
ap.add_argument("programs", nargs="?", default="step,round")
ap.add_argument("--json")
ap.add_argument("--dump")
a = ap.parse_args()

place = placement("h200")
tree = e2.TreeConfig(5, 10, 60)
greedy = SamplingParams.of(SamplingConfig())
rows = []
for L in map(int, a.layers.split(",")):
    config = dataclasses.replace(random_config("random:llama-3.1-8b"), num_hidden_layers=L)
    target = e2.init_target(config, dtype="bfloat16", abstract=True)
    target = dataclasses.replace(target, ops=dataclasses.replace(e2.ops.xla_for("cuda"), layers=a.layout))
    draft = e2.init_draft(target)
    draft = with_draft_vocab(draft, target, np.arange(32000))
    if a.layout == "list":
        target = layer_list.per_layer(target)
    draft = layer_list.draft_like(draft, target)
    params, plain_params = params_of(target, draft), params_of(target)
    spec, plain_spec = RoundSpec.of(target, draft, tree), RoundSpec.of(target)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, 64).tolist()]
    _, args, static = vanilla.program_inputs(target, prompts, 256, None, 0, SamplingConfig())
    pst = vanilla.PREFILL._jit.lower(*args, **static).out_info
    _, args, static = eagle.program_inputs(target, draft, prompts, 256, None, 0, SamplingConfig(),
                                           eagle.scratch_slots(tree))
    est = eagle.PREFILL._jit.lower(*args, **static).out_info
    progs = {"step": lambda: vanilla.LOOP._jit.lower(*place((plain_params, pst, greedy)), spec=plain_spec),
             "round": lambda: eagle.LOOP._jit.lower(*place((params, est, greedy)), spec=spec)}
    for name in a.programs.split(","):
        t0 = time.perf_counter()
        lo = progs[name]()
        t1, c1 = time.perf_counter(), time.process_time()
        exe = lo.compile()
        t2, c2 = time.perf_counter(), time.process_time()
        text = exe.as_text()
        tr = hbm_traffic(text, loop=True)
        program = {"step": "plain decode loop", "round": "eagle2 decode loop"}[name]
        row = dict(layers=L, layout=a.layout, program=program,
                   lower_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2), compile_cpu_s=round(c2 - c1, 2),
                   loadavg_1m=os.getloadavg()[0], hlo_ops=count_instructions(text),
                   trip_hbm_bytes=tr["bytes"], trip_kernels=tr["kernels"],
                   custom_dynamic_slice_fusions=text.count('"name":"dynamic_slice_fusion"'),
                   cublas_calls=text.count("__cublas"), triton_gemms=text.count("__triton_nested_gemm_fusion"),
                   xla_flags=os.environ.get("XLA_FLAGS", ""))
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with gzip.open(os.path.join(a.dump, f"{name}_L{L}.hlo.gz"), "wt") as f:
                f.write(text)
        del lo, exe, text
if a.json:
    meta = dict(model="random:llama-3.1-8b", dtype="bfloat16", batch=1, prompt_len=64, max_new_tokens=256,
                tree=[5, 10, 60], draft_vocab=32000, compile_for="h200", jax=jax.__version__,
                xla_flags=os.environ.get("XLA_FLAGS", ""))
    with open(a.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
