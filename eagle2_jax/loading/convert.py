"""Converting source checkpoints to our param tree, and checking the result.

Conversion is a declarative table: source-name regex -> our param path + a transform of the
numpy array; per-layer tensors ("layers_{i}/...") are then stacked on a leading layer axis
("layers/..."), the layout the model scans. Missing or unexpected tensors raise one-line errors.
"""
from __future__ import annotations

import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..sharding import path_str


class CheckpointError(ValueError):
    """A missing, corrupt or incompatible checkpoint."""


# ---- transforms: source layout (torch [out, in]) -> ours ------------------------------------------

def transpose(w, c):  # Linear weight -> Dense kernel
    return w.T


def q_kernel(w, c):
    return w.T.reshape(c.hidden_size, c.num_attention_heads, c.head_dim)


def kv_kernel(w, c):
    return w.T.reshape(c.hidden_size, c.num_key_value_heads, c.head_dim)


def o_kernel(w, c):
    return w.T.reshape(c.num_attention_heads, c.head_dim, c.hidden_size)


def q_bias(b, c):
    return b.reshape(c.num_attention_heads, c.head_dim)


def kv_bias(b, c):
    return b.reshape(c.num_key_value_heads, c.head_dim)


def identity(w, c):
    return w


def gemma_norm(w, c):
    """Gemma's RMSNorm multiplies by 1 + weight: stored as the scale itself (ours multiplies by it)."""
    return w + 1.0


def unpermute(w, n_head):
    """Undo llama.cpp's interleaved-RoPE permutation of q/k rows."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_q(w, c):
    return q_kernel(unpermute(w, c.num_attention_heads), c)


def _gguf_k(w, c):
    return kv_kernel(unpermute(w, c.num_key_value_heads), c)


Table = tuple  # of (regex, path template, transform)

HF_TABLE: Table = (
    (r"model\.embed_tokens\.weight", "embed", identity),
    (r"model\.norm\.weight", "norm/scale", identity),
    (r"lm_head\.weight", "lm_head", transpose),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers_{0}/input_norm/scale", identity),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers_{0}/post_norm/scale", identity),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "layers_{0}/attn/q/kernel", q_kernel),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "layers_{0}/attn/k/kernel", kv_kernel),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "layers_{0}/attn/v/kernel", kv_kernel),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "layers_{0}/attn/q/bias", q_bias),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "layers_{0}/attn/k/bias", kv_bias),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", "layers_{0}/attn/v/bias", kv_bias),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers_{0}/attn/o/kernel", o_kernel),
    (r"model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.weight", "layers_{0}/attn/{1}_norm/scale", identity),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "layers_{0}/mlp/{1}/kernel", transpose),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.bias", "layers_{0}/mlp/{1}/bias", identity),
)

# Gemma 3 text (Gemma3ForCausalLM): the sandwich norms, q/k norms, norms stored as 1 + weight; the LM
# head is the embedding (tied).
GEMMA3_HF_TABLE: Table = (
    (r"model\.embed_tokens\.weight", "embed", identity),
    (r"model\.norm\.weight", "norm/scale", gemma_norm),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers_{0}/input_norm/scale", gemma_norm),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers_{0}/attn_out_norm/scale", gemma_norm),
    (r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.weight", "layers_{0}/post_norm/scale", gemma_norm),
    (r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight", "layers_{0}/mlp_out_norm/scale", gemma_norm),
    (r"model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.weight", "layers_{0}/attn/{1}_norm/scale", gemma_norm),
) + tuple(row for row in HF_TABLE if "_proj" in row[0])


def hf_table(config: ModelConfig) -> Table:
    """The conversion table of a Hugging Face checkpoint of this architecture."""
    return GEMMA3_HF_TABLE if config.model_type == "gemma3_text" else HF_TABLE


GGUF_TABLE: Table = (
    (r"token_embd\.weight", "embed", identity),
    (r"output_norm\.weight", "norm/scale", identity),
    (r"output\.weight", "lm_head", transpose),
    (r"blk\.(\d+)\.attn_norm\.weight", "layers_{0}/input_norm/scale", identity),
    (r"blk\.(\d+)\.ffn_norm\.weight", "layers_{0}/post_norm/scale", identity),
    (r"blk\.(\d+)\.attn_q\.weight", "layers_{0}/attn/q/kernel", _gguf_q),
    (r"blk\.(\d+)\.attn_k\.weight", "layers_{0}/attn/k/kernel", _gguf_k),
    (r"blk\.(\d+)\.attn_v\.weight", "layers_{0}/attn/v/kernel", kv_kernel),
    (r"blk\.(\d+)\.attn_q\.bias", "layers_{0}/attn/q/bias", q_bias),
    (r"blk\.(\d+)\.attn_k\.bias", "layers_{0}/attn/k/bias", kv_bias),
    (r"blk\.(\d+)\.attn_v\.bias", "layers_{0}/attn/v/bias", kv_bias),
    (r"blk\.(\d+)\.attn_output\.weight", "layers_{0}/attn/o/kernel", o_kernel),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", "layers_{0}/mlp/{1}/kernel", transpose),
)


# Gemma 3 GGUF (llama.cpp's names; its converter already stores norms as 1 + weight, and leaves q/k
# unpermuted): the sandwich norms and q/k norms, a tied head.
GEMMA3_GGUF_TABLE: Table = (
    (r"token_embd\.weight", "embed", identity),
    (r"output_norm\.weight", "norm/scale", identity),
    (r"blk\.(\d+)\.attn_norm\.weight", "layers_{0}/input_norm/scale", identity),
    (r"blk\.(\d+)\.post_attention_norm\.weight", "layers_{0}/attn_out_norm/scale", identity),
    (r"blk\.(\d+)\.ffn_norm\.weight", "layers_{0}/post_norm/scale", identity),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", "layers_{0}/mlp_out_norm/scale", identity),
    (r"blk\.(\d+)\.attn_(q|k)_norm\.weight", "layers_{0}/attn/{1}_norm/scale", identity),
    (r"blk\.(\d+)\.attn_q\.weight", "layers_{0}/attn/q/kernel", q_kernel),
    (r"blk\.(\d+)\.attn_k\.weight", "layers_{0}/attn/k/kernel", kv_kernel),
    (r"blk\.(\d+)\.attn_v\.weight", "layers_{0}/attn/v/kernel", kv_kernel),
    (r"blk\.(\d+)\.attn_output\.weight", "layers_{0}/attn/o/kernel", o_kernel),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", "layers_{0}/mlp/{1}/kernel", transpose),
)


def gguf_table(config: ModelConfig) -> Table:
    return GEMMA3_GGUF_TABLE if config.model_type == "gemma3_text" else GGUF_TABLE


def convert(tensors: dict[str, Callable[[], np.ndarray]], table: Table, config: ModelConfig,
            dtype, ignore: tuple = (r"rotary_emb\.inv_freq",), stack: bool = True) -> dict:
    """Map source tensors (name -> loader) to our nested param dict of numpy arrays using `table`;
    the target's per-layer tensors end up stacked (see `stack_layers`)."""
    flat = {}
    for name, load in tensors.items():
        for pattern, template, fn in table:
            m = re.fullmatch(pattern, name)
            if m:
                arr = np.asarray(load(), dtype=np.float32)
                flat[template.format(*m.groups())] = np.asarray(fn(arr, config), dtype=jnp.dtype(dtype))
                break
        else:
            if not any(re.search(p, name) for p in ignore):
                raise CheckpointError(f"unexpected tensor {name!r} in checkpoint")
    return unflatten(stack_layers(flat) if stack else flat)  # numpy: shard_params places them


