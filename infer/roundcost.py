"""Round-cost curves: how an EAGLE-2 round's time grows with the tree and the batch, split into its
parts, against one plain decoding step; and the tree chosen for each batch size.

    python -m infer.roundcost                                  # batch 1,4,16; shipped head
    python -m infer.roundcost --batch 1 --depth 5 --top-k 10 --total-tokens 2,8,16,32,60

Parts, each compiled on its own and timed on device on the same mid-generation state:
  draft   expand + rerank (the draft passes, the candidate pool, the top N-1 tree)
  verify  one target forward over the N tree tokens + the LM head
  accept  greedy acceptance + cache compaction + output + draft catch-up
  round   the whole round as the generation loop runs it (the parts fused by XLA; not their sum)
The tree for each batch maximises expected tokens/s: measured greedy tokens per round over the
measured round time. Tokens per round come from a walk of --calibration-rounds real rounds with the
largest tree, read for every smaller size at the same states (eagle2_jax.decoding.autotune.calibrate); the
draft's own estimate (1 + the sum of the N-1 best exp(scores)) is shown beside it.
Writes roundcost.json, roundcost.md and roundcost.png under --out, and prints the per-batch table a
head's tree.json takes ("by_batch": the best tree size per batch, or "plain" where none beats plain
decoding; eagle2_jax.decoding.defaults). Times are the best of
--repeats runs (compile excluded).

With --analytic nothing runs: for each batch and tree size it prints per-round bytes, FLOPs and
kernel counts per part against one plain step, from XLA's cost analysis of the lowered programs
with abstract params (no weights needed; bytes and FLOPs are the pre-optimisation
`Lowered.cost_analysis()`, so CPU-only rewrites do not distort them), and the roofline speedup at
--tau on --accelerator (see infer/analytic/); --json FILE writes it. With --compile-for h200 (or
h100, tpu-v5e, tpu-v6e) the same programs are also compiled by XLA's compiler for that GPU or TPU on
this machine (deviceless: the CUDA plugin or libtpu, no device), and the report adds what the fused
programs move to and from HBM, and their kernels.
"""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from tqdm import tqdm

from eagle2_jax import TreeConfig
from eagle2_jax.decoding.autotune import best_time, calibrate, fresh_copy
from eagle2_jax.config import SamplingConfig
from eagle2_jax.decoding.eagle import STEP, start
from eagle2_jax.decoding.programs import enable_compile_cache
from eagle2_jax.decoding.sampling import SamplingParams
from eagle2_jax.decoding.spec import RoundSpec, params_of
from eagle2_jax.decoding import vanilla
from infer import phases
from infer.analytic import ACCELERATORS, COMPILE_TARGETS, analyze, format_report
from infer.cli import (Parser, add_backend_args, add_model_args, add_tree_args, ensure_parent, fail, load_models,
                       nonneg_int, positive_int, positive_ints, tokens_per_round, writable_dir, writable_file)
from infer.prompts import DEFAULT_QUESTIONS, load_questions, render


