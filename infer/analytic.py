"""Analytic round cost: bytes, FLOPs and kernels of one EAGLE-2 round and its parts against one plain
decoding step, from XLA's cost analysis of the lowered programs, and the roofline speedup at a given
tau on a named accelerator. No weights are needed (abstract params), so it runs anywhere.

    python -m infer.roundcost --analytic --model random:llama-3.1-8b --dtype bfloat16 --batch 1 \\
        --depth 5 --top-k 10 --total-tokens 60 --prompt-len 64 --max-new-tokens 256 --tau 4.5

Bytes and FLOPs are `Lowered.cost_analysis()` of each program before XLA's optimisations: every op's
operands and results counted as if nothing were fused, so backend-specific rewrites (CPU fusion
choices) do not distort them; they over-count what a fused kernel reads and are an upper bound.
XLA counts a while loop's body once, so for the analysis each layer's weights are a buffer of their
own and the layer loop is unrolled (`eagle2_jax.layer_list.per_layer`, as programs run on GPU):
each weight counts once. The stacked KV cache is still sliced per layer, as the program does.
Kernels: instructions of the
program XLA compiles for this machine's backend (fusions, library calls, copies; not parameters,
constants, tuples or bitcasts): a proxy for GPU/TPU launches, whose fusion choices differ. They are
counted on the programs with float32 dot outputs rounded by a second op (`Ops.f32_dot_outputs`,
which XLA:CPU fuses into the consumer), since XLA:CPU splits the bf16-output dots of the
accelerator path into extra conversion kernels that a GPU/TPU matrix unit does not need. (The
compiled program's own cost analysis is not reported: XLA:CPU widens bf16 weights to float32 before
its dots, so its bytes say nothing about an accelerator.)

With `compile_for` (`--compile-for h200`, `h100`, `tpu-v6e`, `tpu-v5e`) the programs are also
compiled by XLA's GPU or TPU compiler on this machine (no device: a deviceless topology, with the
CUDA plugin or libtpu installed), and `hbm_traffic` reads what the fused programs move to and from
HBM: the figures a fusing compiler's output gives, beside the upper bound above. They are compiled
as they run there: per-layer weight buffers on GPU, stacked weights under a scan on TPU
(`layer_list.wanted`). For a GPU the report also times the fused programs with every kernel costing
at least GPU_KERNEL_FLOOR_S (its bytes at the card's bandwidth otherwise, small intermediates in L2).

Parts: draft = expand + rerank (the draft passes, the candidate pool, the tree); verify = one target
forward over the N tree tokens + the LM head; accept = greedy acceptance + KV compaction + output +
draft catch-up; round = the whole round as the loop runs it (not the sum of the parts).
"""
from __future__ import annotations

import dataclasses
import os
import re

ACCELERATORS = {  # peak HBM bytes/s and dense bf16 FLOP/s, from the vendors' data sheets
    "h200": dict(name="NVIDIA H200", bytes_per_s=4.8e12, flops_per_s=989e12),
    "h100": dict(name="NVIDIA H100 SXM", bytes_per_s=3.35e12, flops_per_s=989e12),
    "a100": dict(name="NVIDIA A100 80GB", bytes_per_s=2.039e12, flops_per_s=312e12),
    "tpu-v5e": dict(name="Google TPU v5e", bytes_per_s=0.819e12, flops_per_s=197e12),
    "tpu-v6e": dict(name="Google TPU v6e", bytes_per_s=1.64e12, flops_per_s=918e12),
}

_SKIP = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier"}
_OP = re.compile(r"=\s*(?:\S+\s+)?([a-z][a-z0-9\-]*)\(")


def count_kernels(hlo_text: str) -> int:
    """Instructions of the ENTRY computation and of while / conditional bodies (each counted once)
    that launch work: fusions, library calls, copies, collectives."""
    comps, name, lines = {}, None, []
    for line in hlo_text.splitlines():
        s = line.strip()
        if s.endswith("{") and ("(" in s) and not s.startswith("ROOT"):
            name = "ENTRY" if s.startswith("ENTRY") else s.split()[0].lstrip("%")
            lines = []
        elif s == "}" and name is not None:
            comps[name] = lines
            name = None
        elif name is not None and " = " in s:
            lines.append(s)
    wanted = {"ENTRY"}
    for body in comps.get("ENTRY", []):
        for key in ("body=", "condition=", "branch_computations={", "true_computation=", "false_computation="):
            for m in re.finditer(re.escape(key) + r"%?([\w.\-]+)", body):
                wanted.add(m.group(1))
    total = 0
    for c in wanted:
        for s in comps.get(c, []):
            m = _OP.search(s)
            if m and m.group(1) not in _SKIP:
                total += 1
    return total


