"""Loading a target from any source: a named model, a Hugging Face directory (eagle2_jax.loading.hf_files),
a GGUF file (eagle2_jax.loading.gguf_files) or random weights of a published shape (eagle2_jax.loading.registry).
"""
from __future__ import annotations

import dataclasses
import os

from .convert import CheckpointError
from .gguf_files import load_gguf
from .hf_files import load_hf_dir
from ..models.layer_list import per_layer
from ..models.target import Target, init_target, resolve_dtype
from .registry import NAMED_TOKENIZERS, RANDOM_PREFIX, random_config, resolve_source, shipped_tokenizer


def load_target(source: str, dtype="auto", mesh=None, tokenizer: bool = True,
                packed: bool | None = None, abstract: bool = False, layers: str | None = None) -> Target:
    """Load a target from a named model, a Hugging Face directory or a .gguf file (`packed`: see
    load_gguf; Hugging Face directories are never packed), or random weights of a published shape
    (`random:llama-3.1-8b`, see registry.RANDOM_SHAPES; no tokenizer), for timing. dtype "auto": float32 on
    CPU, bfloat16 on GPU/TPU (eagle2_jax.decoding.defaults). `layers` ("scan" or "list", default the
    platform's choice, ops.xla_for): how the layers run, one setting of the target's Ops; with "list"
    each layer's weights become a buffer of their own here (eagle2_jax.models.layer_list).

    With `abstract` (random shapes and config.json files only), params are jax.ShapeDtypeStruct
    leaves: nothing is allocated, and `generate(..., compile_only=True)` compiles for it."""
    if layers not in (None, "scan", "list"):
        raise ValueError(f"layers must be 'scan' or 'list', got {layers!r}")
    target = _load_target(source, dtype, mesh, tokenizer, packed, abstract)
    if layers is not None and layers != target.ops.layers:
        target = dataclasses.replace(target, ops=dataclasses.replace(target.ops, layers=layers))
    if target.ops.layers == "list":
        target = per_layer(target, release=True)
    return target


def _load_target(source: str, dtype="auto", mesh=None, tokenizer: bool = True,
                 packed: bool | None = None, abstract: bool = False) -> Target:
    resolve_dtype(dtype)
    if abstract and not str(source).startswith(RANDOM_PREFIX):
        if str(source).endswith(".json") and os.path.exists(str(source)):
            source = RANDOM_PREFIX + str(source)
        else:
            raise CheckpointError(f"abstract=True takes random:<shape> or a config.json, got {source!r}")
    if str(source).startswith(RANDOM_PREFIX):
        config = random_config(str(source))
        if packed:
            raise CheckpointError(f"cannot keep {source!r} packed: only GGUF files are")
        return dataclasses.replace(init_target(config, dtype=dtype, mesh=mesh, abstract=abstract),
                                   source=str(source))
    path = resolve_source(str(source))
    if os.path.isdir(path):
        return load_hf_dir(path, dtype, mesh, tokenizer)
    if path.endswith(".gguf"):
        shipped = NAMED_TOKENIZERS.get(str(source)) if tokenizer else None
        target = load_gguf(path, dtype, mesh, tokenizer and shipped is None, packed)
        if shipped is not None:
            target = dataclasses.replace(target, tokenizer=shipped_tokenizer(shipped))
        return target
    if packed:
        raise CheckpointError(f"cannot keep {path!r} packed: only GGUF files are")
    raise CheckpointError(f"cannot load {path!r}: expected a directory with config.json or a .gguf file")
