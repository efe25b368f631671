"""The analytic round-cost report: pre-optimisation bytes / FLOPs / kernels with abstract params."""
import json
import re

import pytest

from helpers import tiny_config


@pytest.fixture(scope="module")
def shape(tmp_path_factory):
    d = tmp_path_factory.mktemp("shape")

    def write(layers):
        p = d / f"config{layers}.json"
        p.write_text(json.dumps(tiny_config(vocab_size=512, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=layers).to_hf_dict()))
        return f"random:{p}"
    return write


def test_analytic_report_counts_every_layer_and_writes_json(shape, tmp_path):
    from infer import roundcost
    out = tmp_path / "r.json"
    roundcost.main(["--analytic", "--model", shape(2), "--dtype", "float32", "--batch", "1", "--depth", "2",
                    "--top-k", "3", "--total-tokens", "6", "--prompt-len", "8", "--max-new-tokens", "16",
                    "--draft-vocab", "128", "--tau", "2.5", "--json", str(out)])
    r = json.loads(out.read_text())
    assert set(r) >= {"step", "round", "roofline"}
    assert set(r["step"]) == {"bytes", "flops", "kernels", "bytes_by_kind"}
    for c in (r["step"], r["round"], *r["round"]["parts"].values()):  # the breakdown accounts for the bytes
        assert abs(sum(c["bytes_by_kind"].values()) - c["bytes"]) <= 0.05 * c["bytes"], c
    assert r["ratios"]["matmul_bytes"] < r["ratios"]["bytes"]
    assert set(r["round"]["parts"]) == {"draft", "verify", "accept"}
    assert r["roofline"]["accelerator"] == "h200" and r["roofline"]["tau"] == 2.5
    assert r["round"]["bytes"] > r["step"]["bytes"] > 0 and r["round"]["kernels"] > r["step"]["kernels"] > 0
    # the verify pass reads the target's weights once, as a step does (plus the tree's activations)
    assert r["round"]["parts"]["verify"]["bytes"] >= r["step"]["bytes"]
    assert r["round"]["parts"]["verify"]["flops"] > 3 * r["step"]["flops"]  # 6 tree rows against 1
    want = r["roofline"]["tau"] * r["roofline"]["step_ms"] / r["roofline"]["round_ms"]
    assert abs(r["roofline"]["speedup"] - want) < 1e-9


def test_analytic_bytes_grow_with_layers(shape):
    """A while loop's body is counted once by XLA: the analysis unrolls the layers, so every layer
    adds the same bytes (at least its weights: they are counted once, not sliced out of a stack)."""
    from infer.analytic import analyze
    b = {L: analyze(shape(L), "float32", 1, 8, 16, 2, 3, 6, 0, 2.0, "h200", kernels=False)["step"]["bytes"]
         for L in (2, 4, 6)}
    c = tiny_config(vocab_size=512, hidden_size=64, intermediate_size=128)
    layer_weights = 4 * (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                         + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)
    assert b[6] - b[4] == b[4] - b[2] >= 2 * layer_weights, b


def test_breakdown_counts_operands_and_results_by_kind():
    import jax
    import jax.numpy as jnp
    from infer.analytic import breakdown

    def f(x, w, table, ids):
        y = jnp.maximum(x @ w, 0.0)  # matmul, then elementwise
        return y.sum(axis=1), jnp.take(table, ids, axis=0)  # reduce; a gather reads its rows only
    args = (jnp.zeros((8, 32)), jnp.zeros((32, 16)), jnp.zeros((1000, 16)), jnp.zeros((3,), jnp.int32))
    lo = jax.jit(f).lower(*args)
    k = breakdown(lo.as_text(dialect="hlo"))
    assert k["matmul"] == 4 * (8 * 32 + 32 * 16 + 8 * 16)
    assert k["reduce"] >= 4 * (8 * 16 + 8) and k["elementwise"] >= 4 * 3 * 8 * 16
    assert k["data movement"] < 4 * 1000 * 16  # not the whole table
    assert abs(sum(k.values()) - lo.cost_analysis()["bytes accessed"]) <= 0.1 * sum(k.values())


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


def test_hbm_traffic_charges_fused_kernels_by_what_they_move():
    from infer.analytic import hbm_traffic
    rows, layer = 8 * 256 * 4, 256 * 256 * 4
    r = hbm_traffic(_COMPILED, top=10)
    want = (layer + 4 + rows + rows  # the fusion: one layer's slice of the stack (not all 4), the index, the rows, its result
            + layer  # the copy into on-chip memory: read once; the dot then reads it there for free
            + rows + rows  # the dot: its rows in, its result out (the weights are on chip)
            + 3 * (rows + rows)  # the loop body's kernel, 3 trips
            + rows + 4 + rows)  # the in-place update: the update (and index) read and written, not the 64-row buffer
    assert r["bytes"] == want, (r["bytes"], want, r["top"])
    assert r["kernels"] == 1 + 1 + 3 + 1  # fusion, dot, 3 exponentials, update (the copy is a DMA beside them)
    assert max(r["top"])[0] == layer + 4 + 2 * rows and max(r["top"])[1] == "f"
    one_trip = hbm_traffic(_COMPILED, loop=True)  # a decode loop's step: the body once, nothing around it
    assert one_trip == {"bytes": rows + rows, "kernels": 1}