def parse(argv=None):
    ap = Parser(prog="python -m infer.roundcost", description=__doc__)
    add_model_args(ap)
    ap.add_argument("--batch", type=positive_ints, default="1,4,16", help="comma list of batch sizes (default 1,4,16)")
    add_tree_args(ap, sizes=True, depth=4, top_k=4, total_tokens="2,4,8,16,32,64")
    ap.add_argument("--questions", default=None,
                    help="EAGLE/MT-bench jsonl whose first turns are the prompts (default: shared MT-bench)")
    ap.add_argument("--repeats", type=positive_int, default=5, help="timed runs of each program; the best counts (default 5)")
    ap.add_argument("--parts", choices=["all", "round"], default="all",
                    help="'round': time only the whole round and the plain step (a quarter of the compiles; "
                         "for large shapes on a lent accelerator), leaving the draft/verify/accept columns empty")
    ap.add_argument("--calibration-rounds", type=positive_int, default=16,
                    help="greedy rounds walked with the largest tree to measure tokens per round of every size")
    ap.add_argument("--calibration-prompts", type=positive_int, default=16,
                    help="prompts in the acceptance walk (at least the batch size): acceptance is a per-row "
                         "quantity, so small batches borrow more prompts for it")
    ap.add_argument("--max-new-tokens", type=positive_int, default=256,
                    help="size the caches for generations of this length (attention reads the whole padded cache)")
    add_backend_args(ap, gpu_graphs=False)  # --attention pallas: timed, or with --analytic lowered for the
    # accelerator's platform (Triton for GPUs, Mosaic for TPUs; the kernel counts by its cost estimate)
    ap.add_argument("--out", type=writable_dir, default="runs/bench/roundcost",
                    help="output directory for roundcost.json / .md / .png (default runs/bench/roundcost)")
    an = ap.add_argument_group("analytic (--analytic: cost analysis of the lowered programs, nothing runs)")
    an.add_argument("--analytic", action="store_true", help="report bytes / FLOPs / kernels and the roofline instead of timing")
    an.add_argument("--prompt-len", type=positive_int, default=64,
                    help="prompt tokens (with --max-new-tokens: the cache bucket); also when timing a random "
                         "target (random token prompts of this length)")
    an.add_argument("--tau", type=tokens_per_round, default=4.5, help="tokens per round for the roofline speedup")
    an.add_argument("--accelerator", default="h200", choices=sorted(ACCELERATORS),
                    help="peak bandwidth and bf16 FLOP/s for the roofline (infer/analytic/)")
    an.add_argument("--draft-vocab", type=nonneg_int, default=32000,
                    help="draft vocabulary size (frequency-ranked ids; 0: the full vocabulary)")
    an.add_argument("--compile-for", choices=list(COMPILE_TARGETS), default=None,
                    help="also compile the programs with XLA's compiler for that GPU or TPU, here, with none attached "
                         "(a deviceless topology; run with JAX_PLATFORMS=cpu; a GPU needs the CUDA plugin matching jax, "
                         "pip install --no-deps jax-cuda13-plugin jax-cuda13-pjrt, and ptxas; a TPU needs libtpu, "
                         "pip install 'jax[tpu]'), and report the fused programs' HBM traffic and kernels beside the "
                         "pre-optimisation figures, and their roofline on that accelerator (for a GPU also with a "
                         "2.5 us floor per kernel, infer.analytic.GPU_KERNEL_FLOOR_S)")
    an.add_argument("--dump-hlo", default=None, metavar="DIR",
                    help="with --compile-for: write each compiled program's HLO to DIR/<program>.hlo.gz (DIR/b<batch>_n<N>/ "
                         "for several shapes) "
                         "(infer.analytic.hbm_traffic(text, top=20) lists the costliest kernels)")
    an.add_argument("--gpu-graphs", choices=["body", "loop", "off"], default="body",
                    help="with --compile-for a GPU: the decode loops' CUDA graphs (as infer.generate's --gpu-graphs); "
                         "the report says what the host launches and waits for per trip")
    an.add_argument("--no-kernels", dest="kernels", action="store_false",
                    help="skip compiling for kernel counts (bytes and FLOPs only)")
    an.add_argument("--json", type=writable_file, default=None, help="write the report(s) as JSON")
    args = ap.parse_args(argv)
    if args.analytic:  # (timing caps N at the candidate pool + 1 instead)
        try:
            for n in args.total_tokens:
                TreeConfig(args.depth, args.top_k, n)
        except ValueError as e:
            ap.error(str(e))
    return args


def analytic_main(args):
    reports = []
    shapes = [(b, n) for b in args.batch for n in args.total_tokens]
    for bsz, n in shapes:
        dump = args.dump_hlo and (args.dump_hlo if len(shapes) == 1 else os.path.join(args.dump_hlo, f"b{bsz}_n{n}"))
        model = "random:smollm2-135m" if args.model == "smollm2-135m-instruct" else args.model  # shapes only
        try:
            r = analyze(model, "bfloat16" if args.dtype == "auto" else args.dtype, bsz, args.prompt_len,
                        args.max_new_tokens, args.depth, args.top_k, n, args.draft_vocab, args.tau, args.accelerator,
                        args.kernels and not args.compile_for, args.attention, args.compile_for, dump, args.gpu_graphs,
                        None if args.layer_layout == "auto" else args.layer_layout)
        except ValueError as e:
            fail(str(e))
        print(format_report(r) + "\n", flush=True)
        reports.append(r)
    if args.json:
        with open(ensure_parent(args.json), "w") as f:
            json.dump(reports[0] if len(reports) == 1 else reports, f, indent=2)
        print(f"wrote {args.json}")


