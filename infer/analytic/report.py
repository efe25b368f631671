"""The report: bytes, FLOPs and kernels of one plain decoding step and of an EAGLE-2 round and its
parts (analyze), their roofline times on a named accelerator (roofline_s), and the text table
(format_report). The programs are lowered with abstract params; see infer.analytic's docstring for
what each figure counts."""
from __future__ import annotations

import dataclasses
import gzip
import os

import jax
import numpy as np

import eagle2_jax as e2
from eagle2_jax.decoding import eagle, vanilla
from eagle2_jax.models import layer_list
from eagle2_jax.config import SamplingConfig
from eagle2_jax.models.draft import with_draft_vocab
from eagle2_jax.backends.pallas import ops_for
from eagle2_jax.decoding.programs import gpu_graph_options
from eagle2_jax.decoding.sampling import SamplingParams
from eagle2_jax.decoding.spec import RoundSpec, params_of
from infer import phases

from .graphs import compile_with_thunks, loop_launches
from .hlo import KINDS, breakdown, count_kernels
from .targets import ACCELERATORS, GPU_TARGETS, compiler_version, placement
from .traffic import GPU_KERNEL_FLOOR_S, hbm_traffic


def _cost(lowered, kernels: bool) -> dict:
    c = lowered.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    row = {"bytes": float(c.get("bytes accessed", 0.0)), "flops": float(c.get("flops", 0.0)),
           "bytes_by_kind": breakdown(lowered.as_text(dialect="hlo"))}
    if kernels:
        row["kernels"] = count_kernels(lowered.compile().as_text())
    return row


def roofline_s(cost: dict, acc: dict) -> float:
    return max(cost["bytes"] / acc["bytes_per_s"], cost["flops"] / acc["flops_per_s"])


