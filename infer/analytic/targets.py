"""The accelerators the report knows: peak figures for the roofline (ACCELERATORS), and the GPUs and
TPUs whose XLA compiler can run here with none attached (COMPILE_TARGETS: a deviceless topology,
built from XLA's description of the GPU or the TPU's topology name), with `placement` to compile
for one and `compiler_version` to name the compiler that did."""
from __future__ import annotations

import importlib.metadata

import jax
import numpy as np
from jax.experimental import topologies

ACCELERATORS = {  # peak HBM bytes/s and dense bf16 FLOP/s, from the vendors' data sheets
    "h200": dict(name="NVIDIA H200", bytes_per_s=4.8e12, flops_per_s=989e12),
    "h100": dict(name="NVIDIA H100 SXM", bytes_per_s=3.35e12, flops_per_s=989e12),
    "a100": dict(name="NVIDIA A100 80GB", bytes_per_s=2.039e12, flops_per_s=312e12),
    "tpu-v5e": dict(name="Google TPU v5e", bytes_per_s=0.819e12, flops_per_s=197e12),
    "tpu-v6e": dict(name="Google TPU v6e", bytes_per_s=1.64e12, flops_per_s=918e12),
}

TPU_TOPOLOGIES = {"tpu-v5e": "v5e:2x2", "tpu-v6e": "v6e:2x2"}  # the smallest host slice; one chip is used

# XLA's description of a GPU (its TargetConfig, as XLA's own gpu_specs write it), enough for the GPU
# compiler to fuse, pick kernels and emit PTX with no GPU attached. Hopper, SM 9.0; what differs
# between the cards is memory size and bandwidth (the L2 is 50 MiB on both).
GPU_TARGETS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", memory=84_929_347_584, bandwidth=3_352_320_000_000, l2=52_428_800),
    "h200": dict(name="NVIDIA H200", memory=150_754_820_096, bandwidth=4_800_000_000_000, l2=52_428_800),
}

COMPILE_TARGETS = (*GPU_TARGETS, *TPU_TOPOLOGIES)


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


def compiler_version(accelerator: str) -> str:
    """The package that holds XLA's compiler for `accelerator`, with its version where installed."""
    pkg = "libtpu" if accelerator in TPU_TOPOLOGIES else "jax-cuda13-plugin"
    try:
        return f"{pkg} {importlib.metadata.version(pkg)}"
    except importlib.metadata.PackageNotFoundError:
        return pkg
