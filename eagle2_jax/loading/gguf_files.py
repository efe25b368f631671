"""GGUF files: reading their metadata and tensors (through eagle2_jax.file_cache), and loading a
target from one. A backend may keep a GGUF's blocks in its own form (`register_gguf_packer`;
eagle2_jax.backends.cpu does for the CPU).
"""
from __future__ import annotations

import importlib.util
import os

from ..config import ModelConfig
from .convert import CheckpointError, check_params, convert, gguf_table
from ..file_cache import gguf_index, gguf_tokenizer, gguf_tokenizer_cached
from ..models.target import Target, abstract_target_params, resolve_dtype
from ..models.ops import choose as choose_ops
from ..sharding import shard_params


def open_gguf(path: str):
    """gguf.GGUFReader on `path`, its errors raised as CheckpointError."""
    import gguf
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the gguf package raises assorted errors on bad files
        raise CheckpointError(f"corrupt GGUF file {path}: {type(e).__name__}: {e}") from None


def gguf_reader(path: str):
    """What load_gguf reads of the file (file_cache.GGUFIndex: metadata + memory-mapped tensors),
    parsed once and then taken from the cache."""
    if not os.path.exists(path):
        raise CheckpointError(f"GGUF file not found: {path}")
    try:
        return gguf_index(path, open_gguf)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _gguf_field(reader, key, default=None):
    return reader.field(key, default)


def gguf_config(reader, path: str) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "gemma3"):
        raise CheckpointError(f"unsupported GGUF architecture {arch!r} in {path} (supported: llama, gemma3)")
    g = lambda k, d=None: _gguf_field(reader, f"{arch}.{k}", d)  # noqa: E731
    names = {t.name for t in reader.tensors}
    n_vocab = g("vocab_size")
    if n_vocab is None:
        n_vocab = _gguf_field(reader, "tokenizer.ggml.tokens#count", 0)
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    fields = dict(
        vocab_size=int(n_vocab), hidden_size=hidden, intermediate_size=int(g("feed_forward_length")),
        num_hidden_layers=int(g("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        max_position_embeddings=int(g("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_gguf_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    if arch == "gemma3":  # as llama.cpp reads it: every 6th layer global, the others local; scores / sqrt(head_dim)
        L, head_dim = fields["num_hidden_layers"], int(g("attention.key_length", 256))
        fields.update(model_type="gemma3_text", qk_norm=True, sandwich_norm=True, embed_scale=True,
                      hidden_activation="gelu_pytorch_tanh", head_dim=head_dim, query_pre_attn_scalar=head_dim,
                      sliding_window=int(g("attention.sliding_window", 512)),
                      layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                        for i in range(L)))
        if g("rope.scaling.type") == "linear":
            fields["rope_scaling"] = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    return ModelConfig(**fields)


GGUF_PACKERS: list = []


def register_gguf_packer(packer) -> None:
    """Add a backend's GGUF loader: packer(reader, config, dtype, mesh, path, rest_loader) returns a
    param tree that keeps the file's blocks in the backend's form, or None where it cannot."""
    if packer not in GGUF_PACKERS:
        GGUF_PACKERS.append(packer)


def load_gguf(path: str, dtype="auto", mesh=None, tokenizer: bool = True, packed: bool | None = None) -> Target:
    """A target from a GGUF file. packed=None lets a registered backend keep the file's blocks
    (eagle2_jax.backends.cpu: Q4_1 / Q8_0 on one CPU device, read by its kernels, bit-for-bit the float32
    model's results from a sixth of the memory traffic, plus a float32 copy for calls over many
    rows: ~1.2x the float32 model's memory). packed=False always dequantises to `dtype`;
    packed=True raises if no backend can keep this file and setting packed."""
    import gguf
    reader = gguf_reader(path)
    config = gguf_config(reader, path)
    if tokenizer:
        if not gguf_tokenizer_cached(path) and importlib.util.find_spec("torch") is None:
            raise CheckpointError(f"reading the tokenizer of {path} needs PyTorch (transformers converts GGUF "
                                  "tokenizers with it): pip install torch, or load with tokenizer=False")
    dt = resolve_dtype(dtype)

    def loader(t):
        def load():
            try:
                return gguf.quants.dequantize(t.data, t.tensor_type)
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"corrupt tensor {t.name} in {path}: {e}") from None
        return load

    params = None
    if packed is not False:
        params = next((p for p in (packer(reader, config, dt, mesh, path, loader) for packer in GGUF_PACKERS)
                       if p is not None), None)
    if packed and params is None:
        raise CheckpointError(f"cannot keep {path} packed: no registered backend takes this file and setting "
                              "(the CPU backend needs float32 on one CPU device, Q4_1 layer matrices and a tied "
                              "Q8_0 embedding)")
    if params is None:
        params = convert({t.name: loader(t) for t in reader.tensors}, gguf_table(config), config, dt,
                         ignore=(r"rope_freqs",))
        check_params(params, abstract_target_params(config, dt), f"GGUF {path}")
        params = shard_params(params, mesh)
    tok = None
    if tokenizer:
        tok = gguf_tokenizer(path)
    return Target(config, params, tok, dt, mesh, source=path, ops=choose_ops(params, dt, mesh))