def stack_layers(flat: dict) -> dict:
    """{"layers_{i}/x": [...]} for i = 0..L-1 -> {"layers/x": [L, ...]}; a tensor missing in some
    layer is left per-layer (check_params then names it)."""
    out, groups = {}, {}
    for k, v in flat.items():
        m = re.fullmatch(r"layers_(\d+)/(.+)", k)
        if m:
            groups.setdefault(m.group(2), {})[int(m.group(1))] = v
        else:
            out[k] = v
    n = max((max(g) + 1 for g in groups.values()), default=0)
    for suffix, g in groups.items():
        if sorted(g) == list(range(n)):
            out[f"layers/{suffix}"] = np.stack([g[i] for i in range(n)])
        else:
            out.update({f"layers_{i}/{suffix}": a for i, a in g.items()})
    return out


def unflatten(flat: dict, into: dict | None = None) -> dict:
    """{"a/b/c": leaf} -> {"a": {"b": {"c": leaf}}}, added to `into` when given."""
    out: dict = {} if into is None else into
    for path, v in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def check_params(params, expected, what: str):
    """Same tree and shapes as `expected` (an abstract or real param tree), else CheckpointError."""
    got = {path_str(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)}
    want = {path_str(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(expected)}
    missing = sorted(set(want) - set(got))
    if missing:
        raise CheckpointError(f"{what}: missing tensor(s) {', '.join(missing[:4])}"
                              + (" ..." if len(missing) > 4 else ""))
    extra = sorted(set(got) - set(want))
    if extra:
        raise CheckpointError(f"{what}: unexpected tensor(s) {', '.join(extra[:4])}")
    for k in want:
        if tuple(got[k]) != tuple(want[k]):
            raise CheckpointError(f"{what}: tensor {k} has shape {tuple(got[k])}, expected {tuple(want[k])}")
