"""Loading a GGUF target with its Q4_1 / Q8_0 blocks kept packed (eagle2_jax.backends.cpu.packed), plugged
into `eagle2_jax.loading.gguf_files.load_gguf` through `register_gguf_packer`.

The layer matrices become packed leaves stacked on the layer axis like every other layer param
(q4 [L, K, N/2], d and m [L, K/32, N], w [L, *in, *out]); the tied embedding a Q8_0 leaf.
"""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from ...config import ModelConfig
from ...loading.convert import GGUF_TABLE, CheckpointError, check_params, convert, unflatten, unpermute
from ...models.target import abstract_target_params
from ...sharding import path_str
from . import kernels, packed

PACKED_SWITCH = "EAGLE2_JAX_PACKED"  # "0": load_gguf never packs
_Q4_NAMES = {"attn_q": "attn/q", "attn_k": "attn/k", "attn_v": "attn/v", "attn_output": "attn/o",
             "ffn_gate": "mlp/gate", "ffn_up": "mlp/up", "ffn_down": "mlp/down"}
_Q4_PATTERN = r"blk\.(\d+)\.(" + "|".join(_Q4_NAMES) + r")\.weight"


def packable(reader, config: ModelConfig, dtype, mesh) -> bool:
    """Whether this file's weights can stay packed: float32 on one CPU device with the kernels built,
    Q4_1 layer matrices and a tied Q8_0 embedding, sizes the kernels' blocks divide, and
    EAGLE2_JAX_PACKED not "0"."""
    if (os.environ.get(PACKED_SWITCH, "1") == "0" or dtype != jnp.float32 or mesh is not None
            or jax.default_backend() != "cpu" or not config.tie_word_embeddings):
        return False
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    mats = [n for n in types if re.fullmatch(_Q4_PATTERN, n)]
    if (types.get("token_embd.weight") != "Q8_0" or "output.weight" in types
            or len(mats) != len(_Q4_NAMES) * config.num_hidden_layers or any(types[n] != "Q4_1" for n in mats)):
        return False
    lanes = kernels.lanes()
    c = config
    outs = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size,
            c.intermediate_size)
    ins = (c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size)
    return bool(lanes) and all(n % (2 * lanes) == 0 for n in outs) and all(k % packed.BLOCK == 0 for k in ins)


def _packed_params(reader, config: ModelConfig, path: str, rest_loader) -> dict:
    """Param tree with the layer matrices and the embedding as packed leaves."""
    lanes = kernels.lanes()
    expected = abstract_target_params(config, jnp.float32)
    per_layer: dict = {}  # "attn/q" -> {layer: leaf}
    flat, rest = {}, {}
    for t in reader.tensors:
        m = re.fullmatch(_Q4_PATTERN, t.name)
        try:
            if t.name == "token_embd.weight":
                q, d = packed.q8_0_blocks(t.data, config.vocab_size, config.hidden_size)
                w = q.astype(np.float32) * np.repeat(d, packed.BLOCK, axis=1)  # numpy's dequantisation
                flat["embed"] = {"q8": q, "d": d, "w": w}
            elif m:
                cols, rows = (int(x) for x in t.shape)  # GGUF lists the contiguous dimension first
                q, d, mn = packed.q4_1_blocks(t.data, rows, cols)
                heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(m.group(2))
                if heads:  # undo llama.cpp's RoPE row order, as the GGUF table's transforms do
                    q, d, mn = (unpermute(a, heads) for a in (q, d, mn))
                leaf = packed.pack_q4(q.T, d.T, mn.T, lanes)
                name = _Q4_NAMES[m.group(2)]
                shape = expected["layers"][name.split("/")[0]][name.split("/")[1]]["kernel"].shape[1:]
                # numpy's dequantisation (product, then sum), for calls over many rows
                leaf["w"] = (np.repeat(d.T, packed.BLOCK, axis=0) * q.T.astype(np.float32)
                             + np.repeat(mn.T, packed.BLOCK, axis=0)).reshape(shape)
                per_layer.setdefault(name, {})[int(m.group(1))] = leaf
            else:
                rest[t.name] = rest_loader(t)
        except ValueError as e:
            raise CheckpointError(f"corrupt tensor {t.name} in {path}: {e}") from None
    L = config.num_hidden_layers
    for name, layers in per_layer.items():
        if sorted(layers) != list(range(L)):
            raise CheckpointError(f"GGUF {path}: {name} is missing for some layers")
        flat[f"layers/{name}/kernel"] = {k: np.stack([layers[i][k] for i in range(L)]) for k in layers[0]}
    flat = {k: {n: jnp.asarray(a) for n, a in v.items()} for k, v in flat.items()}
    rest = jax.tree_util.tree_map(jnp.asarray, convert(rest, GGUF_TABLE, config, jnp.float32, ignore=(r"rope_freqs",)))
    params = unflatten(flat, into=rest)
    _check_packed(params, expected, f"GGUF {path}")
    return params


def _check_packed(params, expected, what: str):
    """check_params for a tree with packed leaves: each one's float32 copy has the expected shape."""
    got = dict(jax.tree_util.tree_leaves_with_path(params, is_leaf=packed.is_packed))
    shaped = {path_str(p): (jax.ShapeDtypeStruct(x["w"].shape, x["w"].dtype) if packed.is_packed(x) else x)
              for p, x in got.items()}
    check_params(unflatten(shaped), expected, what)


def pack_gguf(reader, config: ModelConfig, dtype, mesh, path: str, rest_loader):
    """The GGUF packer registered with eagle2_jax.loading.gguf_files: packed params, or None where not packable."""
    if not packable(reader, config, dtype, mesh):
        return None
    return _packed_params(reader, config, path, rest_loader)