# ---- where the bytes go: the lowered program's instructions by kind ---------------------------

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(pred|s8|u8|bf16|f16|s16|u16|f32|s32|u32|f64|s64|u64)\[([0-9,]*)\]")
_INST = re.compile(r"(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier"}
# custom calls XLA's TPU compiler leaves in place that run no kernel: the pieces of a sliced copy
# reassembled by a bitcast (memory-space assignment's ConcatBitcast), a buffer allocation, a marker
_NO_WORK_CALL = re.compile(r'custom_call_target="(ConcatBitcast|AllocateBuffer|AssumeGatherIndicesInBound)"')
_MOVES = {"slice", "dynamic-slice", "gather", "scatter", "dynamic-update-slice", "concatenate", "transpose",
          "broadcast", "pad", "reverse", "copy", "reshape"}
KINDS = ("matmul", "kernel", "reduce", "data movement", "elementwise")  # breakdown classes, in report order


def _bytes(shape_text: str) -> int:
    total = 0
    for dt, dims in _SHAPE.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dt]
    return total


def breakdown(hlo_text: str) -> dict:
    """Bytes of a pre-optimisation HLO module by instruction kind (matmul = dot / convolution,
    kernel = custom calls (Pallas kernels: operands + results, all of the cache), reduce, data movement = slices, gathers, scatters, concatenations, transposes, broadcasts, reshapes,
    elementwise = the rest), each instruction's operands + result as XLA's cost analysis counts
    them (slices and gathers: the part read; updates: the part written), calls followed into their
    computations. An approximation of `cost_analysis()["bytes accessed"]` (within ~1% on our
    programs) that says where it goes: a fusing compiler (XLA on GPU/TPU) keeps most elementwise,
    broadcast and reduce traffic in registers, so "matmul" is near what such a round must read."""
    comps = _computations(hlo_text)
    out = dict.fromkeys(KINDS, 0.0)

    def walk(comp):
        sizes = {}
        for ins in comps.get(comp, []):
            name, op, line, args = ins["name"], ins["op"], ins["line"], ins["args"]
            res = sizes[name] = _bytes(ins["shape"])
            if op in _FREE:
                continue
            if op == "call":
                walk(re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
                continue
            read = sum(sizes.get(a, 0) for a in args)
            if op in ("slice", "dynamic-slice"):  # the part read, as XLA counts them
                read = res
            elif op == "gather":  # the rows read and the indices
                read = res + sizes.get(args[1], 0)
            elif op == "dynamic-update-slice":  # the part written
                read, res = 2 * (read - sizes.get(args[0], 0)), 0
            elif op == "scatter":  # updates read, read back and written, and the indices
                read, res = 3 * sizes.get(args[2], 0) + sizes.get(args[1], 0), 0
            kind = ("matmul" if op in ("dot", "convolution") else "kernel" if op == "custom-call"
                    else "reduce" if op.startswith("reduce")
                    else "data movement" if op in _MOVES else "elementwise")
            out[kind] += read + res
    walk("ENTRY")
    return out


def _cost(lowered, kernels: bool) -> dict:
    c = lowered.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    row = {"bytes": float(c.get("bytes accessed", 0.0)), "flops": float(c.get("flops", 0.0)),
           "bytes_by_kind": breakdown(lowered.as_text(dialect="hlo"))}
    if kernels:
        row["kernels"] = count_kernels(lowered.compile().as_text())
    return row


# ---- after fusion: the programs compiled for a GPU or TPU without one (deviceless) ---------------

TPU_TOPOLOGIES = {"tpu-v5e": "v5e:2x2", "tpu-v6e": "v6e:2x2"}  # the smallest host slice; one chip is used

# XLA's description of a GPU (its TargetConfig, as XLA's own gpu_specs write it), enough for the GPU
# compiler to fuse, pick kernels and emit PTX with no GPU attached. Hopper, SM 9.0; what differs
# between the cards is memory size and bandwidth (the L2 is 50 MiB on both).
GPU_TARGETS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=84_929_347_584, bandwidth=3_352_320_000_000, l2=52_428_800),
    "h200": dict(name="NVIDIA H200", memory=150_754_820_096, bandwidth=4_800_000_000_000, l2=52_428_800),
}


COMPILE_TARGETS = (*GPU_TARGETS, *TPU_TOPOLOGIES)

# What a small GPU kernel costs whatever it moves (launch inside a CUDA graph, ramp-up, tail), for the
# compiled GPU rows' third roofline: fitted to the one GPU measurement so far (README "On a lent GPU":
# H200, SmolLM2-135M float32 at highest precision, a plain step of 705 kernels in 1.8 ms, a round of
# 1,035 kernels and 19 GFLOP in 4.8 ms: 2.5 us a kernel beside 8.65 TFLOP/s). Two times, two
# unknowns: a reading of one run, to be replaced by a profile when a GPU is lent. The fit has no bytes
# term, so the floor also absorbs that step's 0.54 GB of weight reads (~2.35 us without them).
GPU_KERNEL_FLOOR_S = 2.5e-6