def test_hbm_traffic_times_each_kernel_with_a_floor():
    """With a bandwidth, each kernel costs its bytes at that bandwidth but at least the floor; the
    asynchronous copy costs its bytes (no floor: a DMA); loop trips multiply."""
    from infer.analytic import hbm_traffic
    rows, layer = 8 * 256 * 4, 256 * 256 * 4
    bw, floor = 1e9, 20e-6  # the slicing fusion (278 KB: 279 us) is above the floor, the 16 KB kernels below
    r = hbm_traffic(_COMPILED, bytes_per_s=bw, kernel_floor_s=floor)
    want = (layer + 4 + 2 * rows) / bw + layer / bw + floor + 3 * floor + floor
    assert r["seconds"] == pytest.approx(want, rel=1e-12)
    assert hbm_traffic(_COMPILED, bytes_per_s=bw)["seconds"] == pytest.approx(r["bytes"] / bw, rel=1e-12)
    assert hbm_traffic(_COMPILED, loop=True, bytes_per_s=bw, kernel_floor_s=floor)["seconds"] == pytest.approx(floor)
    assert "seconds" not in hbm_traffic(_COMPILED)


def test_hbm_traffic_of_a_compiled_program_reads_the_weights_once():
    import jax
    import jax.numpy as jnp
    from infer.analytic import hbm_traffic

    def f(x, w1, w2):
        return jnp.tanh(jnp.maximum(x @ w1, 0.0) * 2.0 + 1.0) @ w2  # elementwise work fused between two dots
    args = (jnp.zeros((4, 512)), jnp.zeros((512, 1024)), jnp.zeros((1024, 512)))
    lo = jax.jit(f).lower(*args)
    r = hbm_traffic(lo.compile().as_text())
    weights = 2 * 4 * 512 * 1024
    # the weights once, and little else: far less than the unfused count of every op's operands
    assert weights <= r["bytes"] <= weights + 4 * 4 * (512 + 1024) * 4, r
    assert r["bytes"] < lo.cost_analysis()["bytes accessed"]


def test_compile_for_tpu_without_a_tpu(shape):
    """Where libtpu is installed (jax[tpu]; run with JAX_PLATFORMS=cpu), the report compiles the
    programs with XLA's TPU compiler here and adds the fused programs' HBM bytes and kernels."""
    pytest.importorskip("libtpu")
    import jax
    if jax.default_backend() != "cpu":
        pytest.skip("the deviceless compile is checked where no TPU is attached")
    from infer.analytic import analyze, format_report
    r = analyze(shape(2), "bfloat16", 1, 8, 16, 2, 3, 6, 128, 2.5, "tpu-v6e", kernels=False, compile_for="tpu-v6e")
    step, rnd, verify = r["step"]["compiled"], r["round"]["compiled"], r["round"]["parts"]["verify"]
    assert rnd["kernels"] > step["kernels"] > 0  # (at this size the loops keep everything on chip: bytes ~0)
    assert 0 < verify["compiled"]["bytes"] < verify["bytes"]  # fused: below the count of every op's operands
    assert r["compiled"]["for"] == "tpu-v6e" and abs(r["compiled"]["bytes"] - rnd["bytes"] / step["bytes"]) < 1e-9
    assert "compiled by XLA for Google TPU v6e" in format_report(r)


