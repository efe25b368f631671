"""The analytic round-cost report (infer.analytic), checked against facts known independently of its
code: programs whose bytes and kernels are known by construction (an elementwise add, a matmul, a
row slice, a loop of known trips) compiled by XLA:CPU, hand-written HLO with hand-counted answers,
XLA's own thunk sequences and flag names, and the weights a decoding step must read."""
import glob
import json
import re
import shutil
import tempfile
import warnings

import jax
import jax.numpy as jnp
import pytest

from eagle2_jax.decoding import eagle, vanilla
from eagle2_jax.decoding.programs import GPU_GRAPHS, XLA_GRAPH_COMMANDS, gpu_graph_options
from helpers import tiny_config
from infer import roundcost
from infer.analytic import (analyze, breakdown, count_kernels, format_report, hbm_traffic, loop_launches, placement,
                            report as report_module)

F32 = 4  # bytes


def _config(layers=2):
    return tiny_config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers)


def _matmul_weights(c, layers=None):
    """Elements of the weights every decoding step multiplies by: each layer's projections and the LM head."""
    layer = (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
             + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    return (c.num_hidden_layers if layers is None else layers) * layer + c.vocab_size * c.hidden_size, layer


@pytest.fixture(scope="module")
def shape(tmp_path_factory):
    d = tmp_path_factory.mktemp("shape")

    def write(layers):
        p = d / f"config{layers}.json"
        p.write_text(json.dumps(_config(layers).to_hf_dict()))
        return f"random:{p}"
    return write


# ---- the report end to end, on a tiny random model ---------------------------------------------

@pytest.fixture(scope="module")
def report(shape, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "r.json"
    roundcost.main(["--analytic", "--model", shape(2), "--dtype", "float32", "--batch", "1", "--depth", "2",
                    "--top-k", "3", "--total-tokens", "6", "--prompt-len", "8", "--max-new-tokens", "16",
                    "--draft-vocab", "128", "--tau", "2.5", "--json", str(out)])
    return json.loads(out.read_text())


def test_analytic_report_runs_end_to_end_and_writes_json(report):
    r = report
    assert set(r) >= {"step", "round", "roofline", "ratios", "meta"}
    assert set(r["step"]) == {"bytes", "flops", "kernels", "bytes_by_kind"}
    assert set(r["round"]["parts"]) == {"draft", "verify", "accept"}
    for c in (r["step"], r["round"], *r["round"]["parts"].values()):  # the breakdown accounts for XLA's own count
        assert abs(sum(c["bytes_by_kind"].values()) - c["bytes"]) <= 0.05 * c["bytes"], c
    w, _ = _matmul_weights(_config())
    # a step multiplies every weight once (2 FLOPs a weight) and reads it (float32: 4 bytes)
    assert r["step"]["flops"] >= 2 * w and r["step"]["bytes"] >= F32 * w
    assert r["step"]["bytes_by_kind"]["matmul"] >= F32 * w
    # verification runs the tree's 6 tokens through the same weights
    verify = r["round"]["parts"]["verify"]
    assert verify["flops"] >= 6 * 2 * w and verify["bytes"] >= F32 * w
    assert r["round"]["kernels"] > r["step"]["kernels"] > 0


def test_analytic_bytes_grow_with_layers(shape):
    """A while loop's body is counted once by XLA: the analysis unrolls the layers, so every layer
    adds the same bytes, at least its weights (each counted once, not sliced out of a stack)."""
    b = {L: analyze(shape(L), "float32", 1, 8, 16, 2, 3, 6, 0, 2.0, "h200", kernels=False)["step"]["bytes"]
         for L in (2, 4, 6)}
    _, layer = _matmul_weights(_config())
    assert b[6] - b[4] == b[4] - b[2] >= F32 * layer, b


def test_compiled_rows_on_cpu_and_their_labels(shape, monkeypatch):
    """The compiled path (normally XLA's GPU compiler, deviceless) run on XLA:CPU's compile of the
    same programs: the fused programs move less than the unfused count, a trip of the decode loop
    still reads every weight (weights are inputs: no L2 rule keeps them), and the text says which
    figure is the compiled bound and which are estimates."""
    monkeypatch.setattr(report_module, "placement", lambda accelerator: (lambda tree: tree))  # compile here
    r = analyze(shape(2), "float32", 1, 8, 16, 2, 3, 6, 0, 2.5, "h200", kernels=False, compile_for="h200")
    w, _ = _matmul_weights(_config())
    step, rnd, verify = r["step"]["compiled"], r["round"]["compiled"], r["round"]["parts"]["verify"]
    assert 0 < verify["compiled"]["bytes"] < verify["bytes"]
    assert step["bytes"] >= F32 * w and step["bytes_l2"] >= F32 * w
    assert rnd["kernels"] > step["kernels"] > 0
    text = format_report(r)
    assert "HBM bytes, compiled bound (all in HBM)" in text and "compiled bound (all in HBM): round / step" in text
    assert text.count("estimate (L2 rule: results up to 25 MiB stay in L2)") == 2  # the column and the roofline
    assert "estimate (2.5 us kernel floor fitted to one small-model run" in text


# ---- programs whose bytes and kernels are known by construction (XLA:CPU) -------------------------

def _compiled(f, *args, donate=()):
    lo = jax.jit(f, donate_argnums=donate).lower(*args)
    return lo, lo.compile().as_text()


def test_an_elementwise_add_reads_two_arrays_and_writes_one():
    x = jnp.zeros(1024, jnp.float32)  # 4096 bytes
    lo, text = _compiled(lambda a, b: a + b, x, x)
    assert count_kernels(text) == 1
    assert hbm_traffic(text) == {"bytes": 2 * 4096 + 4096, "kernels": 1}
    assert breakdown(lo.as_text(dialect="hlo")) == {"matmul": 0, "kernel": 0, "reduce": 0, "data movement": 0,
                                                    "elementwise": 3 * 4096}


def test_a_matmul_reads_both_operands_and_writes_the_product():
    M, K, N = 8, 32, 16
    lo, text = _compiled(lambda a, b: a @ b, jnp.zeros((M, K)), jnp.zeros((K, N)))
    want = (M * K + K * N) * F32 + M * N * F32
    assert hbm_traffic(text) == {"bytes": want, "kernels": 1}
    assert breakdown(lo.as_text(dialect="hlo"))["matmul"] == want


def test_two_independent_matmuls_are_two_kernels():
    lo, text = _compiled(lambda a, b, c, d: (a @ b, c @ d), jnp.zeros((8, 32)), jnp.zeros((32, 16)),
                         jnp.zeros((4, 8)), jnp.zeros((8, 2)))
    assert count_kernels(text) == 2
    assert hbm_traffic(text) == {"bytes": F32 * ((8 * 32 + 32 * 16 + 8 * 16) + (4 * 8 + 8 * 2 + 4 * 2)), "kernels": 2}


def test_a_reduction_reads_its_input_and_writes_one_value_a_row():
    lo, text = _compiled(lambda x: x.sum(axis=1), jnp.zeros((8, 16)))
    want = F32 * (8 * 16 + 1 + 8)  # the rows, the initial 0.0, the sums
    assert hbm_traffic(text) == {"bytes": want, "kernels": 1}
    assert breakdown(lo.as_text(dialect="hlo"))["reduce"] == want


def test_a_row_read_or_written_in_place_costs_the_row_not_the_table():
    """A slice, a gather and an in-place update (a KV cache write: the buffer donated) of a
    f32[1000,16] table move the rows, and the index, never the 64 KB table."""
    table, row, index = jnp.zeros((1000, 16)), 16 * F32, 4
    _, text = _compiled(lambda t, i: jax.lax.dynamic_slice_in_dim(t, i, 1), table, jnp.int32(3))
    assert hbm_traffic(text) == {"bytes": row + index + row, "kernels": 1}
    _, text = _compiled(lambda t, ids: t[ids], table, jnp.zeros(3, jnp.int32))
    assert hbm_traffic(text) == {"bytes": 3 * row + 3 * index + 3 * row, "kernels": 1}
    _, text = _compiled(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (i, 0)), table, jnp.zeros((1, 16)),
                        jnp.int32(3), donate=(0,))
    assert hbm_traffic(text) == {"bytes": row + index + row, "kernels": 1}


def test_a_loops_trips_multiply_its_body():
    """fori_loop(0, n): each trip runs the body (sin(x) * 2 over 4 KB: read and written; the counter
    i + 1: two scalars read, one written) once; the HLO text holds the body once, whatever n."""
    x = jnp.zeros(1024)

    def trips(n):
        return lambda a: jax.lax.fori_loop(0, n, lambda i, v: jnp.sin(v) * 2.0, a)
    loop = {n: _compiled(trips(n), x)[1] for n in (3, 7)}
    r = {n: hbm_traffic(text) for n, text in loop.items()}
    assert r[7]["kernels"] - r[3]["kernels"] == 4 * 2
    assert r[7]["bytes"] - r[3]["bytes"] == 4 * ((4096 + 4096) + (4 + 4 + 4))
    assert count_kernels(loop[7]) == count_kernels(loop[3])
    one_trip = hbm_traffic(loop[7], loop=True)
    assert one_trip == {"bytes": (4096 + 4096) + (4 + 4 + 4), "kernels": 2}


def test_a_fused_program_reads_the_weights_once():

    def f(x, w1, w2):
        return jnp.tanh(jnp.maximum(x @ w1, 0.0) * 2.0 + 1.0) @ w2  # elementwise work fused between two dots
    args = (jnp.zeros((4, 512)), jnp.zeros((512, 1024)), jnp.zeros((1024, 512)))
    lo, text = _compiled(f, *args)
    weights = 2 * F32 * 512 * 1024
    # the weights once, and the small activations (at most a few passes over them)
    assert weights <= hbm_traffic(text)["bytes"] <= weights + 4 * F32 * 4 * (512 + 1024)


# ---- hand-written compiled HLO, counted by hand ---------------------------------------------------

# a compiled (fused, memory-space-assigned) module in the form XLA's TPU compiler prints; sizes:
# f32[4,256,256] 1 MiB stacked weights, f32[256,256] 256 KiB one layer, f32[8,256] 8 KiB rows
_COMPILED = """HloModule jit_f, is_scheduled=true

%sliced (p0: f32[4,256,256], p1: s32[], p2: f32[8,256]) -> f32[8,256] {
  %p0 = f32[4,256,256]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,256,256]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,256,256}
  %w = f32[256,256]{1,0} bitcast(%ds)
  %p2 = f32[8,256]{1,0} parameter(2)
  ROOT %d = f32[8,256]{1,0} dot(%p2, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%update (q0: f32[64,256], q1: f32[8,256], q2: s32[]) -> f32[64,256] {
  %q0 = f32[64,256]{1,0} parameter(0)
  %q1 = f32[8,256]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f32[64,256]{1,0} dynamic-update-slice(%q0, %q1, %q2, %z)
}

%body (t: (s32[], f32[8,256])) -> (s32[], f32[8,256]) {
  %t = (s32[], f32[8,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,256]{1,0} get-tuple-element(%t), index=1
  %e = f32[8,256]{1,0} exponential(%x)
  ROOT %r = (s32[], f32[8,256]{1,0}) tuple(%i, %e)
}

%cond (t: (s32[], f32[8,256])) -> pred[] {
  %t = (s32[], f32[8,256]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[4,256,256], b: f32[8,256], c: f32[64,256], i: s32[], v: f32[256,256]) -> f32[64,256] {
  %a = f32[4,256,256]{2,1,0} parameter(0)
  %b = f32[8,256]{1,0} parameter(1)
  %c = f32[64,256]{1,0} parameter(2)
  %i = s32[] parameter(3)
  %v = f32[256,256]{1,0} parameter(4)
  %f = f32[8,256]{1,0} fusion(%a, %i, %b), kind=kOutput, calls=%sliced
  %cs = (f32[256,256]{1,0:S(1)}, f32[256,256]{1,0}, u32[]{:S(2)}) copy-start(%v)
  %cd = f32[256,256]{1,0:S(1)} copy-done(%cs)
  %g = f32[8,256]{1,0} dot(%f, %cd), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %t0 = (s32[], f32[8,256]{1,0}) tuple(%i, %g)
  %w = (s32[], f32[8,256]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %h = f32[8,256]{1,0} get-tuple-element(%w), index=1
  ROOT %o = f32[64,256]{1,0} fusion(%c, %h, %i), kind=kLoop, calls=%update
}
"""

ROWS, LAYER = 8 * 256 * F32, 256 * 256 * F32  # f32[8,256] rows, f32[256,256] one layer's weights
COMPILED_BYTES = (LAYER + 4 + ROWS + ROWS  # the fusion: one layer's slice of the stack (not all 4), index, rows, result
                  + LAYER  # the copy into on-chip memory: read once; the dot then reads it there for free
                  + ROWS + ROWS  # the dot: its rows in, its result out (the weights are on chip)
                  + 3 * (ROWS + ROWS)  # the loop body's kernel, 3 trips
                  + ROWS + 4 + ROWS)  # the in-place update: update (and index) read and written, not the 64-row buffer


def test_hbm_traffic_charges_fused_kernels_by_what_they_move():
    r = hbm_traffic(_COMPILED, top=10)
    assert r["bytes"] == COMPILED_BYTES, (r["bytes"], COMPILED_BYTES, r["top"])
    assert r["kernels"] == 1 + 1 + 3 + 1  # fusion, dot, 3 exponentials, update (the copy is a DMA beside them)
    assert max(r["top"])[0] == LAYER + 4 + 2 * ROWS and max(r["top"])[1] == "f"
    one_trip = hbm_traffic(_COMPILED, loop=True)  # a decode loop's step: the body once, nothing around it
    assert one_trip == {"bytes": ROWS + ROWS, "kernels": 1}


def test_hbm_traffic_times_each_kernel_with_a_floor():
    """With a bandwidth, each kernel costs its bytes at that bandwidth but at least the floor; the
    asynchronous copy costs its bytes (no floor: a DMA); loop trips multiply."""
    bw, floor = 1e9, 20e-6  # the slicing fusion (278 KB: 279 us) is above the floor, the 16 KB kernels below
    r = hbm_traffic(_COMPILED, bytes_per_s=bw, kernel_floor_s=floor)
    assert r["seconds"] == pytest.approx((LAYER + 4 + 2 * ROWS) / bw + LAYER / bw + floor + 3 * floor + floor,
                                         rel=1e-12)
    assert hbm_traffic(_COMPILED, bytes_per_s=bw)["seconds"] == pytest.approx(COMPILED_BYTES / bw, rel=1e-12)
    assert hbm_traffic(_COMPILED, loop=True, bytes_per_s=bw, kernel_floor_s=floor)["seconds"] == pytest.approx(floor)
    assert "seconds" not in hbm_traffic(_COMPILED)


# ---- compiled for a TPU or a GPU without one (deviceless; where libtpu / the CUDA plugin is installed)

def test_compile_for_tpu_without_a_tpu(shape):
    """Where libtpu is installed (jax[tpu]; run with JAX_PLATFORMS=cpu), the report compiles the
    programs with XLA's TPU compiler here and adds the fused programs' HBM bytes and kernels."""
    pytest.importorskip("libtpu")
    if jax.default_backend() != "cpu":
        pytest.skip("the deviceless compile is checked where no TPU is attached")
    r = analyze(shape(2), "bfloat16", 1, 8, 16, 2, 3, 6, 128, 2.5, "tpu-v6e", kernels=False, compile_for="tpu-v6e")
    step, rnd, verify = r["step"]["compiled"], r["round"]["compiled"], r["round"]["parts"]["verify"]
    assert rnd["kernels"] > step["kernels"] > 0  # (at this size the loops keep everything on chip: bytes ~0)
    assert 0 < verify["compiled"]["bytes"] < verify["bytes"]  # fused: below the count of every op's operands
    text = format_report(r)
    assert "compiled by XLA for Google TPU v6e" in text and "compiled bound (all in HBM)" in text
    assert "estimate" not in text  # no L2 rule or kernel floor for a TPU


@pytest.mark.slow  # two full deviceless GPU compiles of every program
def test_compile_for_a_gpu_without_one(shape):
    """Where the CUDA plugin is installed (jax-cuda13-plugin and -pjrt matching jax, ptxas on PATH;
    run with JAX_PLATFORMS=cpu), the report compiles the programs with XLA's GPU compiler for an
    H200 described by its target config, and adds the fused programs' HBM bytes and kernels, and
    what the host launches per trip under each CUDA-graph mode."""
    pytest.importorskip("jax_plugins.xla_cuda13")
    if shutil.which("ptxas") is None:
        pytest.skip("no ptxas (a CUDA toolkit) on PATH")
    if jax.default_backend() != "cpu":
        pytest.skip("the deviceless compile is checked where no GPU is attached")
    r = analyze(shape(2), "bfloat16", 1, 8, 16, 2, 3, 6, 128, 2.5, "h200", kernels=False, compile_for="h200")
    step, rnd, verify = r["step"]["compiled"], r["round"]["compiled"], r["round"]["parts"]["verify"]
    assert rnd["kernels"] > step["kernels"] > 0 and rnd["bytes"] > step["bytes"] > 0
    assert 0 < verify["compiled"]["bytes"] < verify["bytes"]  # fused: below the count of every op's operands
    text = format_report(r)
    assert "compiled by XLA for NVIDIA H200" in text and "compiled bound (all in HBM)" in text
    assert "estimate (L2 rule: results up to 25 MiB stay in L2)" in text
    assert "estimate (2.5 us kernel floor fitted to one small-model run" in text
    # CUDA graphs, XLA's default: each trip's body one graph, the host waits on the condition every trip
    for h in (step["host"], rnd["host"]):
        assert not h["in_graph"] and h["graphs"] >= 1 and h["syncs"] == 1 and h["kernels"] > 0
    assert rnd["host"]["kernels"] > step["host"]["kernels"] and "1 wait for the device" in text
    loop = analyze(shape(2), "bfloat16", 1, 8, 16, 2, 3, 6, 128, 2.5, "h200", kernels=False, compile_for="h200",
                   gpu_graphs="loop")
    for k in ("step", "round"):  # the whole loop in one graph: nothing per trip
        h = loop[k]["compiled"]["host"]
        assert h["in_graph"] and h["launches"] == h["syncs"] == 0 and h["kernels"] == r[k]["compiled"]["host"]["kernels"]
    assert "runs inside one graph" in format_report(loop)


def test_loop_graph_commands_are_xlas_default_plus_while(tmp_path):
    """`loop` mode replaces XLA's list of graph command types (options cannot add to it): the copy in
    eagle2_jax.decoding.programs must stay XLA's own default, read here from the options XLA's GPU compiler reports."""
    pytest.importorskip("jax_plugins.xla_cuda13")
    if shutil.which("ptxas") is None or jax.default_backend() != "cpu":
        pytest.skip("needs ptxas and the deviceless compile (JAX_PLATFORMS=cpu)")
    x = placement("h200")(jnp.zeros((8, 8), jnp.float32))
    jax.jit(lambda a: a * 2).lower(x).compile(compiler_options={"xla_dump_to": str(tmp_path)})
    text = open(glob.glob(str(tmp_path / "*jit__lambda.config.pbtxt"))[0]).read()
    default = set(re.findall(r"xla_gpu_enable_command_buffer: (\w+)", text))
    assert default == set(XLA_GRAPH_COMMANDS.split(","))


# ---- CUDA graphs -------------------------------------------------------------------------------

# XLA's thunk sequences as its dump writes them (trimmed): a decode loop whose body is one graph (XLA's
# default), the whole loop inside a graph (WHILE commands on), and no graphs at all
_BODY_GRAPH = """000: kCommandBuffer [source       | next=065 (1)]
    001: kCustomKernel [source | sink] wrapped_transpose grid: [1024, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
065: kWhile         [prev=000 (1) | sink        ]
condition:
    066: kCustomKernel [source | sink] wrapped_not grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    000: kCommandBuffer [source | sink]
        067: kCopy         [source       | next=068 (1)  ] kCopy
        068: kCustomKernel [prev=067 (1) | next=069 (1)] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
        069: kCustomKernel [prev=068 (1) | sink] gemm_fusion_dot grid: [2048, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes
"""
_LOOP_GRAPH = """000: kCommandBuffer [source | sink]
    001: kCopy  [source       | next=003 (2)] kCopy
    003: kWhile [prev=002 (1) | sink        ]
condition:
        004: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        005: kCustomKernel [source       | sink        ] loop_add_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
        006: kCustomKernel [source       | next=007 (1)] gemm_fusion_dot grid: [2048, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes
"""
_NO_GRAPH = """001: kCopy  [source       | next=003 (2)] kCopy
003: kWhile [prev=002 (1) | sink        ]
condition:
    004: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    005: kCustomKernel [source       | sink        ] loop_add_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    006: kCustomKernel [source       | next=007 (1)] gemm_fusion_dot grid: [2048, 1, 1] threads: [64, 1, 1]  shared_memory: 768 bytes
    007: kCopy  [source       | sink] kCopy
"""


def test_loop_launches_reads_what_the_host_does_per_trip():
    # the condition kernel and the body's graph each trip, then the wait on the copied condition
    assert loop_launches(_BODY_GRAPH) == dict(in_graph=False, launches=2, graphs=1, syncs=1, kernels=3)
    assert loop_launches(_LOOP_GRAPH) == dict(in_graph=True, launches=0, graphs=0, syncs=0, kernels=3)
    assert loop_launches(_NO_GRAPH) == dict(in_graph=False, launches=4, graphs=0, syncs=1, kernels=3)
    assert loop_launches(_NO_GRAPH.split("003:")[0]) is None  # no loop


def _debug_options(options: dict) -> str:
    """The debug options XLA:CPU's compiler parsed from `options` (its dump): XLA checks every option's
    name and value, whatever the backend it is for."""
    with tempfile.TemporaryDirectory() as d:
        jax.jit(lambda a: a * 2).lower(jnp.zeros(4)).compile(compiler_options={**options, "xla_dump_to": d})
        return open(glob.glob(d + "/*.debug_options")[0]).read()


def test_gpu_graph_modes_are_options_xla_reads():
    """The CUDA-graph modes are XLA flags by XLA's own names: "body" leaves XLA's default alone,
    "off" empties the list of command types graphed, "loop" adds WHILE (graph of any size); the
    decode loops (and only they) take the mode on a GPU."""
    assert gpu_graph_options("body") == {} and gpu_graph_options() == {}
    assert gpu_graph_options("off") == {"xla_gpu_enable_command_buffer": ""}
    loop = _debug_options(gpu_graph_options("loop"))
    assert set(re.findall(r"xla_gpu_enable_command_buffer: (\w+)", loop)) == {*XLA_GRAPH_COMMANDS.split(","), "WHILE"}
    assert re.search(r"xla_gpu_graph_min_graph_size: 1\b", loop)
    assert "xla_gpu_enable_command_buffer" not in _debug_options(gpu_graph_options("off"))
    with pytest.raises(Exception, match="No such compile option"):  # (a misspelt flag would be refused)
        _debug_options({"xla_gpu_enable_command_buffers": ""})
    with pytest.raises(ValueError, match="gpu_graphs must be one of"):
        gpu_graph_options("always")
    for mode in GPU_GRAPHS:
        for p in (eagle.LOOP, vanilla.LOOP):
            assert p.compiler_options("gpu", gpu_graphs=mode) == gpu_graph_options(mode)
            assert p.compiler_options("cpu", gpu_graphs=mode) == {}
        assert eagle.STREAM_STEP.compiler_options("gpu", gpu_graphs=mode) == {}
        assert eagle.PREFILL.compiler_options("gpu", gpu_graphs=mode) == {}


# ---- hand-written compiled HLO: TPU copies, library calls, the L2 rule, scatters, loops ----------

_SLICED_COPY = """HloModule m, is_scheduled=true

%f (a: f32[8,256]) -> f32[8,256] {
  %a = f32[8,256]{1,0} parameter(0)
  ROOT %e = f32[8,256]{1,0} exponential(%a)
}

ENTRY %main (p: f32[8,256]) -> f32[8,256] {
  %p = f32[8,256]{1,0} parameter(0)
  %buf = f32[8,256]{1,0} custom-call(), custom_call_target="AllocateBuffer"
  %s0 = ((f32[8,256]{1,0}), f32[4,256]{1,0:S(1)}, s32[]) slice-start(%p), slice={[0:4], [0:256]}
  %s1 = ((f32[8,256]{1,0}), f32[4,256]{1,0:S(1)}, s32[]) slice-start(%p), slice={[4:8], [0:256]}
  %d0 = f32[4,256]{1,0:S(1)} slice-done(%s0)
  %d1 = f32[4,256]{1,0:S(1)} slice-done(%s1)
  %c = f32[8,256]{1,0:S(1)} custom-call(%d0, %d1), custom_call_target="ConcatBitcast"
  ROOT %r = f32[8,256]{1,0} fusion(%c), kind=kLoop, calls=%f
}
"""


def test_hbm_traffic_runs_no_kernel_for_a_sliced_copys_bitcast():
    """XLA's TPU compiler splits a copy into on-chip memory into slices (asynchronous DMAs) and joins
    them with a ConcatBitcast custom call, and marks buffers with AllocateBuffer: neither runs a kernel."""
    r = hbm_traffic(_SLICED_COPY)
    assert r["kernels"] == 1  # the fusion
    assert r["bytes"] == 8 * 256 * 4 + 8 * 256 * 4  # the two slices read from HBM, the fusion's result written


def test_hbm_traffic_does_not_charge_a_library_calls_workspace():
    """cuBLAS and cuDNN calls return their scratch workspace beside the result: it is never read
    from or written to HBM as data, so only the operands and the result are charged."""
    text = """HloModule m, is_scheduled=true

ENTRY %main (a: bf16[16,4096], w: bf16[4096,4096]) -> bf16[16,4096] {
  %a = bf16[16,4096]{1,0} parameter(0)
  %w = bf16[4096,4096]{1,0} parameter(1)
  %g = (bf16[16,4096]{1,0}, s8[4194304]{0}) custom-call(%a, %w), custom_call_target="__cublas$lt$matmul"
  ROOT %o = bf16[16,4096]{1,0} get-tuple-element(%g), index=0
}
"""
    r = hbm_traffic(text)
    assert r == {"bytes": 2 * (16 * 4096 + 4096 * 4096 + 16 * 4096), "kernels": 1}


def test_hbm_traffic_keeps_small_intermediates_in_a_gpus_l2():
    """With a GPU's L2 size, a kernel's result that fits half of it and is read back before half the
    L2 has streamed through is read from L2 and never written to HBM; read later, its write and that
    read are charged. Inputs (weights) and the program's output always are."""

    def module(between):  # partial sums, then (optionally) a kernel streaming a big weight, then their sum
        mid = "\n  %h = bf16[64,8192]{1,0} fusion(%x, %u), kind=kCustom, calls=%big" if between else ""
        root_args = "%b, %h" if between else "%b"
        sum_params = "q0: f32[8,64,4096], q1: bf16[64,8192]" if between else "q0: f32[8,64,4096]"
        return f"""HloModule m, is_scheduled=true

%split (p0: bf16[64,4096], p1: bf16[4096,4096]) -> f32[8,64,4096] {{
  %p0 = bf16[64,4096]{{1,0}} parameter(0)
  %p1 = bf16[4096,4096]{{1,0}} parameter(1)
  ROOT %d = f32[8,64,4096]{{2,1,0}} custom-call(%p0, %p1), custom_call_target="partials"
}}

%big (r0: bf16[64,4096], r1: bf16[4096,8192]) -> bf16[64,8192] {{
  %r0 = bf16[64,4096]{{1,0}} parameter(0)
  %r1 = bf16[4096,8192]{{1,0}} parameter(1)
  ROOT %e = bf16[64,8192]{{1,0}} custom-call(%r0, %r1), custom_call_target="matmul"
}}

%sum ({sum_params}) -> bf16[64,4096] {{
  %q0 = f32[8,64,4096]{{2,1,0}} parameter(0)
  ROOT %r = bf16[64,4096]{{1,0}} custom-call(%q0), custom_call_target="reduce"
}}

ENTRY %main (x: bf16[64,4096], w: bf16[4096,4096], u: bf16[4096,8192]) -> bf16[64,4096] {{
  %x = bf16[64,4096]{{1,0}} parameter(0)
  %w = bf16[4096,4096]{{1,0}} parameter(1)
  %u = bf16[4096,8192]{{1,0}} parameter(2)
  %f = f32[8,64,4096]{{2,1,0}} fusion(%x, %w), kind=kCustom, calls=%split
  %b = f32[8,64,4096]{{2,1,0}} bitcast(%f){mid}
  ROOT %g = bf16[64,4096]{{1,0}} fusion({root_args}), kind=kInput, calls=%sum
}}
"""
    x, w, u, partial = 64 * 4096 * 2, 4096 * 4096 * 2, 4096 * 8192 * 2, 8 * 64 * 4096 * 4
    near, far = module(False), module(True)
    assert hbm_traffic(near)["bytes"] == (x + w + partial) + (partial + x)
    L2 = 50 * 2**20
    assert hbm_traffic(near, l2_bytes=L2)["bytes"] == x + w + x  # the partial sums stay in L2; the output is written
    assert hbm_traffic(near, l2_bytes=2 * partial - 2)["bytes"] == (x + w + partial) + partial + x  # too big for it
    # 64 MB of weights stream through between the write and the read: the partials went to HBM and back;
    # %h (1 MiB, read right after its write) stays in L2: the 0
    assert hbm_traffic(far, l2_bytes=L2)["bytes"] == (x + w) + (x + u) + (partial + partial + 0 + x)


def test_hbm_traffic_charges_an_in_place_scatter_its_updates():
    text = """HloModule m, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%scat (p0: f32[1024,256], p1: s32[8,1], p2: f32[8,256]) -> f32[1024,256] {
  %p0 = f32[1024,256]{1,0} parameter(0)
  %p1 = s32[8,1]{1,0} parameter(1)
  %p2 = f32[8,256]{1,0} parameter(2)
  ROOT %sc = f32[1024,256]{1,0} scatter(%p0, %p1, %p2), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

ENTRY %main (c: f32[1024,256], i: s32[8,1], u: f32[8,256]) -> f32[1024,256] {
  %c = f32[1024,256]{1,0} parameter(0)
  %i = s32[8,1]{1,0} parameter(1)
  %u = f32[8,256]{1,0} parameter(2)
  ROOT %o = f32[1024,256]{1,0} fusion(%c, %i, %u), kind=kLoop, calls=%scat
}
"""
    rows = 8 * 256 * 4
    assert hbm_traffic(text) == {"bytes": 8 * 4 + rows + rows, "kernels": 1}  # not the 1 MiB buffer


def _loop_module(init: int, cond_root: str) -> str:
    """A while loop with no known_trip_count: state (i, x), body x -> exp(x), i -> i + 1."""
    return f"""HloModule m, is_scheduled=true

%body (t: (s32[], f32[8,256])) -> (s32[], f32[8,256]) {{
  %t = (s32[], f32[8,256]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,256]{{1,0}} get-tuple-element(%t), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %e = f32[8,256]{{1,0}} exponential(%x)
  ROOT %r = (s32[], f32[8,256]{{1,0}}) tuple(%j, %e)
}}

%cond (t: (s32[], f32[8,256])) -> pred[] {{
  %t = (s32[], f32[8,256]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(5)
  {cond_root}
}}

ENTRY %main (b: f32[8,256]) -> f32[8,256] {{
  %b = f32[8,256]{{1,0}} parameter(0)
  %z = s32[] constant({init})
  %t0 = (s32[], f32[8,256]{{1,0}}) tuple(%z, %b)
  %w = (s32[], f32[8,256]{{1,0}}) while(%t0), condition=%cond, body=%body
  ROOT %h = f32[8,256]{{1,0}} get-tuple-element(%w), index=1
}}
"""


def test_hbm_traffic_counts_a_loops_trips_from_its_condition():
    """No known_trip_count (XLA's TPU compiler leaves none): `i < N` or `N > i` from a constant start."""
    lt = "ROOT %c = pred[] compare(%i, %n), direction=LT"
    gt = "ROOT %c = pred[] compare(%n, %i), direction=GT"
    assert hbm_traffic(_loop_module(0, lt))["kernels"] == 2 * 5  # the add and the exponential, 5 trips
    assert hbm_traffic(_loop_module(0, gt))["kernels"] == 2 * 5
    assert hbm_traffic(_loop_module(2, lt))["kernels"] == 2 * 3  # a loop peeled by two starts at 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = hbm_traffic(_loop_module(0, "ROOT %c = pred[] compare(%i, %i), direction=NE"))
    assert r["kernels"] == 2 and any("counted once" in str(w.message) for w in caught)


def _l2_module(between: str, params: str, root_extra: str = "") -> str:
    """Partial sums (f32[8,64,4096], 8 MiB) written, `between`, then summed (a GPU's L2 tests)."""
    return f"""HloModule m, is_scheduled=true

%split (p0: bf16[64,4096], p1: bf16[4096,4096]) -> f32[8,64,4096] {{
  %p0 = bf16[64,4096]{{1,0}} parameter(0)
  %p1 = bf16[4096,4096]{{1,0}} parameter(1)
  ROOT %d = f32[8,64,4096]{{2,1,0}} custom-call(%p0, %p1), custom_call_target="partials"
}}

%sum (q0: f32[8,64,4096]) -> bf16[64,4096] {{
  %q0 = f32[8,64,4096]{{2,1,0}} parameter(0)
  ROOT %r = bf16[64,4096]{{1,0}} custom-call(%q0), custom_call_target="reduce"
}}

%one_layer (s0: bf16[64,4096,4096], s1: s32[]) -> bf16[4096,4096] {{
  %s0 = bf16[64,4096,4096]{{2,1,0}} parameter(0)
  %s1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,4096,4096]{{2,1,0}} dynamic-slice(%s0, %s1, %z, %z), dynamic_slice_sizes={{1,4096,4096}}
  ROOT %l = bf16[4096,4096]{{1,0}} bitcast(%ds)
}}

%stream_body (t: (s32[], bf16[4096,8192])) -> (s32[], bf16[4096,8192]) {{
  %t = (s32[], bf16[4096,8192]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %u = bf16[4096,8192]{{1,0}} get-tuple-element(%t), index=1
  %v = bf16[4096,8192]{{1,0}} negate(%u)
  ROOT %r = (s32[], bf16[4096,8192]{{1,0}}) tuple(%i, %v)
}}

%stream_cond (t: (s32[], bf16[4096,8192])) -> pred[] {{
  %t = (s32[], bf16[4096,8192]{{1,0}}) parameter(0)
  ROOT %c = pred[] constant(true)
}}

ENTRY %main (x: bf16[64,4096], w: bf16[4096,4096]{params}) -> bf16[64,4096] {{
  %x = bf16[64,4096]{{1,0}} parameter(0)
  %w = bf16[4096,4096]{{1,0}} parameter(1)
  %f = f32[8,64,4096]{{2,1,0}} fusion(%x, %w), kind=kCustom, calls=%split
  {between}
  ROOT %g = bf16[64,4096]{{1,0}} fusion(%f), kind=kInput, calls=%sum{root_extra}
}}
"""


def test_the_l2_turns_over_by_what_kernels_and_loops_move():
    """A kernel that slices one layer (32 MiB) out of a 2 GiB stack turns the L2 over by the slice
    (read and written: 64 MiB); a loop that streams 128 MiB in between evicts the partial sums
    (their write and read charged)."""
    L2 = 200 * 2**20  # results of up to 100 MiB may stay, until 100 MiB more have streamed
    x, w, partial, layer = 64 * 4096 * 2, 4096 * 4096 * 2, 8 * 64 * 4096 * 4, 4096 * 4096 * 2
    sliced = _l2_module("%s = bf16[4096,4096]{1,0} fusion(%st, %k), kind=kLoop, calls=%one_layer",
                        ", st: bf16[64,4096,4096], k: s32[]")
    sliced = sliced.replace("  %f = ", "  %st = bf16[64,4096,4096]{2,1,0} parameter(2)\n"
                                       "  %k = s32[] parameter(3)\n  %f = ")
    # the partial sums (and the unread slice) stay in L2
    assert hbm_traffic(sliced, l2_bytes=L2)["bytes"] == (x + w) + (layer + 4) + x
    u = 4096 * 8192 * 2
    looped = _l2_module("%z = s32[] constant(0)\n  %t0 = (s32[], bf16[4096,8192]{1,0}) tuple(%z, %u)\n"
                        "  %lp = (s32[], bf16[4096,8192]{1,0}) while(%t0), condition=%stream_cond, body=%stream_body,"
                        ' backend_config={"known_trip_count":{"n":"1"}}', ", u: bf16[4096,8192]")
    looped = looped.replace("  %f = ", "  %u = bf16[4096,8192]{1,0} parameter(2)\n  %f = ")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a known trip count: no warning)
        got = hbm_traffic(looped, l2_bytes=L2)["bytes"]
    assert got == (x + w) + (u + u) + (partial + partial + x)  # evicted by the loop: written and read back
    # the partial sums as the loop's state: they enter it in HBM, so their write is charged
    state = _l2_module("%z = s32[] constant(0)\n  %t0 = (s32[], f32[8,64,4096]{2,1,0}) tuple(%z, %f)\n"
                       "  %lp = (s32[], f32[8,64,4096]{2,1,0}) while(%t0), condition=%c2, body=%b2,"
                       ' backend_config={"known_trip_count":{"n":"0"}}', "")
    state = state.replace("ENTRY", """%b2 (t: (s32[], f32[8,64,4096])) -> (s32[], f32[8,64,4096]) {
  ROOT %t = (s32[], f32[8,64,4096]{2,1,0}) parameter(0)
}

%c2 (t: (s32[], f32[8,64,4096])) -> pred[] {
  %t = (s32[], f32[8,64,4096]{2,1,0}) parameter(0)
  ROOT %c = pred[] constant(false)
}

ENTRY""")
    assert hbm_traffic(state, l2_bytes=L2)["bytes"] == (x + w) + partial + x  # written once; read from L2 after