def _best(fn, make_args, repeats, first_call=None):
    """Best wall time (ms) of fn(*make_args()) after a warm-up call (autotune.best_time: the programs
    donate what they update, as the generation loop does, so each call gets fresh copies). The
    warm-up's seconds (compile included) are appended to `first_call` when given."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*make_args()))  # compile + warm
    if first_call is not None:
        first_call.append(time.perf_counter() - t0)
    return best_time(fn, make_args, repeats) * 1e3


def _plain_step_ms(target, prompts, repeats, max_new=256):
    s = SamplingConfig()
    st, _ = vanilla.start(target, prompts, max_new_tokens=max_new, sampling=s)
    params, spec = params_of(target), RoundSpec.of(target)
    return _best(lambda st_: vanilla.STREAM_STEP(params, st_, SamplingParams.of(s), spec=spec),
                 lambda: (fresh_copy(st),), repeats)


def load_prompts(target, path, n, random_len: int = 64):
    """The first n first-turn questions of `path`, chat-rendered (random_len random tokens each
    without a tokenizer)."""
    if target.tokenizer is None:
        rng = np.random.default_rng(0)
        return [rng.integers(3, target.config.vocab_size, random_len).tolist() for _ in range(n)]
    qs = load_questions(path or DEFAULT_QUESTIONS, None, None)
    qs = (qs * (n // max(len(qs), 1) + 1))[:n]
    return [render(target.tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in qs]


def measure(target, draft, prompts, depth: int, top_k: int, sizes, repeats: int, max_new: int = 256,
            calibration_rounds: int = 16, calibration_prompts=None, parts: str = "all", on_row=None):
    """Rows: dict(batch, depth, top_k, total_tokens, draft_ms, verify_ms, accept_ms, round_ms, expected_tau
    (measured), estimated_tau (draft scores), tokens_per_s) plus the plain step time for this batch.
    Caches are sized for max_new new tokens, as a generation of that length sizes them (attention
    runs over the whole padded cache). Acceptance is measured over `calibration_prompts` when given
    (and more than the batch), else over the batch itself."""
    batch = len(prompts)
    pool_size = top_k + depth * top_k * top_k
    sizes = sorted({min(n, pool_size + 1) for n in sizes})
    big = TreeConfig(depth, top_k, sizes[-1])
    s = SamplingConfig()

    def state(ps):
        return start(target, draft, ps, max_new_tokens=max_new, tree=big, sampling=s)[0]

    params = params_of(target, draft)
    # measured greedy acceptance of every size along a real walk (autotune.calibrate), over the calibration
    # prompts; the parts are timed on the batch's own mid-generation state after a walk as long
    st = state(prompts)
    if calibration_prompts is not None and len(calibration_prompts) > len(prompts):
        acc, _ = calibrate(target, draft, state(calibration_prompts), big, rounds=calibration_rounds)
        for _ in range(calibration_rounds):
            st = STEP(params, st, SamplingParams.of(s), spec=RoundSpec.of(target, draft, big))
    else:
        acc, st = calibrate(target, draft, st, big, rounds=calibration_rounds)
    greedy = SamplingParams.of(s)
    plain = _plain_step_ms(target, prompts, repeats, max_new)
    rows = []
    for n in sizes:
        spec = RoundSpec.of(target, draft, TreeConfig(depth, top_k, n))
        row = dict(batch=batch, depth=depth, top_k=top_k, total_tokens=n, plain_step_ms=plain,
                   draft_ms=None, verify_ms=None, accept_ms=None)
        if parts == "all":  # each phase on the state the previous one leaves (fresh copies: they donate)
            t, dcache = phases.DRAFT(params, fresh_copy(st), spec=spec)
            v = phases.VERIFY(params, fresh_copy(st), t, spec=spec.prefill())
            row.update(draft_ms=_best(lambda s_: phases.DRAFT(params, s_, spec=spec),
                                      lambda: (fresh_copy(st),), repeats),
                       verify_ms=_best(lambda s_: phases.VERIFY(params, s_, t, spec=spec.prefill()),
                                       lambda: (fresh_copy(st),), repeats),
                       accept_ms=_best(lambda s_, v_, dc: phases.ACCEPT(params, s_, t, v_, dc, greedy, spec=spec),
                                       lambda: fresh_copy((st, v, dcache)), repeats))
        first = []
        row.update(round_ms=_best(lambda s_: phases.ROUND(params, s_, greedy, spec=spec),
                                  lambda: (fresh_copy(st),), repeats, first),
                   expected_tau=acc.measured_tau(n), estimated_tau=acc.estimated_tau(n))
        row["round_compile_s"] = first[0]  # the round program's first call: compile + one run
        row["tokens_per_s"] = batch * row["expected_tau"] / row["round_ms"] * 1e3
        row["plain_tokens_per_s"] = batch / plain * 1e3
        rows.append(row)
        if on_row is not None:  # e.g. write what is measured so far: a run cut off keeps it
            on_row(rows)
    return rows


def by_batch(rows) -> dict:
    """The per-batch table of a head's tree.json (eagle2_jax.decoding.defaults): for each batch size the tree
    size with the best expected tokens/s, or "plain" where plain decoding's measured tokens/s beats
    every tree's."""
    table = {}
    for bsz in sorted({r["batch"] for r in rows}):
        rs = [r for r in rows if r["batch"] == bsz]
        best = max(rs, key=lambda r: r["tokens_per_s"])
        table[str(bsz)] = best["total_tokens"] if best["tokens_per_s"] > best["plain_tokens_per_s"] else "plain"
    return table