def gpu_target_config(accelerator: str, cuda=(13, 0), cudnn=(9, 8)) -> str:
    """The TargetConfig text proto of a named Hopper GPU, for jax's deviceless CUDA topology."""
    t = GPU_TARGETS[accelerator]
    info = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
                shared_memory_per_core=233472, threads_per_core_limit=2048, core_count=132, fpus_per_core=128,
                block_dim_limit_x=2147483647, block_dim_limit_y=65535, block_dim_limit_z=65535,
                memory_bandwidth=t["bandwidth"], l2_cache_size=t["l2"], clock_rate_ghz=1.98,
                device_memory_size=t["memory"], shared_memory_per_block_optin=232448,
                registers_per_core_limit=65536, registers_per_block_limit=65536)
    # a current driver and toolkit: XLA drops the CUDA-graph commands that need a 12.3+ driver (cuBLAS and
    # custom calls captured into graphs, while loops and conditionals on the device) when it sees none
    version = f"{cuda[0]}.{cuda[1]}.0"
    lines = ["gpu_device_info {"] + [f"  {k}: {v}" for k, v in info.items()] + [
        f'  {k}: "{version}"' for k in ("driver_version", "runtime_version", "compile_time_toolkit_version")] + [
        "  cuda_compute_capability { major: 9 minor: 0 }", "}", 'platform_name: "CUDA"',
        f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} }}",
        f"runtime_version {{ major: {cuda[0]} minor: {cuda[1]} }}", f'device_description_str: "{t["name"]}"']
    return "\n".join(lines) + "\n"


def placement(accelerator: str):
    """A function that puts pytrees of arrays, as abstract arrays, on one device of a GPU or TPU
    described without one attached (a deviceless topology): `jit(f).lower(*place(args)).compile()`
    then runs XLA's compiler for that device here. A TPU needs the `libtpu` wheel matching jax
    (pip install 'jax[tpu]'), a GPU the CUDA plugin (pip install --no-deps jax-cuda13-plugin==<jax>
    jax-cuda13-pjrt==<jax>; ptxas from a CUDA toolkit on PATH); run with JAX_PLATFORMS=cpu."""
    import jax
    import numpy as np
    from jax.experimental import topologies
    if accelerator not in TPU_TOPOLOGIES and accelerator not in GPU_TARGETS:
        raise ValueError(f"cannot compile for {accelerator!r}: one of {', '.join(COMPILE_TARGETS)}")
    try:
        if accelerator in TPU_TOPOLOGIES:
            topo = topologies.get_topology_desc(topology_name=TPU_TOPOLOGIES[accelerator], platform="tpu")
        else:
            topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                                target_config=gpu_target_config(accelerator))
    except Exception as e:  # no libtpu / CUDA plugin, or one that does not match jax
        need = "libtpu (pip install 'jax[tpu]')" if accelerator in TPU_TOPOLOGIES else \
            f"the CUDA plugin (pip install --no-deps jax-cuda13-plugin=={jax.__version__} " \
            f"jax-cuda13-pjrt=={jax.__version__}) and ptxas"
        raise RuntimeError(f"compiling for {accelerator} needs {need}: {str(e).splitlines()[0]}") from None
    one = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(topo.devices[:1]), ("x",)),
                                     jax.sharding.PartitionSpec())

    def place(tree):
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)
            if hasattr(x, "shape") and hasattr(x, "dtype") else x, tree)
    return place


_THUNK = re.compile(r"^( *)\d+: (k\w+)")


def loop_launches(thunks_text: str) -> dict:
    """What the host does per trip of a GPU program's outermost while loop (a decode loop), from XLA's
    thunk sequence (the `*.thunk_sequence_after_thunk_passes.txt` of an XLA dump): `launches`, the
    commands the host issues each trip (a CUDA graph -- XLA's kCommandBuffer -- counts one, as does a
    kernel or copy outside a graph), of which `graphs` are graphs, and `syncs`, the times it waits for
    the device (XLA's WhileThunk copies the loop condition to the host and blocks every trip); all
    zero when the loop itself runs inside a graph (`in_graph`). `kernels`: kernels in the loop's body.
    None when the program has no while loop."""
    rows = [(len(m.group(1)), m.group(2)) for m in map(_THUNK.match, thunks_text.splitlines()) if m]
    first = next((i for i, (_, kind) in enumerate(rows) if kind == "kWhile"), None)
    if first is None:
        return None
    depth = rows[first][0]
    in_graph = any(kind == "kCommandBuffer" and d < depth for d, kind in rows[:first])
    inside = []
    for d, kind in rows[first + 1:]:
        if d <= depth:
            break
        inside.append((d, kind))
    top = min((d for d, _ in inside), default=depth)
    direct = [kind for d, kind in inside if d == top]  # the condition's and the body's own commands
    kernels = sum(kind in ("kKernel", "kCustomKernel", "kGemm", "kCublasLtMatmul", "kCuDnn", "kCustomCall")
                  for _, kind in inside)
    if in_graph:
        return dict(in_graph=True, launches=0, graphs=0, syncs=0, kernels=kernels)
    return dict(in_graph=False, launches=len(direct), graphs=direct.count("kCommandBuffer"), syncs=1,
                kernels=kernels)


def _compile_with_thunks(lowered, options: dict):
    """Compile with XLA's dump on (a temporary directory): (executable, thunk sequence text or '')."""
    import glob
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        exe = lowered.compile(compiler_options={**options, "xla_dump_to": d})
        files = sorted(glob.glob(os.path.join(d, "*thunk_sequence_after_thunk_passes.txt"))) or sorted(
            glob.glob(os.path.join(d, "*thunk_sequence.txt")))
        text = open(files[-1]).read() if files else ""
    return exe, text


