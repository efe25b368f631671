"""The CPU backend: few-row C++ kernels and GGUF blocks kept packed, for a one-device CPU.

It depends on the core and plugs in from outside: importing this package registers `CpuOps`
(eagle2_jax.backends.cpu.ops) with `eagle2_jax.models.ops.register` and the packed GGUF loader with
`eagle2_jax.loading.gguf_files.register_gguf_packer`. The core never imports it.
"""
from ...loading import gguf_files as _gguf_files
from ...models import ops as _ops
from .gguf import pack_gguf
from .ops import CpuOps, choose

_ops.register(choose)
_gguf_files.register_gguf_packer(pack_gguf)

__all__ = ["CpuOps", "choose", "pack_gguf"]
