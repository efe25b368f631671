"""Pallas kernels for the accelerator path, plugged in through the ops seam (eagle2_jax.models.ops).

`PallasOps` is the XLA path with `attend` replaced by one tree-attention kernel that reads only
the live blocks of the KV cache (`attention.tree_attention`: Triton on GPU, Mosaic on TPU,
interpret mode elsewhere) for calls of up to `max_new` new tokens (decoding steps, tree
verification, drafting); a prefill keeps the XLA attention. Opt-in until measured on a GPU/TPU:

    EAGLE2_JAX_ATTENTION=pallas python -m infer.generate ...      # GPU or TPU
    target, draft = eagle2_jax.backends.pallas.use(target, draft)          # the same, in code

With a mesh of several devices the kernel runs per shard (batch over "data", key/value heads over
"model" where they divide), as XLA cannot partition a custom kernel itself.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax

from ...models import ops as core_ops
from .attention import tree_attention

SWITCH = "EAGLE2_JAX_ATTENTION"  # "pallas": the kernel on GPU/TPU; "pallas-interpret": anywhere (slow)


def _backend() -> str:
    b = jax.default_backend()
    return "gpu" if b in ("gpu", "cuda", "rocm") else ("tpu" if b == "tpu" else "interpret")


@dataclasses.dataclass(frozen=True)
class PallasOps(core_ops.Ops):
    name: str = "pallas"
    backend: str = "interpret"  # gpu (Triton) | tpu (Mosaic) | interpret
    block: int = 128  # cache slots per kernel step
    splits: Optional[int] = None  # programs per (row, KV head) cache walk; None: attention.split_count
    mesh: Optional[Any] = None  # run the kernel per shard of this mesh

    max_new: int = 128  # calls with more new tokens (prefill) keep the XLA attention

    def loop_masks(self, masks: tuple, G: int) -> tuple:
        return masks  # the kernel takes [B, T, X] masks

    def attend(self, q_BTHD, k_BKSD, v_BKSD, mask_BTS, k_new_BKTD=None, v_new_BKTD=None, mask_new_BTT=None):
        args = (q_BTHD, k_BKSD, v_BKSD, mask_BTS) + (() if k_new_BKTD is None else (k_new_BKTD, v_new_BKTD, mask_new_BTT))
        if q_BTHD.shape[1] > self.max_new:  # the kernel holds the new tokens' [T, T] block whole
            return core_ops.attend_xla(*args, scores=self.scores)
        run = lambda *a: tree_attention(*a, block=self.block, backend=self.backend, splits=self.splits)  # noqa: E731
        if self.mesh is None or self.mesh.size == 1:
            return run(*args)
        from jax.sharding import PartitionSpec as P
        B, K = k_BKSD.shape[0], k_BKSD.shape[1]
        d = "data" if B % self.mesh.shape["data"] == 0 else None
        m = "model" if K % self.mesh.shape["model"] == 0 else None
        specs = (P(d, None, m, None), P(d, m, None, None), P(d, m, None, None), P(d, None, None),
                 P(d, m, None, None), P(d, m, None, None), P(d, None, None))[:len(args)]
        return jax.shard_map(run, mesh=self.mesh, in_specs=specs, out_specs=P(d, None, m, None),
                             check_vma=False)(*args)


def ops_for(mesh=None, backend: Optional[str] = None, layers: Optional[str] = None) -> PallasOps:
    """The kernel's ops for `backend` (default: this machine's); `layers` (default: the platform's
    XLA path's, `ops.xla_for`) is how the target's layers run."""
    backend = backend or _backend()
    layers = layers or core_ops.xla_for({"interpret": "cpu"}.get(backend, backend)).layers
    return PallasOps(backend=backend, mesh=mesh if mesh is not None and mesh.size > 1 else None, layers=layers,
                     scores=core_ops.xla_for(backend).scores)  # (its XLA fallback's score layout)


def use(target, draft=None, backend: Optional[str] = None):
    """(target, draft) computing attention with the kernel (the draft too, when given); the target's
    layers keep running as they were loaded (`Ops.layers`)."""
    ops = ops_for(target.mesh, backend, layers=target.ops.layers)
    target = dataclasses.replace(target, ops=ops)
    return (target, None if draft is None else dataclasses.replace(draft, ops=ops))


def by_name(attention: str, target, draft=None):
    """The command lines' --attention: "xla" (as loaded) or "pallas" (the kernel; needs a GPU/TPU)."""
    if attention in ("xla", "auto"):
        return target, draft
    if attention != "pallas":
        raise ValueError(f"--attention {attention!r}: xla or pallas")
    if _backend() == "interpret":
        raise ValueError(f"--attention pallas needs a GPU or TPU (this is {jax.default_backend()}; "
                         f"{SWITCH}=pallas-interpret runs the kernel in interpret mode, slowly)")
    return use(target, draft)


def choose(params, dtype, mesh=None):
    """PallasOps when EAGLE2_JAX_ATTENTION asks for it (and the backend runs Pallas), else None."""
    want = os.environ.get(SWITCH, "")
    if want == "pallas-interpret":
        return ops_for(mesh, "interpret")
    if want == "pallas" and _backend() != "interpret":
        return ops_for(mesh)
    if want not in ("", "xla", "pallas"):
        raise ValueError(f"{SWITCH}={want!r}: one of xla, pallas, pallas-interpret")
    return None


core_ops.register(choose)