def _compiler_version(accelerator: str) -> str:
    import importlib.metadata
    pkg = "libtpu" if accelerator in TPU_TOPOLOGIES else "jax-cuda13-plugin"
    try:
        return f"{pkg} {importlib.metadata.version(pkg)}"
    except importlib.metadata.PackageNotFoundError:
        return pkg


_INDEX_COMMENT = re.compile(r"/\*index=\d+\*/")


def _computations(hlo_text: str) -> dict:
    comps, cur = {}, None
    for line in hlo_text.splitlines():
        s = _INDEX_COMMENT.sub("", line.strip())  # (long operand and tuple lists carry /*index=N*/ marks)
        if s.endswith("{") and " = " not in s:
            name = s.split()[1] if s.startswith("ENTRY") else s.split()[0]
            cur = comps.setdefault("ENTRY" if s.startswith("ENTRY") else name.lstrip("%"), [])
        elif s == "}":
            cur = None
        elif cur is not None and (m := _INST.match(s)):
            name, shape, op, rest = m.groups()
            args = [a.strip().lstrip("%") for a in rest.split(")")[0].split(",") if a.strip()]
            cur.append(dict(name=name, shape=shape, op=op, args=args, line=s))
    return comps


_LAYOUT_SHAPE = re.compile(r"\b(pred|s8|u8|bf16|f16|s16|u16|f32|s32|u32|f64|s64|u64)\[([0-9,]*)\](\{[^}]*\})?")


def _hbm_bytes(shape_text: str) -> int:
    """Bytes of the arrays in `shape_text` that live in HBM: not those a layout puts in another
    memory space (`S(n)`: on TPU, S(1) is the core's vector memory, S(2) scalar memory)."""
    total = 0
    for dt, dims, layout in _LAYOUT_SHAPE.findall(shape_text):
        if re.search(r"S\([1-9]\d*\)", layout or ""):
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dt]
    return total


def _constant(body, name):
    ins = next((i for i in body if i["name"] == name and i["op"] == "constant"), None)
    m = re.search(r"constant\((-?\d+)\)", ins["line"]) if ins else None
    return int(m.group(1)) if m else None


def _counted_trips(comps, caller: list, loop: dict) -> int:
    """Trips of a while loop (`loop`, an instruction of `caller`) whose condition is `i < N` (or
    `N > i`) for a constant N, i a loop-state element that starts at a constant (a scan or fori loop
    stepping by 1, as JAX writes them; XLA's TPU compiler leaves no known_trip_count on them): N
    minus the start (0 if the start is not a visible constant). Otherwise 1, with a warning."""
    import warnings
    cond = re.search(r"condition=%?([\w.\-]+)", loop["line"]).group(1)
    body = comps.get(cond, [])
    root = body[-1] if body else None
    if root is not None and root["op"] == "compare" and len(root["args"]) == 2:
        counter, bound = root["args"]
        if "direction=GT" in root["line"]:
            counter, bound = bound, counter
        n = _constant(body, bound) if re.search(r"direction=(LT|GT)", root["line"]) else None
        if n is not None:
            gte = next((i for i in body if i["name"] == counter and i["op"] == "get-tuple-element"), None)
            k = re.search(r"index=(\d+)", gte["line"]) if gte else None
            init = next((i for i in caller if loop["args"] and i["name"] == loop["args"][0]), None)
            start = _constant(caller, init["args"][int(k.group(1))]) if (
                k and init is not None and init["op"] == "tuple" and int(k.group(1)) < len(init["args"])) else None
            return max(n - (start or 0), 0)
    warnings.warn(f"while loop {loop['name']}: no known trip count and no `i < N` condition; counted once")
    return 1


_LIBRARY_CALL = re.compile(r'custom_call_target="__(cublas|cudnn)')
_IN_PLACE = ("dynamic-update-slice", "scatter")


