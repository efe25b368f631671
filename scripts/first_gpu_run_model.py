"""The first H200 run (2026-12-04, code df79017) read through its compiled programs: kernels and
FLOPs of a plain step and an EAGLE-2 round, compiled here for an H200 (no GPU), as README section
"On a lent GPU" reports them.

    # 1. kernels and FLOPs of that run's code (its API: LOOP holds the prefill, STEP is one round)
    git worktree add /tmp/old df79017
    cd /tmp/old && EAGLE2_JAX_CPU_KERNELS=0 JAX_PLATFORMS=cpu <python with the CUDA plugin> \\
        <this repo>/scripts/first_gpu_run_model.py old
    # 2. tau(N) of the shipped head at every tree size up to 5/10/60 (a greedy walk, this CPU)
    python scripts/first_gpu_run_model.py tau [--rounds 40] [--prompts 20]

The kernel counter is this repo's infer/analytic.py, loaded by path so the old checkout's own
modules run. Current code: `python -m infer.roundcost --analytic --model random:smollm2-135m
--dtype float32 --total-tokens 8,16,32,60 --draft-vocab 16384 --compile-for h200` with
JAX_DEFAULT_MATMUL_PRECISION=highest.
"""
import argparse
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def old_run():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.getcwd())  # the old checkout
    spec = importlib.util.spec_from_file_location("current_analytic", os.path.join(HERE, "infer", "analytic.py"))
    A = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(A)
    import jax
    import numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")  # as the run had it
    import eagle2_jax as e2
    from eagle2_jax import eagle, vanilla
    from eagle2_jax.config import SamplingConfig, TreeConfig
    target = e2.load_target("random:smollm2-135m", dtype="float32")
    draft = e2.load_draft(os.path.join(os.getcwd(), "eagle2_jax/heads/smollm2-135m-instruct"), target)
    prompts = [np.random.default_rng(0).integers(3, 49000, 64).tolist()]
    place = A.placement("h200")
    s = SamplingConfig()
    _, vargs, vstatic = vanilla._program_inputs(target, prompts, 256, None, 0, s)
    _, eargs, estatic = eagle._program_inputs(target, draft, prompts, 256, None, 0, s, TreeConfig(5, 10, 60))
    out = {}
    for name, prog, args, static in (("step", vanilla.LOOP, vargs, vstatic), ("round", eagle.LOOP, eargs, estatic)):
        txt = prog._jit.lower(*place(args), **static).compile().as_text()
        out[name] = {"kernels": A.hbm_traffic(txt, loop=True)["kernels"]}
    vst = jax.eval_shape(lambda *a: vanilla.INIT._jit(*a, **vstatic), *vargs)
    out["step"]["gflop"] = vanilla.STEP._jit.lower(target.params, vst, module=vstatic["module"],
                                                   sampling=s).cost_analysis()["flops"] / 1e9
    est = jax.eval_shape(lambda *a: eagle.INIT._jit(*a, **estatic), *eargs)
    out["round"]["gflop"] = eagle.STEP._jit.lower(target.params, draft.params, est, tmodule=estatic["tmodule"],
                                                  dmodule=estatic["dmodule"], sampling=s,
                                                  tree=estatic["tree"]).cost_analysis()["flops"] / 1e9
    print(json.dumps(out))


def tau(rounds, n_prompts):
    sys.path.insert(0, HERE)
    import eagle2_jax as e2
    from eagle2_jax.autotune import calibrate
    from eagle2_jax.config import SamplingConfig, TreeConfig
    from eagle2_jax.eagle import start
    from infer.roundcost import load_prompts
    target = e2.load_target("smollm2-135m-instruct")
    draft = e2.load_draft("smollm2-135m-instruct", target)
    big = TreeConfig(5, 10, 60)
    st, _ = start(target, draft, load_prompts(target, None, n_prompts), max_new_tokens=256, tree=big,
                  sampling=SamplingConfig())
    acc, _ = calibrate(target, draft, st, big, rounds=rounds)
    print(json.dumps({n: round(acc.measured_tau(n), 3) for n in (2, 4, 8, 12, 16, 24, 32, 48, 60)}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["old", "tau"])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=20)
    a = ap.parse_args()
    old_run() if a.what == "old" else tau(a.rounds, a.prompts)
