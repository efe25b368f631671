"""Analytic round cost: bytes, FLOPs and kernels of one EAGLE-2 round and its parts against one plain
decoding step, from XLA's cost analysis of the lowered programs, and the roofline speedup at a given
tau on a named accelerator. No weights are needed (abstract params), so it runs anywhere.

    python -m infer.roundcost --analytic --model random:llama-3.1-8b --dtype bfloat16 --batch 1 \\
        --depth 5 --top-k 10 --total-tokens 60 --prompt-len 64 --max-new-tokens 256 --tau 4.5

Bytes and FLOPs are `Lowered.cost_analysis()` of each program before XLA's optimisations: every op's
operands and results counted as if nothing were fused, so backend-specific rewrites (CPU fusion
choices) do not distort them; they over-count what a fused kernel reads and are an upper bound.
XLA counts a while loop's body once, so for the analysis each layer's weights are a buffer of their
own and the layer loop is unrolled (`eagle2_jax.models.layer_list.per_layer`, as programs run on GPU):
each weight counts once. The stacked KV cache is still sliced per layer, as the program does.
Kernels: instructions of the program XLA compiles for this machine's backend (fusions, library
calls, copies; not parameters, constants, tuples or bitcasts): a proxy for GPU/TPU launches, whose
fusion choices differ. They are counted on the programs with float32 dot outputs rounded by a
second op (`Ops.f32_dot_outputs`, which XLA:CPU fuses into the consumer), since XLA:CPU splits the
bf16-output dots of the accelerator path into extra conversion kernels that a GPU/TPU matrix unit
does not need. (The compiled program's own cost analysis is not reported: XLA:CPU widens bf16
weights to float32 before its dots, so its bytes say nothing about an accelerator.)

With `compile_for` (`--compile-for h200`, `h100`, `tpu-v6e`, `tpu-v5e`) the programs are also
compiled by XLA's GPU or TPU compiler on this machine (no device: a deviceless topology, with the
CUDA plugin or libtpu installed), and `hbm_traffic` reads what the fused programs move to and from
HBM, every array counted in HBM: the compiled bound, beside the upper bound above. They are
compiled as they run there: per-layer weight buffers on GPU, stacked weights under a scan on TPU
(`Ops.layers`). For a GPU the report adds two estimates, not measurements: the bytes with small
intermediates kept in L2 (a rule of ours, `hbm_traffic(l2_bytes=...)`), and the time with every
kernel costing at least GPU_KERNEL_FLOOR_S (a floor fitted to one run), as well as what the host
launches and waits for per trip of the decode loops under CUDA graphs.

Parts: draft = expand + rerank (the draft passes, the candidate pool, the tree); verify = one target
forward over the N tree tokens + the LM head; accept = greedy acceptance + KV compaction + output +
draft catch-up; round = the whole round as the loop runs it (not the sum of the parts).

Modules, one job each: hlo (reading HLO text: kernels, bytes by kind, loop trips), targets (the
accelerators, and compiling for a GPU or TPU without one), traffic (HBM bytes of a compiled program,
the L2 rule, the kernel floor), graphs (CUDA graphs from XLA's thunk sequence), report (analyze,
roofline_s, format_report). Measured figures are kept in docs/performance.md, not in these
docstrings, so that each stays with the run and date it came from.
"""
from .graphs import compile_with_thunks, loop_launches
from .hlo import KINDS, breakdown, count_kernels
from .report import analyze, format_report, roofline_s
from .targets import (ACCELERATORS, COMPILE_TARGETS, GPU_TARGETS, TPU_TOPOLOGIES, compiler_version, gpu_target_config,
                      placement)
from .traffic import GPU_KERNEL_FLOOR_S, hbm_traffic

__all__ = ["ACCELERATORS", "COMPILE_TARGETS", "GPU_KERNEL_FLOOR_S", "GPU_TARGETS", "KINDS", "TPU_TOPOLOGIES",
           "analyze", "breakdown", "compile_with_thunks", "compiler_version", "count_kernels", "format_report",
           "gpu_target_config", "hbm_traffic", "loop_launches", "placement", "roofline_s"]