class _L2:
    """The L2 model of `hbm_traffic` for one computation: which results may live in L2 (kernel
    results of at most half of it that are not loop state, outputs or in-place updates), when each
    was written (bytes streamed so far, counted all-in-HBM), and what a kernel's reads and its own
    result cost with that."""

    def __init__(self, body, comps, l2_bytes):
        self.half, self.pos, self.src, self.written, self.pending = l2_bytes // 2, 0.0, {}, {}, {}
        self.kept = set()  # what reaches the computation's root: outputs and loop state, always in HBM
        todo = [body[-1]["name"]] if body else []
        self.by_name = by_name = {i["name"]: i for i in body}
        while todo:
            n = todo.pop()
            if n in self.kept or n not in by_name:
                continue
            self.kept.add(n)
            if by_name[n]["op"] in ("tuple", "bitcast", "get-tuple-element"):
                todo += by_name[n]["args"]
        self.comps = comps

    def alias(self, ins):
        """bitcast / get-tuple-element of a result read the result itself."""
        if ins["op"] in ("bitcast", "get-tuple-element") and ins["args"]:
            self.src[ins["name"]] = self.src.get(ins["args"][0], ins["args"][0])

    def _in_place(self, ins):
        if ins["op"] in _IN_PLACE or "output_to_operand_aliasing" in ins["line"]:
            return True
        callee = re.search(r"calls=%?([\w.\-]+)", ins["line"]) if ins["op"] == "fusion" else None
        body = self.comps.get(callee.group(1), []) if callee else []
        roots = body[-1:] if body and body[-1]["op"] != "tuple" else [
            i for i in body if i["name"] in body[-1]["args"]] if body else []
        return any(r["op"] in _IN_PLACE for r in roots)

    def nested(self, ins, moved) -> float:
        """A while loop, conditional, call or asynchronous copy over `ins`'s operands: they enter it
        in HBM (the writes still pending are charged, returned), and the `moved` bytes it streams
        turn the L2 over."""
        late, todo, seen = 0.0, list(ins["args"]), set()
        while todo:
            a = todo.pop()
            if a in seen:
                continue
            seen.add(a)
            late += self.pending.pop(self.src.get(a, a), 0)
            if self.by_name.get(a, {}).get("op") == "tuple":
                todo += self.by_name[a]["args"]
        self.pos += moved
        return late

    def kernel(self, ins, operands, res, streamed):
        """(operands as charged, late writes to charge, result as charged) for one kernel that moves
        `streamed` bytes counted all in HBM (how far the L2 turns over)."""
        operands, late = list(operands), 0.0
        for j, a in enumerate(ins["args"]):
            a = self.src.get(a, a)
            if a not in self.written:
                continue
            if self.pos - self.written[a] <= self.half:
                operands[j] = 0  # still in L2
            else:
                late += self.pending.pop(a, 0)  # evicted before this read: it was written to HBM
        name = ins["name"]
        if 0 < res <= self.half and name not in self.kept and not ins["op"].endswith(("-start", "-done")) \
                and not self._in_place(ins):
            self.written[name], self.pending[name], res = self.pos + streamed, res, 0
        self.pos += streamed
        return operands, late, res


