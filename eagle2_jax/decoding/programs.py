"""Compiled programs: ahead-of-time compilation with a cache keyed by static settings and the
shapes/dtypes/shardings of the inputs, so compile time can be measured apart from run time and a
new prompt inside a bucket never recompiles. Also the host-stepped streaming driver."""
from __future__ import annotations

import hashlib
import os
import time
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..platform import platform
from ..file_cache import cpu_signature, root
from ..sharding import to_host

# ---- CUDA graphs for the decode loops (GPU) ------------------------------------------------------------
# XLA runs a program's kernels as CUDA graphs (its command buffers). In a decode loop (vanilla.LOOP,
# eagle.LOOP: one lax.while_loop over steps or rounds) it records each trip's body as one graph but
# drives the loop from the host: every trip it runs the condition, copies it to the host and waits for
# the device before launching the next trip's graph (XLA's WhileThunk). The modes:
#   "body": XLA's default as described.
#   "loop": the whole while loop in one graph (CUDA conditional nodes, driver 12.3 or later): the host
#           launches it once per generate call and never waits inside it.
#   "off":  no graphs: every kernel launched from the host.
# "body" stays the default until a GPU has timed the others. Only loop programs take the option.
GPU_GRAPHS = ("body", "loop", "off")
# XLA's default command types (jax 0.10.2); compiler options replace the list, they cannot add to it
XLA_GRAPH_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,DYNAMIC_SLICE_FUSION,CONDITIONAL"


def gpu_graph_options(mode: str = "body") -> dict:
    """XLA compiler options that give a decode loop compiled for a GPU the graphs of `mode` (above)."""
    if mode not in GPU_GRAPHS:
        raise ValueError(f"gpu_graphs must be one of {', '.join(GPU_GRAPHS)}, got {mode!r}")
    if mode == "off":
        return {"xla_gpu_enable_command_buffer": ""}
    if mode == "loop":  # min graph size 1: a while loop is one command however short the sequence around it
        return {"xla_gpu_enable_command_buffer": XLA_GRAPH_COMMANDS + ",WHILE", "xla_gpu_graph_min_graph_size": 1}
    return {}


_ALL: list = []


def clear_all() -> None:
    """Drop every compiled program (e.g. after patching a function they trace)."""
    for p in _ALL:
        p._compiled.clear()


def _leaf_key(x):
    """Shape, dtype and placement of one input (arrays first: this runs per leaf per host call)."""
    if isinstance(x, jax.Array):
        return x.shape, x.dtype, x.sharding
    if isinstance(x, jax.ShapeDtypeStruct):
        return x.shape, x.dtype, x.sharding
    return np.shape(x), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None)


class Program:
    def __init__(self, fn: Callable, static: tuple, donate: tuple = (), loop: bool = False):
        """`donate`: names of arguments whose buffers the program may reuse for its outputs (the caller
        must not touch them afterwards), e.g. the decode state a host-stepped loop replaces each step.
        `loop`: the program is a decode loop on the device (a while loop over steps or rounds); on a GPU
        it is compiled with the CUDA-graph mode its caller asks for (`gpu_graph_options`)."""
        self.name = fn.__name__
        self.loop = loop
        self._jit = jax.jit(fn, static_argnames=static, donate_argnames=donate)
        self._compiled: dict = {}
        _ALL.append(self)

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def __call__(self, *args, timings: Optional[dict] = None, gpu_graphs: str = "body", **static):
        return self.compile(*args, timings=timings, gpu_graphs=gpu_graphs, **static)(*args)

    def compile(self, *args, timings: Optional[dict] = None, gpu_graphs: str = "body", **static):
        """The compiled executable for these inputs (compiled once per key, then cached)."""
        leaves, treedef = jax.tree_util.tree_flatten(args)
        options = self.compiler_options(gpu_graphs=gpu_graphs)
        key = (treedef, tuple(_leaf_key(x) for x in leaves), tuple(sorted(static.items(), key=lambda kv: kv[0])),
               tuple(sorted(options.items())))
        exe = self._compiled.get(key)
        if exe is None:
            t0 = time.perf_counter()
            exe = self._jit.lower(*args, **static).compile(compiler_options=options or None)
            self._compiled[key] = exe
            if timings is not None:
                timings["compile_s"] = timings.get("compile_s", 0.0) + time.perf_counter() - t0
        return exe

    def compiler_options(self, backend: Optional[str] = None, gpu_graphs: str = "body") -> dict:
        """XLA options this program is compiled with on `backend` (default: JAX's default backend)."""
        if self.loop and platform(backend) == "gpu":
            return gpu_graph_options(gpu_graphs)
        return {}


COMPILE_CACHE_SWITCH = "EAGLE2_JAX_COMPILE_CACHE"  # "0": no persistent compilation cache


