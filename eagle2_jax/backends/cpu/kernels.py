"""Few-row float32 matmuls and attention for XLA:CPU (XLA FFI custom calls, `few_row_kernels.cc`).

On a CPU, XLA runs a one-row matmul as a memory-bound matrix-vector product but 2-16 rows as a
general GEMM that costs nearly twice as much per weight byte, so verifying a small draft tree costs
far more than decoding one token. The kernels here stream the weights once for up to a few rows
(`scripts/bench_few_row_matmul.py` times them against XLA's dot; figures in docs/performance.md).

`eagle2_jax.backends.cpu.ops.CpuOps` plugs them into the model (the core never imports this module).
`dot_general` is a drop-in for `lax.dot_general` that takes the kernel only for float32 operands
with no batch dimensions, contracting lhs's trailing dimensions with rhs's leading ones (a Dense
kernel [in, out]) or trailing one (a tied embedding [V, D]), over at most `NN_MAX_ROWS` /
`NT_MAX_ROWS` rows (beyond that XLA's GEMM is as fast or faster). Anything else goes to
`lax.dot_general`. Gradients go through XLA's dot.

Every kernel takes a scalar `layer` operand: a weight (or cache) with one more leading axis than
the kernel expects is a stack of layers and the kernel reads slice `layer` in place. Inside the
model's `lax.scan` over layers this is what keeps XLA from copying each layer's weights out of the
stack before the call (measured: +25-30% per step with the copies).

Each output element is summed in the same order whatever the number of rows, so a verified row is
bit-identical to the same row decoded alone; the greedy identity tests run with the kernels on.

`attention`: a few query rows over the KV cache, reading only the slots a row's mask lets it see
(XLA's attention computes every padded slot of the cache), each row summed over its keys in one
fixed order, cache slots then the new keys. A token verified in a tree with its ancestors among the
new keys therefore gets the bits it gets when decoded alone with those keys already in the cache.

`q4_matmul` and `q8_matmul_nt`: the nn and nt matmuls over weights kept in a GGUF's Q4_1 / Q8_0
blocks (eagle2_jax.backends.cpu.packed): each weight is dequantised in registers to the exact float32 value
numpy's dequantisation gives and accumulated in the same order as the float32 kernels, so the
results are bit-identical while a pass reads 5-8.5 bits per weight instead of 32.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...file_cache import cpu_signature, root

TARGET = "eagle2_few_row_matmul"
ATTENTION_TARGET = "eagle2_few_row_attention"
Q4_TARGET = "eagle2_q4_matmul"
Q8_NT_TARGET = "eagle2_q8_matmul_nt"
SOURCE = Path(__file__).with_name("few_row_kernels.cc")
NN_MAX_ROWS = 8  # x @ w[K, N]
NT_MAX_ROWS = 8  # x @ w[N, K].T
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")


def _cache_dir() -> Path:
    return root()


def _cpu_signature() -> str:
    return cpu_signature()


def library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_signature().encode()
                         + jax.ffi.include_dir().encode()).hexdigest()[:16]
    return _cache_dir() / f"few_row_matmul-{key}.so"


def _compile(out: Path) -> None:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, "-isystem", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent processes see a whole library or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> bool:
    """Compiles (once per machine) and registers the kernel; False, with a warning, if it cannot."""
    try:
        path = library_path()
        if not path.exists():
            _compile(path)
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.eagle2_few_row_matmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.eagle2_few_row_attention),
                                    platform="cpu")
        global _LANES
        _LANES = int(lib.eagle2_lanes())
        jax.ffi.register_ffi_target(Q4_TARGET, jax.ffi.pycapsule(lib.eagle2_q4_matmul), platform="cpu")
        jax.ffi.register_ffi_target(Q8_NT_TARGET, jax.ffi.pycapsule(lib.eagle2_q8_matmul_nt),
                                    platform="cpu")
        return True
    except Exception as e:  # noqa: BLE001 - any failure means: use XLA's dot
        warnings.warn(f"eagle2_jax: few-row CPU matmul unavailable, using XLA's dot ({e})",
                      RuntimeWarning, stacklevel=2)
        return False


_LANES = 0


def lanes() -> int:
    """Floats per vector in the compiled kernels (0 if they did not build): the Q4 column packing."""
    return _LANES if load() else 0


def _require():
    if not load():
        raise RuntimeError("the CPU kernels did not build here (see the warning above)")


def _layer(layer):
    return jnp.asarray(0 if layer is None else layer, jnp.int32)


def q4_matmul(x, q4, d, m, layer=None):
    """x [..., K] @ w [K, N] with w in Q4_1 blocks (eagle2_jax.backends.cpu.packed): q4 [K, N/2] uint8,
    d and m [K/32, N] float32; w[k, c] = d[k/32, c] * q[k, c] + m[k/32, c], the product rounded
    before the sum, as numpy's dequantisation. Bit-identical to `matmul` on the dequantised w.
    With `layer`, q4, d and m are stacks [L, ...] and slice `layer` is read in place."""
    _require()
    n = 2 * q4.shape[-1]
    call = jax.ffi.ffi_call(Q4_TARGET, jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32),
                            vmap_method="sequential")
    return call(x, q4, d, m, _layer(layer))


def q8_matmul_nt(x, q8, d):
    """x [..., K] @ w [N, K].T with w in Q8_0 blocks: q8 [N, K] int8, d [N, K/32] float32
    (w = d * q, exact in float32). Bit-identical to `matmul(x, w, True)` on the dequantised w."""
    _require()
    call = jax.ffi.ffi_call(Q8_NT_TARGET, jax.ShapeDtypeStruct(x.shape[:-1] + (q8.shape[0],), jnp.float32),
                            vmap_method="sequential")
    return call(x, q8, d)


def _call(x, w, layer, transpose_w: bool):
    n = w.shape[-2] if transpose_w else w.shape[-1]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32),
                            vmap_method="sequential")
    return call(x, w, _layer(layer), transpose_w=transpose_w)


def _slice(w, layer):
    return w if layer is None else lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, w, transpose_w, layer):
    return _call(x, w, layer, transpose_w)


def _matmul_fwd(x, w, transpose_w, layer):
    return _call(x, w, layer, transpose_w), (x, w, layer)


def _matmul_bwd(transpose_w, res, g):
    x, w_all, layer = res
    w = _slice(w_all, layer)
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    dw = g2.T @ x2 if transpose_w else x2.T @ g2  # y = x @ w.T, or y = x @ w
    if layer is not None:
        dw = jnp.zeros_like(w_all).at[layer].set(dw)
    dlayer = None if layer is None else np.zeros((), jax.dtypes.float0)
    return (g @ w if transpose_w else g @ w.T).reshape(x.shape), dw, dlayer


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x, w, transpose_w: bool = False, layer=None):
    """x [..., K] @ w [K, N] (or w [N, K] transposed) -> [..., N] float32, through the kernel.
    With `layer` (a traced int32 scalar), w is a stack [L, ...] and slice `layer` is read in place."""
    return _matmul(x, w, transpose_w, layer)


def attention(q_BKYD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD, v_new_BKTD, mask_new_BTT, layer=None):
    """Attention of Y = G * T query rows (row y = g * T + t, already scaled) per KV head over the
    unmasked cache slots and new keys, float32, through the kernel (no gradient: see cpu.ops).
    Each row sums over its unmasked keys in one fixed order (cache slots, then new keys), so its
    result does not depend on the other rows or on padded slots; a row with no key gets zeros.
    With `layer`, the caches are stacks [L, B, K, S, Dh] read at slice `layer` in place."""
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q_BKYD.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q_BKYD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD, v_new_BKTD, mask_new_BTT, _layer(layer))


def _plan(lhs, rhs, dimension_numbers):
    """(transpose_w, K) when the kernel applies to this dot_general, else None."""
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc = tuple(int(a) % lhs.ndim for a in lc), tuple(int(a) % rhs.ndim for a in rc)
    if lb or rb or not lc or lhs.dtype != jnp.float32 or rhs.dtype != jnp.float32:
        return None
    nc = len(lc)
    if lc != tuple(range(lhs.ndim - nc, lhs.ndim)):
        return None
    k = 1
    for a in lc:
        k *= lhs.shape[a]
    rows = lhs.size // k if k else 0
    if rc == tuple(range(nc)) and rows <= NN_MAX_ROWS:
        return False, k
    if rhs.ndim == 2 and nc == 1 and rc == (1,) and rows <= NT_MAX_ROWS:
        return True, k
    return None


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
    """`lax.dot_general`, through the few-row kernel where it applies (see the module docstring)."""
    plan = None
    if (not kw and precision is None and preferred_element_type in (None, jnp.float32)
            and lhs.size and rhs.size):
        plan = _plan(lhs, rhs, dimension_numbers)
    if plan is None or not load():
        if lhs.dtype != rhs.dtype:  # as jnp.einsum would
            common = jnp.promote_types(lhs.dtype, rhs.dtype)
            lhs, rhs = lhs.astype(common), rhs.astype(common)
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kw)
    transpose_w, k = plan
    nc = len(dimension_numbers[0][0])
    batch_shape = lhs.shape[:lhs.ndim - nc]
    x = lhs.reshape(-1, k)
    if transpose_w:
        y = matmul(x, rhs, True)
        return y.reshape(batch_shape + (rhs.shape[0],))
    out_shape = rhs.shape[nc:]
    y = matmul(x, rhs.reshape(k, -1))
    return y.reshape(batch_shape + out_shape)
