"""Per-backend defaults shared by the library and the command line.

dtype: bfloat16 weights and caches on GPU/TPU (where bf16 matmuls are native and a step is bound by
reading weights), float32 on CPU (XLA:CPU's bf16 dots are slow; the CPU backend's kernels and packed
GGUF blocks are float32).

tree: a head's `tree.json` may give one tree per platform ({"cpu": {...}, "gpu": {...}, "tpu": {...}})
or one flat tree (tuned on the CPU it was measured on: used there only). Without one, the
reference tree (depth 5, top_k 10, 60 tokens) everywhere: on GPU/TPU extra verified rows are nearly
free. `tree="auto"` (library) / `--total-tokens auto` (CLI) instead times rounds on the machine at
hand (eagle2_jax.autotune).
"""
from __future__ import annotations

import json
import os
from typing import Optional

import jax

from .config import TreeConfig

REFERENCE_TREE = TreeConfig(5, 10, 60)
TREE_FILE = "tree.json"


def platform(backend: Optional[str] = None) -> str:
    """'cpu', 'gpu' or 'tpu' for a JAX backend name (default: the default backend)."""
    b = backend or jax.default_backend()
    return "gpu" if b in ("gpu", "cuda", "rocm") else b


def default_dtype(backend: Optional[str] = None) -> str:
    return "float32" if platform(backend) == "cpu" else "bfloat16"


def head_tree(source: Optional[str], backend: Optional[str] = None) -> dict:
    """The tree fields a head's tree.json gives for this platform ({} when none)."""
    path = os.path.join(source or "", TREE_FILE)
    if not source or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt {path}: {e}") from None
    keys = ("depth", "top_k", "total_tokens")
    if any(k in d for k in keys):  # one flat tree: the CPU's
        d = d if platform(backend) == "cpu" else {}
    else:
        d = d.get(platform(backend), {})
    return {k: v for k, v in d.items() if k in keys}


def default_tree(draft=None, backend: Optional[str] = None) -> TreeConfig:
    """The head's tree for this platform, else the reference tree."""
    fields = head_tree(getattr(draft, "source", None), backend)
    return TreeConfig(**{**{k: getattr(REFERENCE_TREE, k) for k in ("depth", "top_k", "total_tokens")}, **fields})


# ---- CUDA graphs for the decode loops (GPU) ------------------------------------------------------------
# XLA runs a program's kernels as CUDA graphs (its command buffers). In a decode loop (vanilla.LOOP,
# eagle.LOOP: one lax.while_loop over steps or rounds) it records each trip's body as one graph but
# drives the loop from the host: every trip it runs the condition, copies it to the host and waits for
# the device before launching the next trip's graph (XLA's WhileThunk), so the device idles for a
# launch latency every step or round. The modes:
#   "body": XLA's default as described.
#   "loop": the whole while loop in one graph (CUDA conditional nodes, driver 12.3 or later): the host
#           launches it once per generate call and never waits inside it.
#   "off":  no graphs: every kernel launched from the host.
# Which is faster is for a GPU to tell (scripts/gpu_bench.sh times "body" against "loop"); "body"
# stays the default until one has. Only the loop programs take the option; other backends ignore it.
GPU_GRAPHS_SWITCH = "EAGLE2_JAX_GPU_GRAPHS"
GPU_GRAPHS = ("body", "loop", "off")
# XLA's default command types (jax 0.10.2); compiler options replace the list, they cannot add to it
XLA_GRAPH_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,DYNAMIC_SLICE_FUSION,CONDITIONAL"


def gpu_graphs(mode: Optional[str] = None) -> str:
    """The CUDA-graph mode of the decode loops: `mode`, else $EAGLE2_JAX_GPU_GRAPHS, else "body"."""
    m = mode or os.environ.get(GPU_GRAPHS_SWITCH) or "body"
    if m not in GPU_GRAPHS:
        src = "gpu graphs" if mode else GPU_GRAPHS_SWITCH
        raise ValueError(f"{src} must be one of {', '.join(GPU_GRAPHS)}, got {m!r}")
    return m


def gpu_graph_options(mode: Optional[str] = None) -> dict:
    """XLA compiler options that give a decode loop compiled for a GPU the graphs of `mode` (above)."""
    m = gpu_graphs(mode)
    if m == "off":
        return {"xla_gpu_enable_command_buffer": ""}
    if m == "loop":  # min graph size 1: a while loop is one command however short the sequence around it
        return {"xla_gpu_enable_command_buffer": XLA_GRAPH_COMMANDS + ",WHILE", "xla_gpu_graph_min_graph_size": 1}
    return {}
