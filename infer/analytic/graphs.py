"""CUDA graphs of a program compiled for a GPU, read from XLA's thunk sequence: compile with XLA's
dump on (compile_with_thunks), then what the host launches and waits for per trip of the decode
loop (loop_launches)."""
from __future__ import annotations

import glob
import os
import re
import tempfile

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


def compile_with_thunks(lowered, options: dict):
    """Compile with XLA's dump on (a temporary directory): (executable, thunk sequence text or '')."""
    with tempfile.TemporaryDirectory() as d:
        exe = lowered.compile(compiler_options={**options, "xla_dump_to": d})
        files = sorted(glob.glob(os.path.join(d, "*thunk_sequence_after_thunk_passes.txt"))) or sorted(
            glob.glob(os.path.join(d, "*thunk_sequence.txt")))
        text = open(files[-1]).read() if files else ""
    return exe, text