def enable_compile_cache(path: Optional[str] = None) -> Optional[str]:
    """Keep compiled programs on disk (JAX's persistent compilation cache), so that a second run of
    the same programs loads them instead of compiling (tens of seconds per program and prompt bucket).

    Default directory: $EAGLE2_JAX_CACHE/xla (else ~/.cache/eagle2_jax/xla), one subdirectory per
    backend and, on CPU, per processor (XLA:CPU compiles for the host's instruction set). Leaves a
    directory the user already configured alone; EAGLE2_JAX_COMPILE_CACHE=0 turns it off. The
    command-line tools call this; the library never does on its own. Returns the directory or None.
    """
    if os.environ.get(COMPILE_CACHE_SWITCH, "1") == "0":
        return None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    if path is None:
        backend = jax.default_backend()
        tag = backend + ("-" + hashlib.sha256(cpu_signature().encode()).hexdigest()[:12] if backend == "cpu" else "")
        path = os.path.join(str(root()), "xla", tag)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return path


class Decoder(NamedTuple):
    """A decoding method's programs: PREFILL (prompts into the state), LOOP (every round on device, a
    `lax.while_loop` until each row is done; its input state donated), STEP (one round, its input kept:
    calibration walks reuse it) and STREAM_STEP (one round, its input donated: a host-stepped stream
    replaces the state every round, so the caches are updated in place)."""
    PREFILL: Program
    LOOP: Program
    STEP: Program
    STREAM_STEP: Program


def decoder(prefill_fn: Callable, round_fn: Callable) -> Decoder:
    """The programs of a decoding method from its prefill, `prefill_fn(params, *inputs, *, spec,
    cache_len, out_len, mesh)`, and its round, `round_fn(spec, params, state, sampling)`."""
    def loop(params, st, sampling, *, spec):
        return jax.lax.while_loop(lambda s: ~jnp.all(s.done_B), lambda s: round_fn(spec, params, s, sampling), st)

    def step(params, st, sampling, *, spec):
        return round_fn(spec, params, st, sampling)
    loop.__name__, step.__name__ = f"{round_fn.__name__}_loop", round_fn.__name__
    return Decoder(Program(prefill_fn, ("spec", "cache_len", "out_len", "mesh")),
                   Program(loop, ("spec",), donate=("st",), loop=True), Program(step, ("spec",)),
                   Program(step, ("spec",), donate=("st",)))


def run(programs: Decoder, args: tuple, static: dict, spec, rows: int, stream=None, timings: Optional[dict] = None,
        compile_only: bool = False, gpu_graphs: str = "body"):
    """Prefill (`PREFILL(*args, **static)`: the state after the prompt), then the whole decode on device
    (`LOOP(params, state, sampling, spec=spec)`), or stepped from the host when streaming (STREAM_STEP).

    The params are args[0], the sampling values args[-1]. `stream(row, tokens)` receives each row's new
    tokens as they are produced; `gpu_graphs` is the decode loop's CUDA-graph mode on a GPU. Returns the
    final state. With compile_only, compiles prefill and loop for these inputs (cached for the next call;
    the loop from the prefill's output shapes) and returns None.
    """
    params, sampling = args[0], args[-1]
    if compile_only:
        if stream is not None:
            raise ValueError("compile_only compiles the on-device loop; it cannot be combined with stream")
        exe = programs.PREFILL.compile(*args, timings=timings, **static)
        programs.LOOP.compile(params, exe.out_info, sampling, timings=timings, gpu_graphs=gpu_graphs, spec=spec)
        return None
    t0 = time.perf_counter()
    compile_before = (timings or {}).get("compile_s", 0.0)
    out = programs.PREFILL(*args, timings=timings, **static)
    if stream is None:
        out = programs.LOOP(params, out, sampling, timings=timings, gpu_graphs=gpu_graphs, spec=spec)
        jax.block_until_ready(out)
    else:
        seen = [0] * rows
        exe, exe_state_key = None, None
        while True:
            # the params are the same objects every round, so the executable is looked up again only
            # when the state's shapes or placement change (in practice once, after prefill): keying
            # every weight leaf each round cost host time per round
            state_key = tuple(_leaf_key(x) for x in jax.tree_util.tree_leaves(out))
            if state_key != exe_state_key:
                exe = programs.STREAM_STEP.compile(params, out, sampling, timings=timings, spec=spec)
                exe_state_key = state_key
            # dispatch the next round before reading this one's tokens: the device computes while the
            # host streams (the step consumes its input state, so the outputs are copied first; once
            # every row is done the round already dispatched changes nothing)
            snap = jax.tree_util.tree_map(jnp.copy, (out.out_BM, out.n_out_B, out.done_B))
            out = exe(params, out, sampling)
            _report(snap[0], snap[1], seen, stream)
            if bool(np.all(to_host(snap[2]))):
                break
    if timings is not None:
        total = time.perf_counter() - t0
        timings["run_s"] = total - (timings.get("compile_s", 0.0) - compile_before)
    return out


def _report(out, n_out, seen, stream):
    n = to_host(n_out)
    o = None
    for r in range(len(seen)):
        if n[r] > seen[r]:
            o = to_host(out) if o is None else o
            stream(r, o[r, seen[r]:n[r]].tolist())
            seen[r] = int(n[r])