def analyze(model: str = "random:llama-3.1-8b", dtype: str = "bfloat16", batch: int = 1, prompt_len: int = 64,
            max_new_tokens: int = 256, depth: int = 5, top_k: int = 10, total_tokens: int = 60,
            draft_vocab: int = 32000, tau: float = 4.5, accelerator: str = "h200", kernels: bool = True,
            attention: str = "xla", compile_for: str | None = None, dump_hlo: str | None = None,
            gpu_graphs: str = "body", layers: str | None = None) -> dict:
    """The report for one shape, batch and tree (see infer.analytic's docstring). attention="pallas":
    the programs with the Pallas tree-attention kernel (eagle2_jax.backends.pallas), lowered for the
    platform of `compile_for` (or else the accelerator's: GPU Triton, TPU Mosaic); its
    pre-optimisation bytes are its cost estimate (every cache block read), and its kernels are
    counted only in the compiled rows. compile_for="h200" (or "h100", "tpu-v6e", "tpu-v5e"): also
    compile the programs with XLA's compiler for that device here (placement; the CUDA plugin or
    libtpu needed) and add their fused HBM bytes and kernels (hbm_traffic; for a GPU also with its
    L2) as "compiled" rows, the step and round as one trip of the decode loops; dump_hlo: a
    directory for the compiled HLO. For a GPU the decode loops compile with the CUDA-graph mode
    `gpu_graphs` (eagle2_jax.decoding.programs.gpu_graph_options) and the report adds what the host launches and
    waits for per trip (loop_launches). layers: the layer layout of the compiled rows, "scan" (stacked
    weights, one scanned layer body) or "list" (a buffer per layer, the loop unrolled); None: the
    platform's choice (its Ops, eagle2_jax.models.ops.xla_for: per-layer on GPU, a scan on TPU)."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {accelerator!r}: one of {', '.join(ACCELERATORS)}")
    target = e2.load_target(model, dtype=dtype, abstract=True)
    draft = e2.init_draft(target)
    V = target.config.vocab_size
    if draft_vocab and draft_vocab < V:  # a frequency-ranked draft vocabulary (stand-in: the first ids)
        draft = with_draft_vocab(draft, target, np.arange(draft_vocab))
    tree = e2.TreeConfig(depth, top_k, total_tokens)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, V, prompt_len).tolist() for _ in range(batch)]
    greedy = SamplingParams.of(SamplingConfig())
    if attention not in ("xla", "pallas"):
        raise ValueError(f"unknown attention {attention!r}: xla or pallas")
    platform = "tpu" if (compile_for or accelerator).startswith("tpu") else "cuda"
    if attention == "pallas":
        base, kernels = ops_for(backend="tpu" if platform == "tpu" else "gpu"), False
    else:
        base = e2.ops.xla_for(platform)  # the XLA path as the target platform (GPU or TPU) runs it
    if layers is not None:  # the layer layout asked for instead of the platform's
        base = dataclasses.replace(base, layers=layers)

    place = None  # lower_all(base, on=placement(...)): for a GPU or TPU, to compile without one

    def lower(jitted, *a, **kw):
        if place is not None:  # abstract inputs on a GPU/TPU device: jit lowers and compiles for it
            return jitted.lower(*place(a), **kw)
        if attention == "xla":
            return jitted.lower(*a, **kw)
        return jitted.trace(*a, **kw).lower(lowering_platforms=(platform,))
    stacked, draft0 = target, draft  # (per_layer: each layer's weights a buffer of their own, the loop unrolled)

    def lower_all(base, on=None, per_layer=True):
        """The lowered step and round parts with `base` ops, for this machine or (`on`, a placement)
        for a GPU or TPU; `per_layer`: the layers' weights as per-layer buffers and the layer loop
        unrolled (else stacked and scanned)."""
        nonlocal place
        place = on
        target = dataclasses.replace(stacked, ops=base)
        if per_layer:
            target = layer_list.per_layer(target)
        draft = layer_list.draft_like(dataclasses.replace(draft0, ops=base), target)
        params, plain_params = params_of(target, draft), params_of(target)
        spec, plain_spec = RoundSpec.of(target, draft, tree), RoundSpec.of(target)
        _, args, static = vanilla.program_inputs(target, prompts, max_new_tokens, None, 0, SamplingConfig())
        pst = lower(vanilla.PREFILL._jit, *args, **static).out_info
        b, args, static = eagle.program_inputs(target, draft, prompts, max_new_tokens, None, 0, SamplingConfig(),
                                               eagle.scratch_slots(tree))
        est = lower(eagle.PREFILL._jit, *args, **static).out_info
        lo = {"step": lower(vanilla.STEP._jit, plain_params, pst, greedy, spec=plain_spec),
              "draft": lower(phases.DRAFT, params, est, spec=spec)}
        t, dcache = lo["draft"].out_info
        lo["verify"] = lower(phases.VERIFY, params, est, t, spec=spec.prefill())
        lo["accept"] = lower(phases.ACCEPT, params, est, t, lo["verify"].out_info, dcache, greedy, spec=spec)
        lo["round"] = lower(phases.ROUND, params, est, greedy, spec=spec)
        if on is not None:  # the decode loops as generation runs them: state donated, caches in place
            lo["step_loop"] = lower(vanilla.LOOP._jit, plain_params, pst, greedy, spec=plain_spec)
            lo["round_loop"] = lower(eagle.LOOP._jit, params, est, greedy, spec=spec)
        return lo, b
    lowered, b = lower_all(base)
    cost = {k: _cost(lo, False) for k, lo in lowered.items()}
    if compile_for:  # after XLA's GPU/TPU fusion: HBM traffic and kernels of the compiled programs; the
        # step and the round are one trip of the decode loops (vanilla.LOOP, eagle.LOOP), the parts
        # standalone programs (which also convert their inputs' layouts on entry and exit)
        kernels = False
        # as they run there: the layer layout of the platform's Ops (per-layer buffers on GPU, a scan on TPU)
        runs_per_layer = base.layers == "list"
        for k, lo in lower_all(base, on=placement(compile_for), per_layer=runs_per_layer)[0].items():
            if k in ("step", "round"):
                continue  # one trip of their loops stands for them
            launches = None
            if compile_for in GPU_TARGETS and k.endswith("_loop"):  # CUDA graphs: read from the thunks
                exe, thunks = compile_with_thunks(lo, gpu_graph_options(gpu_graphs))
                launches = loop_launches(thunks) if thunks else None
            else:
                exe = lo.compile()
            if dump_hlo:  # the compiled programs, to see where the bytes go (hbm_traffic(text, top=20))
                os.makedirs(dump_hlo, exist_ok=True)
                with gzip.open(os.path.join(dump_hlo, f"{k}.hlo.gz"), "wt") as f:
                    f.write(exe.as_text())
            k = k.removesuffix("_loop")
            cost[k]["compiled"] = hbm_traffic(exe.as_text(), loop=k in ("step", "round"))
            if launches is not None:
                cost[k]["compiled"]["host"] = launches
            if compile_for in GPU_TARGETS:  # estimates: what the L2 rule keeps there between kernels, the floor
                g = GPU_TARGETS[compile_for]
                t = hbm_traffic(exe.as_text(), loop=k in ("step", "round"), l2_bytes=g["l2"],
                                bytes_per_s=g["bandwidth"], kernel_floor_s=GPU_KERNEL_FLOOR_S)
                cost[k]["compiled"].update(bytes_l2=t["bytes"], seconds_floor=t["seconds"])
    if kernels:  # counted on XLA:CPU's flavour of the same programs: bf16-output dots, which a GPU/TPU
        # matrix unit writes in one kernel, cost XLA:CPU extra conversion kernels of its own
        for k, lo in lower_all(dataclasses.replace(base, f32_dot_outputs=True))[0].items():
            cost[k]["kernels"] = count_kernels(lo.compile().as_text())
    step, rnd = cost["step"], cost["round"]
    parts = {k: cost[k] for k in ("draft", "verify", "accept")}
    acc = ACCELERATORS[accelerator]
    t_step, t_round = roofline_s(step, acc), roofline_s(rnd, acc)
    meta = dict(model=model, dtype=dtype, batch=batch, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                cache_len=b.cache_len, tree=[depth, top_k, total_tokens], draft_vocab=int(min(draft_vocab or V, V)),
                jax=jax.__version__, backend_for_kernels=jax.default_backend() if kernels else None,
                attention=attention, lowered_for=jax.default_backend() if attention == "xla" else platform)
    # the same with only the matmuls' bytes: what the programs must read once a fusing compiler keeps
    # the elementwise, broadcast and reduce traffic on chip (a lower bound beside the upper one above)
    mm = lambda c: {"bytes": c["bytes_by_kind"]["matmul"], "flops": c["flops"]}  # noqa: E731
    t_step_mm, t_round_mm = roofline_s(mm(step), acc), roofline_s(mm(rnd), acc)
    out = {}
    if compile_for:  # the fused programs' HBM bytes on the device they were compiled for, same FLOPs
        dev = ACCELERATORS[compile_for]
        cb = lambda c: {"bytes": c["compiled"]["bytes"], "flops": c["flops"]}  # noqa: E731
        t_step_c, t_round_c = roofline_s(cb(step), dev), roofline_s(cb(rnd), dev)
        out["compiled"] = {"for": compile_for, "tau": tau, "step_ms": t_step_c * 1e3, "round_ms": t_round_c * 1e3,
                           "speedup": tau * t_step_c / t_round_c,
                           "bytes": rnd["compiled"]["bytes"] / step["compiled"]["bytes"],
                           "kernels": rnd["compiled"]["kernels"] / step["compiled"]["kernels"]}
        if "bytes_l2" in step["compiled"]:  # a GPU: the same with small intermediates kept in L2
            l2 = lambda c: {"bytes": c["compiled"]["bytes_l2"], "flops": c["flops"]}  # noqa: E731
            t_step_l2, t_round_l2 = roofline_s(l2(step), dev), roofline_s(l2(rnd), dev)
            out["compiled"].update(step_ms_l2=t_step_l2 * 1e3, round_ms_l2=t_round_l2 * 1e3,
                                   speedup_l2=tau * t_step_l2 / t_round_l2,
                                   bytes_l2=rnd["compiled"]["bytes_l2"] / step["compiled"]["bytes_l2"])
            # and every kernel at least GPU_KERNEL_FLOOR_S (L2 bytes; FLOPs as a whole-program bound)
            fl = lambda c: max(c["compiled"]["seconds_floor"], c["flops"] / dev["flops_per_s"])  # noqa: E731
            out["compiled"].update(step_ms_floor=fl(step) * 1e3, round_ms_floor=fl(rnd) * 1e3,
                                   speedup_floor=tau * fl(step) / fl(rnd), kernel_floor_us=GPU_KERNEL_FLOOR_S * 1e6)
        meta["compiled_with"] = compiler_version(compile_for)
        meta["compiled_layers"] = base.layers  # the layer layout of the compiled rows ("scan" or "list")
        if compile_for in GPU_TARGETS:
            meta["gpu_graphs"] = gpu_graphs
    return {**out, "step": step, "round": {**rnd, "parts": parts},
            "roofline": {"accelerator": accelerator, "tau": tau, "speedup": tau * t_step / t_round,
                         "step_ms": t_step * 1e3, "round_ms": t_round * 1e3,
                         "speedup_matmul_bytes": tau * t_step_mm / t_round_mm},
            "ratios": {"bytes": rnd["bytes"] / step["bytes"], "flops": rnd["flops"] / step["flops"],
                       **({"kernels": rnd["kernels"] / step["kernels"]} if kernels else {}),
                       "matmul_bytes": rnd["bytes_by_kind"]["matmul"] / step["bytes_by_kind"]["matmul"]},
            "meta": meta}


def format_report(r: dict) -> str:
    """`analyze`'s report as text: markdown tables and the roofline lines. Of the compiled rows, the
    all-in-HBM figures are the compiled bound; the L2 rule and the kernel floor are labelled estimates."""
    gb = lambda x: f"{x / 1e9:.2f} GB" if x >= 1e8 else f"{x / 1e6:.2f} MB"  # noqa: E731
    tf = lambda x: f"{x / 1e12:.3f} TFLOP" if x >= 1e10 else f"{x / 1e9:.3f} GFLOP"  # noqa: E731
    m, rf = r["meta"], r["roofline"]
    lines = [f"{m['model']} {m['dtype']}, batch {m['batch']}, prompt {m['prompt_len']}, max_new {m['max_new_tokens']} "
             f"(cache {m['cache_len']} slots), tree {'/'.join(map(str, m['tree']))}, draft vocabulary {m['draft_vocab']}",
             "", "| program | bytes | FLOPs | kernels | bytes / step | " + " | ".join(KINDS) + " |",
             "|---|---|---|---|---|" + "---|" * len(KINDS)]
    step = r["step"]

    def row(name, c):
        kinds = " | ".join(gb(c["bytes_by_kind"][k]) for k in KINDS)
        return (f"| {name} | {gb(c['bytes'])} | {tf(c['flops'])} | {c.get('kernels', '-')} | "
                f"{c['bytes'] / step['bytes']:.2f}x | {kinds} |")
    lines.append(row("plain step", step))
    for k, c in r["round"]["parts"].items():
        lines.append(row(f"round: {k}", c))
    lines.append(row("round", r["round"]))
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in r["ratios"].items())
    lines += ["", f"round / step: {ratios}",
              f"roofline on {ACCELERATORS[rf['accelerator']]['name']}: step {rf['step_ms']:.3f} ms, round "
              f"{rf['round_ms']:.3f} ms; at tau {rf['tau']}: speedup {rf['speedup']:.2f}x",
              f"matmul bytes only (elementwise, broadcast and reduce traffic fused away, as XLA on GPU/TPU "
              f"mostly does): round / step {r['ratios']['matmul_bytes']:.2f}x, speedup {rf['speedup_matmul_bytes']:.2f}x"]
    if "compiled" in r:  # after XLA's GPU/TPU fusion (and, on TPU, memory-space assignment)
        c = r["compiled"]
        layout = f"layers: {m['compiled_layers']}; " if "compiled_layers" in m else ""
        lines += ["", f"compiled by XLA for {ACCELERATORS[c['for']]['name']} ({m.get('compiled_with', '')}; {layout}"
                      f"HBM bytes of the fused kernels, infer.analytic.hbm_traffic; step and round: one trip "
                      f"of the decode loops, parts: standalone programs):",
                  ""]
        # the all-in-HBM figures are the compiled bound; the L2 rule and the kernel floor are estimates
        bound = "compiled bound (all in HBM)"
        l2 = "bytes_l2" in c  # a GPU: also with intermediates of up to half its L2 kept there
        half_l2 = GPU_TARGETS[c["for"]]["l2"] // 2**21 if l2 else 0  # MiB
        l2_rule = f"estimate (L2 rule: results up to {half_l2} MiB stay in L2)"
        lines += [f"| program | HBM bytes, {bound} | kernels run | bytes / step |" + (
                  f" HBM bytes, {l2_rule} | bytes / step |" if l2 else ""),
                  "|---|---|---|---|" + ("---|---|" if l2 else "")]
        for name, row in [("plain step", step)] + [(f"round: {k}", v) for k, v in r["round"]["parts"].items()] + [
                ("round", r["round"])]:
            x, s = row["compiled"], step["compiled"]
            lines.append(f"| {name} | {gb(x['bytes'])} | {x['kernels']} | {x['bytes'] / s['bytes']:.2f}x |" + (
                f" {gb(x['bytes_l2'])} | {x['bytes_l2'] / s['bytes_l2']:.2f}x |" if l2 else ""))
        lines += ["", f"{bound}: round / step: bytes {c['bytes']:.2f}x, kernels {c['kernels']:.2f}x; roofline: step "
                      f"{c['step_ms']:.3f} ms, round {c['round_ms']:.3f} ms; at tau {c['tau']}: speedup {c['speedup']:.2f}x"]
        host = [(n, row["compiled"]["host"]) for n, row in (("step", step), ("round", r["round"]))
                if "host" in row["compiled"]]
        if host:  # CUDA graphs: what the host issues and waits for per trip of the decode loops
            lines.append(f"CUDA graphs ({m.get('gpu_graphs')}), per trip of the decode loop: " + "; ".join(
                f"{n}: the loop runs inside one graph ({h['kernels']} kernels), no launch or wait" if h["in_graph"] else
                f"{n}: {h['launches']} launches ({h['graphs']} graph{'s' * (h['graphs'] != 1)}, {h['kernels']} kernels in "
                f"the body) "
                f"and {h['syncs']} wait for the device" for n, h in host))
        if l2:
            lines.append(f"{l2_rule}: bytes {c['bytes_l2']:.2f}x; roofline: step {c['step_ms_l2']:.3f} ms, round "
                         f"{c['round_ms_l2']:.3f} ms; at tau {c['tau']}: speedup {c['speedup_l2']:.2f}x")
            lines.append(f"estimate ({c['kernel_floor_us']:.1f} us kernel floor fitted to one small-model run; "
                         f"GPU_KERNEL_FLOOR_S, every kernel at least that, on the L2 estimate's bytes): step "
                         f"{c['step_ms_floor']:.3f} ms, round {c['round_ms_floor']:.3f} ms; at tau {c['tau']}: "
                         f"speedup {c['speedup_floor']:.2f}x")
    return "\n".join(lines)