def write(rows, out, figure=True):
    os.makedirs(out, exist_ok=True)
    best = {}
    for r in rows:
        if r["batch"] not in best or r["tokens_per_s"] > best[r["batch"]]["tokens_per_s"]:
            best[r["batch"]] = r
    with open(os.path.join(out, "roundcost.json"), "w") as f:
        json.dump({"rows": rows, "chosen": {str(k): v for k, v in best.items()}, "by_batch": by_batch(rows)}, f,
                  indent=1)
    lines = ["| batch | depth/top_k | N | draft ms | verify ms | accept ms | round ms | plain step ms | "
             "tau (measured) | tau (draft estimate) | expected tok/s | plain tok/s |", "|" + "---|" * 12]
    for r in rows:
        mark = " **chosen**" if best[r["batch"]] is r else ""
        ms = " | ".join("-" if r[k] is None else f"{r[k]:.1f}" for k in ("draft_ms", "verify_ms", "accept_ms"))
        lines.append(f"| {r['batch']} | {r['depth']}/{r['top_k']} | {r['total_tokens']}{mark} | {ms} | "
                     f"{r['round_ms']:.1f} | {r['plain_step_ms']:.1f} | "
                     f"{r['expected_tau']:.2f} | {r['estimated_tau']:.2f} | {r['tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} |")
    with open(os.path.join(out, "roundcost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if not figure:
        return lines
    try:  # optional: the figure only
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return lines
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for bsz in sorted(best):
        rs = [r for r in rows if r["batch"] == bsz]
        line, = ax.plot([r["total_tokens"] for r in rs], [r["round_ms"] for r in rs], "o-", label=f"round, batch {bsz}")
        if all(r["verify_ms"] is not None for r in rs):
            ax.plot([r["total_tokens"] for r in rs], [r["verify_ms"] for r in rs], "x--", color=line.get_color(),
                    alpha=0.6, label=f"verify, batch {bsz}")
        ax.axhline(rs[0]["plain_step_ms"], color=line.get_color(), ls=":", alpha=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens verified per round (total_tokens N)")
    ax.set_ylabel("ms (dotted: one plain decoding step)")
    ax.set_title("EAGLE-2 round cost")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "roundcost.png"), dpi=110)
    return lines


def main(argv=None):
    args = parse(argv)
    if args.analytic:
        return analytic_main(args)
    enable_compile_cache()  # a second run loads the compiled programs (EAGLE2_JAX_COMPILE_CACHE=0: off)
    target, draft = load_models(args)
    sizes = args.total_tokens
    rows = []
    for bsz in tqdm(args.batch, desc="batch sizes", unit="batch"):
        prompts = load_prompts(target, args.questions, bsz, args.prompt_len)
        calib = load_prompts(target, args.questions, max(bsz, args.calibration_prompts), args.prompt_len)
        done = list(rows)
        rows += measure(target, draft, prompts, args.depth, args.top_k, sizes, args.repeats, args.max_new_tokens,
                        args.calibration_rounds, calib, args.parts,
                        on_row=lambda rs: write(done + rs, args.out, figure=False))
    print("\n".join(write(rows, args.out)))
    print(f"per-batch table for the head's tree.json (\"by_batch\"): {json.dumps(by_batch(rows))}")
    print(f"wrote {args.out}/roundcost.json, roundcost.md, roundcost.png")


if __name__ == "__main__":
    main()