def test_compile_for_a_gpu_without_one(shape):
    """Where the CUDA plugin is installed (jax-cuda13-plugin and -pjrt matching jax, ptxas on PATH;
    run with JAX_PLATFORMS=cpu), the report compiles the programs with XLA's GPU compiler for an
    H200 described by its target config, and adds the fused programs' HBM bytes and kernels."""
    pytest.importorskip("jax_plugins.xla_cuda13")
    import shutil
    import jax
    if shutil.which("ptxas") is None:
        pytest.skip("no ptxas (a CUDA toolkit) on PATH")
    if jax.default_backend() != "cpu":
        pytest.skip("the deviceless compile is checked where no GPU is attached")
    from infer.analytic import analyze, format_report
    r = analyze(shape(2), "bfloat16", 1, 8, 16, 2, 3, 6, 128, 2.5, "h200", kernels=False, compile_for="h200")
    step, rnd, verify = r["step"]["compiled"], r["round"]["compiled"], r["round"]["parts"]["verify"]
    assert rnd["kernels"] > step["kernels"] > 0 and rnd["bytes"] > step["bytes"] > 0
    assert 0 < verify["compiled"]["bytes"] < verify["bytes"]  # fused: below the count of every op's operands
    assert r["compiled"]["for"] == "h200" and abs(r["compiled"]["bytes"] - rnd["bytes"] / step["bytes"]) < 1e-9
    for c in (step, rnd, verify["compiled"]):  # the L2 serves some reads: never more than all of them in HBM
        assert 0 < c["bytes_l2"] <= c["bytes"]
    assert abs(r["compiled"]["bytes_l2"] - rnd["bytes_l2"] / step["bytes_l2"]) < 1e-9 and r["compiled"]["speedup_l2"] > 0
    # every kernel at least the floor: never less than that many floors, nor than the L2 bytes at the bandwidth
    from infer.analytic import GPU_KERNEL_FLOOR_S, GPU_TARGETS
    for c in (step, rnd):
        assert c["seconds_floor"] >= max(c["kernels"] * GPU_KERNEL_FLOOR_S, c["bytes_l2"] / GPU_TARGETS["h200"]["bandwidth"])
    c = r["compiled"]
    assert c["speedup_floor"] == pytest.approx(2.5 * c["step_ms_floor"] / c["round_ms_floor"])
    text = format_report(r)
    assert "compiled by XLA for NVIDIA H200" in text and "kept in L2" in text and "at least 2.5 us" in text
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
    defaults must stay XLA's own default, read here from the options XLA's GPU compiler reports."""
    pytest.importorskip("jax_plugins.xla_cuda13")
    import glob
    import shutil
    import jax
    import jax.numpy as jnp
    if shutil.which("ptxas") is None or jax.default_backend() != "cpu":
        pytest.skip("needs ptxas and the deviceless compile (JAX_PLATFORMS=cpu)")
    from eagle2_jax.defaults import XLA_GRAPH_COMMANDS
    from infer.analytic import placement
    x = placement("h200")(jnp.zeros((8, 8), jnp.float32))
    jax.jit(lambda a: a * 2).lower(x).compile(compiler_options={"xla_dump_to": str(tmp_path)})
    text = open(glob.glob(str(tmp_path / "*jit__lambda.config.pbtxt"))[0]).read()
    default = set(re.findall(r"xla_gpu_enable_command_buffer: (\w+)", text))
    assert default == set(XLA_GRAPH_COMMANDS.split(","))


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
    from infer.analytic import loop_launches
    # the condition kernel and the body's graph each trip, then the wait on the copied condition
    assert loop_launches(_BODY_GRAPH) == dict(in_graph=False, launches=2, graphs=1, syncs=1, kernels=3)
    assert loop_launches(_LOOP_GRAPH) == dict(in_graph=True, launches=0, graphs=0, syncs=0, kernels=3)
    assert loop_launches(_NO_GRAPH) == dict(in_graph=False, launches=4, graphs=0, syncs=1, kernels=3)
    assert loop_launches(_NO_GRAPH.split("003:")[0]) is None  # no loop


def test_decode_loops_take_the_cuda_graph_mode_on_gpu(monkeypatch):
    from eagle2_jax import eagle, vanilla
    from eagle2_jax.defaults import GPU_GRAPHS_SWITCH, gpu_graph_options
    assert gpu_graph_options("body") == {}  # XLA's own default
    assert gpu_graph_options("off") == {"xla_gpu_enable_command_buffer": ""}
    assert "WHILE" in gpu_graph_options("loop")["xla_gpu_enable_command_buffer"].split(",")
    monkeypatch.setenv(GPU_GRAPHS_SWITCH, "loop")
    for p in (eagle.LOOP, vanilla.LOOP):
        assert p.compiler_options("gpu") == gpu_graph_options("loop") and p.compiler_options("cpu") == {}
    assert eagle.STREAM_STEP.compiler_options("gpu") == {} and eagle.PREFILL.compiler_options("gpu") == {}
    monkeypatch.setenv(GPU_GRAPHS_SWITCH, "always")
    with pytest.raises(ValueError, match="EAGLE2_JAX_GPU_GRAPHS must be one of body, loop, off"):
        eagle.LOOP.compiler_options("gpu")


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
    from infer.analytic import hbm_traffic
    r = hbm_traffic(_SLICED_COPY)
    assert r["kernels"] == 1  # the fusion
    assert r["bytes"] == 8 * 256 * 4 + 8 * 256 * 4  # the two slices read from HBM, the fusion's result written


def test_hbm_traffic_does_not_charge_a_library_calls_workspace():
    """cuBLAS and cuDNN calls return their scratch workspace beside the result: it is never read
    from or written to HBM as data, so only the operands and the result are charged."""
    from infer.analytic import hbm_traffic
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
    from infer.analytic import hbm_traffic

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
    from infer.analytic import hbm_traffic
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
    import warnings
    from infer.analytic import hbm_traffic
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
    import warnings
    from infer.analytic import hbm_traffic
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