def hbm_traffic(hlo_text: str, top: int = 0, loop: bool = False, l2_bytes: int = 0, bytes_per_s: float = 0.0,
                kernel_floor_s: float = 0.0) -> dict:
    """HBM bytes and kernels of a compiled (optimised, fused, memory-space-assigned) HLO module:
    each top-level instruction reads its operands and writes its result, as a fused kernel does,
    counting only arrays in HBM (what the compiler placed in on-chip memory is free; the async
    copies and slices that bring it there are charged as HBM reads). Inside a fusion, a parameter
    only sliced is charged the slices, one gathered the rows gathered; an in-place update
    (dynamic-update-slice or scatter into a parameter) is charged the update, not the buffer. While
    bodies count their trip count (`known_trip_count`, else an `i < N` condition: _counted_trips;
    once, with a warning, if neither), a conditional its
    largest branch, kernels included (so kernels are those executed, not those in the text;
    asynchronous copies, DMAs that overlap the kernels, are not kernels). `loop`: one trip of the
    costliest while loop of the entry computation instead (a decode loop's step or round, without
    what runs once around it). `l2_bytes` (a GPU's L2 cache): a kernel's result of at most half of it
    that is read again before another half of the L2 has streamed through (by the all-in-HBM count
    of what the kernels, loops and copies in between move) is read from L2 (split-K partial sums, a
    layer's attention scores at a short context); its write is charged only if some read comes later than that (to the reading
    kernel), else it is taken to stay in L2 until its buffer is reused. Program inputs, loop state
    (what enters or leaves a loop, conditional or call), in-place updates (caches) and outputs are
    always charged. Returns {"bytes", "kernels"}, and with
    `top` > 0 "top": the `top` costliest instructions as (bytes, name, source op_name). With
    `bytes_per_s`, also "seconds": each kernel's bytes at that bandwidth but never less than
    `kernel_floor_s` (what a small kernel costs whatever it moves: launch, ramp-up, tail), plus the
    asynchronous copies' bytes at that bandwidth, executed kernels and trips counted as above."""
    comps = _computations(hlo_text)
    costs = []
    at_bw = (lambda nb: nb / bytes_per_s) if bytes_per_s else (lambda nb: 0.0)  # seconds to move nb bytes

    def charge(ins, nbytes):
        if top:
            src = re.search(r'op_name="([^"]*)"', ins["line"])
            costs.append((nbytes, ins["name"], src.group(1) if src else ins["op"]))
        return nbytes

    def through(comp, name):
        """The uses of `name` inside `comp`, looking through bitcasts and bitcast-only fusions."""
        uses = []
        for ins in comps.get(comp, []):
            if name not in ins["args"]:
                continue
            callee = re.search(r"calls=%?([\w.\-]+)", ins["line"])
            trivial = ins["op"] == "bitcast" or (ins["op"] == "fusion" and callee and all(
                i["op"] in ("parameter", "bitcast") for i in comps.get(callee.group(1), [])))
            uses += through(comp, ins["name"]) if trivial else [(ins, ins["args"].index(name))]
        return uses

    def param_read(callee, k, full):
        """What a fusion reads of its operand k (`full` bytes in HBM): the slices or rows it takes,
        through nested fusions; nothing of a buffer it only updates in place; else all of it."""
        body = comps.get(callee, [])
        p = next((i for i in body if i["op"] == "parameter"
                  and int(re.search(r"parameter\((\d+)\)", i["line"]).group(1)) == k), None)
        uses = through(callee, p["name"]) if p is not None else []
        if not full or not uses:
            return full
        total = 0
        for u, j in uses:
            if u["op"] in ("slice", "dynamic-slice", "gather") and j == 0:
                total += _bytes(u["shape"])
            elif u["op"] in ("dynamic-update-slice", "scatter") and j == 0:
                continue  # (updated in place: only the update is written)
            elif u["op"] == "fusion":  # a nested fusion: what it reads of that parameter
                total += param_read(re.search(r"calls=%?([\w.\-]+)", u["line"]).group(1), j, full)
            else:
                return full
        return min(full, total)

    def fusion_bytes(callee, operands, result_hbm):
        body = comps.get(callee, [])
        sizes = {i["name"]: _bytes(i["shape"]) for i in body}
        total = sum(param_read(callee, k, b) for k, b in enumerate(operands))  # (0 when it is on chip)
        if not body or not result_hbm:
            return total + result_hbm
        roots = [body[-1]]
        if roots[0]["op"] == "tuple":
            roots = [i for a in roots[0]["args"] for i in body if i["name"] == a]
        written = sum(sizes.get(r["args"][1], 0) if r["op"] == "dynamic-update-slice"
                      else sizes.get(r["args"][-1], 0) if r["op"] == "scatter" else sizes[r["name"]]
                      for r in roots)
        return total + min(written, result_hbm)

    def walk(comp):
        hbm, full, start_src, nbytes, kernels, secs = {}, {}, {}, 0.0, 0, 0.0
        body = comps.get(comp, [])
        by_name = {i["name"]: i for i in body}
        l2 = _L2(body, comps, l2_bytes) if l2_bytes else None
        for ins in body:
            name, op, line, args = ins["name"], ins["op"], ins["line"], ins["args"]
            shape = ins["shape"]
            if op == "custom-call" and shape.startswith("(") and _LIBRARY_CALL.search(line):
                shape = re.sub(r",\s*[su]8\[\d+\]\{0\}\)$", ")", shape)  # its workspace is not traffic
            res = hbm[name] = _hbm_bytes(shape)
            full[name] = _bytes(ins["shape"])
            if l2 is not None:
                l2.alias(ins)
            if op.endswith("-start"):  # charged when done: the source read (if in HBM), the result written
                start_src[name] = hbm.get(args[0], 0) if args else 0
                continue
            if op.endswith("-done"):
                moved = _bytes(ins["shape"])
                moved = min(start_src.get(args[0], moved), moved) + res
                nbytes += charge(ins, moved)
                secs += at_bw(moved)
                if l2 is not None:  # (its source was read in HBM)
                    extra = l2.nested(by_name.get(args[0], ins) if args else ins, moved)
                    nbytes, secs = nbytes + extra, secs + at_bw(extra)
                continue  # (an asynchronous copy: a DMA beside the kernels, not one of them)
            if op in _FREE or (op == "custom-call" and _NO_WORK_CALL.search(line)):
                continue
            if op == "while":
                n = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                b, k, t = walk(re.search(r"body=%?([\w.\-]+)", line).group(1))
                n = int(n.group(1)) if n else _counted_trips(comps, body, ins)
                nbytes, kernels, secs = nbytes + b * n, kernels + k * n, secs + t * n
                if l2 is not None:  # its state enters in HBM; what it streams turns the L2 over
                    extra = l2.nested(ins, b * n)
                    nbytes, secs = nbytes + extra, secs + at_bw(extra)
                continue
            if op == "conditional":
                names = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = [x.strip().lstrip("%") for x in names.group(1).split(",")] if names else [
                    re.search(key + r"=%?([\w.\-]+)", line).group(1) for key in ("true_computation", "false_computation")]
                branch = [walk(c) for c in names]
                nbytes, kernels = nbytes + max(c[0] for c in branch), kernels + max(c[1] for c in branch)
                secs += max(c[2] for c in branch)
                if l2 is not None:
                    extra = l2.nested(ins, max(c[0] for c in branch))
                    nbytes, secs = nbytes + extra, secs + at_bw(extra)
                continue
            if op == "call":
                b, k, t = walk(re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
                nbytes, kernels, secs = nbytes + b, kernels + k, secs + t
                if l2 is not None:
                    extra = l2.nested(ins, b)
                    nbytes, secs = nbytes + extra, secs + at_bw(extra)
                continue
            kernels += 1

            def moves(operands, res):
                if op == "fusion":
                    return fusion_bytes(re.search(r"calls=%?([\w.\-]+)", line).group(1), operands, res)
                if op in ("slice", "dynamic-slice"):
                    return min(operands[0], full[name]) + res
                if op == "dynamic-update-slice":
                    return operands[1] + min(res, full.get(args[1], 0))
                return sum(operands) + res
            operands = [hbm.get(a, 0) for a in args]
            late = 0.0  # writes of earlier results read too late to find them in L2, charged here
            if l2 is not None:  # (the L2 turns over by what the kernel moves counted all in HBM)
                streamed = moves(operands, res)
                operands, late, res = l2.kernel(ins, operands, res, streamed)
            moved = moves(operands, res) + late
            nbytes += charge(ins, moved)
            secs += max(at_bw(moved), kernel_floor_s) if bytes_per_s else 0.0
        return nbytes, kernels, secs
    if loop:
        bodies = [re.search(r"body=%?([\w.\-]+)", i["line"]).group(1) for i in comps.get("ENTRY", [])
                  if i["op"] == "while"]
        if not bodies:
            raise ValueError("no while loop in the entry computation")
        best = None
        for c in bodies:
            costs.clear()
            r = walk(c)
            if best is None or r[0] > best[0][0]:
                best = (r, list(costs))
        (b, k, t), costs[:] = best
    else:
        b, k, t = walk("ENTRY")
    out = {"bytes": b, "kernels": k}
    if bytes_per_s:
        out["seconds"] = t
    if top:  # (a while body's instructions are listed once, at one trip's cost)
        out["top"] = sorted(costs, reverse=True)[:top]
    return out


def roofline_s(cost: dict, acc: dict) -> float:
    return max(cost["bytes"] / acc["bytes_per_s"], cost["flops"] / acc["flops_per_s"])


def analyze(model: str = "random:llama-3.1-8b", dtype: str = "bfloat16", batch: int = 1, prompt_len: int = 64,
            max_new_tokens: int = 256, depth: int = 5, top_k: int = 10, total_tokens: int = 60,
            draft_vocab: int = 32000, tau: float = 4.5, accelerator: str = "h200", kernels: bool = True,
            attention: str = "xla", compile_for: str | None = None, dump_hlo: str | None = None,
            gpu_graphs: str | None = None) -> dict:
    """The report for one shape, batch and tree (see the module docstring). attention="pallas":
    the programs with the Pallas tree-attention kernel (eagle2_jax.pallas), lowered for the
    platform of `compile_for` (or else the accelerator's: GPU Triton, TPU Mosaic); its
    pre-optimisation bytes are its cost estimate (every cache block read), and its kernels are
    counted only in the compiled rows. compile_for="h200" (or "h100", "tpu-v6e", "tpu-v5e"): also
    compile the programs with XLA's compiler for that device here (placement; the CUDA plugin or
    libtpu needed) and add their fused HBM bytes and kernels (hbm_traffic; for a GPU also with its
    L2) as "compiled" rows, the step and round as one trip of the decode loops; dump_hlo: a
    directory for the compiled HLO. For a GPU the decode loops compile with the CUDA-graph mode
    `gpu_graphs` (eagle2_jax.defaults.gpu_graphs) and the report adds what the host launches and
    waits for per trip (loop_launches)."""
    import jax
    import numpy as np
    import eagle2_jax as e2
    from eagle2_jax import eagle, layer_list, vanilla
    from eagle2_jax.config import SamplingConfig
    from eagle2_jax.draft import with_draft_vocab
    from eagle2_jax.sampling import SamplingParams
    from infer.roundcost import _parts
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
        from eagle2_jax.pallas import ops_for
        base, kernels = ops_for(backend="tpu" if platform == "tpu" else "gpu"), False
    else:
        base = e2.ops.xla_for(platform)  # the XLA path as the target platform (GPU or TPU) runs it

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
        tm, dm, tp, dp = target.module, draft.module, target.params, draft.params
        _, args, static = vanilla._program_inputs(target, prompts, max_new_tokens, None, 0, SamplingConfig())
        pst = lower(vanilla.PREFILL._jit, *args, **static).out_info
        b, args, static = eagle._program_inputs(target, draft, prompts, max_new_tokens, None, 0, SamplingConfig(), tree)
        est = lower(eagle.PREFILL._jit, *args, **static).out_info
        p_draft, p_verify, p_accept, p_round = _parts()
        lo = {"step": lower(vanilla.STEP._jit, tp, pst, greedy, module=tm),
              "draft": lower(p_draft, tp, dp, est, tm=tm, dm=dm, tree=tree)}
        t, dcache = lo["draft"].out_info
        lo["verify"] = lower(p_verify, tp, est, t, tm=tm, aux=dm.aux_layers)
        feats, logits, tcache = lo["verify"].out_info
        lo["accept"] = lower(p_accept, tp, dp, est, t, feats, logits, tcache, dcache, tm=tm, dm=dm, tree=tree)
        lo["round"] = lower(p_round, tp, dp, est, tm=tm, dm=dm, tree=tree)
        if on is not None:  # the decode loops as generation runs them: state donated, caches in place
            lo["step_loop"] = lower(vanilla.LOOP._jit, tp, pst, greedy, module=tm)
            lo["round_loop"] = lower(eagle.LOOP._jit, tp, dp, est, greedy, tmodule=tm, dmodule=dm, tree=tree)
        return lo, b
    lowered, b = lower_all(base)
    cost = {k: _cost(lo, False) for k, lo in lowered.items()}
    if compile_for:  # after XLA's GPU/TPU fusion: HBM traffic and kernels of the compiled programs; the
        # step and the round are one trip of the decode loops (vanilla.LOOP, eagle.LOOP), the parts
        # standalone programs (which also convert their inputs' layouts on entry and exit)
        kernels = False
        # as they run there: per-layer weight buffers on GPU (layer_list.wanted), a scan over stacks on TPU
        runs_per_layer = layer_list.wanted("gpu" if compile_for in GPU_TARGETS else "tpu")
        for k, lo in lower_all(base, on=placement(compile_for), per_layer=runs_per_layer)[0].items():
            if k in ("step", "round"):
                continue  # one trip of their loops stands for them
            launches = None
            if compile_for in GPU_TARGETS and k.endswith("_loop"):  # CUDA graphs: read from the thunks
                from eagle2_jax.defaults import gpu_graph_options
                exe, thunks = _compile_with_thunks(lo, gpu_graph_options(gpu_graphs))
                launches = loop_launches(thunks) if thunks else None
            else:
                exe = lo.compile()
            if dump_hlo:  # the compiled programs, to see where the bytes go (hbm_traffic(text, top=20))
                import gzip
                os.makedirs(dump_hlo, exist_ok=True)
                with gzip.open(os.path.join(dump_hlo, f"{k}.hlo.gz"), "wt") as f:
                    f.write(exe.as_text())
            k = k.removesuffix("_loop")
            cost[k]["compiled"] = hbm_traffic(exe.as_text(), loop=k in ("step", "round"))
            if launches is not None:
                cost[k]["compiled"]["host"] = launches
            if compile_for in GPU_TARGETS:  # and with what fits the GPU's L2 kept there between kernels
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
        meta["compiled_with"] = _compiler_version(compile_for)
        if compile_for in GPU_TARGETS:
            from eagle2_jax.defaults import gpu_graphs as _mode
            meta["gpu_graphs"] = _mode(gpu_graphs)
    return {**out, "step": step, "round": {**rnd, "parts": parts},
            "roofline": {"accelerator": accelerator, "tau": tau, "speedup": tau * t_step / t_round,
                         "step_ms": t_step * 1e3, "round_ms": t_round * 1e3,
                         "speedup_matmul_bytes": tau * t_step_mm / t_round_mm},
            "ratios": {"bytes": rnd["bytes"] / step["bytes"], "flops": rnd["flops"] / step["flops"],
                       **({"kernels": rnd["kernels"] / step["kernels"]} if kernels else {}),
                       "matmul_bytes": rnd["bytes_by_kind"]["matmul"] / step["bytes_by_kind"]["matmul"]},
            "meta": meta}


def format_report(r: dict) -> str:
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
        lines += ["", f"compiled by XLA for {ACCELERATORS[c['for']]['name']} ({m.get('compiled_with', '')}; "
                      f"HBM bytes of the fused kernels, infer.analytic.hbm_traffic; step and round: one trip "
                      f"of the decode loops, parts: standalone programs):",
                  ""]
        l2 = "bytes_l2" in c  # a GPU: also with intermediates of up to half its L2 kept there
        lines += ["| program | HBM bytes | kernels run | bytes / step |" + (" HBM bytes, L2-resident intermediates "
                  "| bytes / step |" if l2 else ""), "|---|---|---|---|" + ("---|---|" if l2 else "")]
        for name, row in [("plain step", step)] + [(f"round: {k}", v) for k, v in r["round"]["parts"].items()] + [
                ("round", r["round"])]:
            x, s = row["compiled"], step["compiled"]
            lines.append(f"| {name} | {gb(x['bytes'])} | {x['kernels']} | {x['bytes'] / s['bytes']:.2f}x |" + (
                f" {gb(x['bytes_l2'])} | {x['bytes_l2'] / s['bytes_l2']:.2f}x |" if l2 else ""))
        lines += ["", f"round / step: bytes {c['bytes']:.2f}x, kernels {c['kernels']:.2f}x; roofline: step "
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
            lines.append(f"with intermediates of up to {GPU_TARGETS[c['for']]['l2'] // 2**21} MiB kept in L2: bytes "
                         f"{c['bytes_l2']:.2f}x; roofline: step {c['step_ms_l2']:.3f} ms, round {c['round_ms_l2']:.3f} ms; "
                         f"at tau {c['tau']}: speedup {c['speedup_l2']:.2f}x")
            lines.append(f"the same with every kernel costing at least {c['kernel_floor_us']:.1f} us (GPU_KERNEL_FLOOR_S, "
                         f"fitted to the first H200 run): step {c['step_ms_floor']:.3f} ms, round "
                         f"{c['round_ms_floor']:.3f} ms; at tau {c['tau']}: speedup {c['speedup_floor']:.2f}x")
    return "\n".join(lines)
