"""Draft-head checkpoints: the published EAGLE format and our own Orbax format.

EAGLE format: `config.json` (Llama-style, num_hidden_layers 1, optional `bias`) and
`model.safetensors` or `pytorch_model.bin` with keys fc.weight, fc.bias, layers.0.self_attn.*,
layers.0.mlp.*, layers.0.post_attention_layernorm.weight, optionally embed_tokens.weight (unused:
the target's embedding is shared). Pickles are only read with torch.load(weights_only=True).

Ours: a directory with `eagle2_jax_draft.json` (config + bias) and an Orbax checkpoint `params/`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..models import layer_list
from ..config import ModelConfig
from .convert import (CheckpointError, check_params, convert, identity, kv_bias, kv_kernel, o_kernel, q_bias,
    q_kernel, transpose)
from ..models.draft import (Draft, abstract_draft_params, check_aux_layers, check_compatible, init_draft,
    with_draft_vocab)
from ..models.eagle3 import default_aux_layers
from .hub import is_hub_id, snapshot
from ..models.target import Target, resolve_dtype
from ..sharding import shard_params

OURS_META = "eagle2_jax_draft.json"
VOCAB_FILE = "draft_vocab.json"  # optional: token ids the draft ranks (frequent-token subset)
RANDOM_DRAFT_VOCAB = 32000  # draft vocabulary of load_draft("random") for large target vocabularies
HEADS_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "heads")
NAMED_DRAFTS = {name: os.path.join(HEADS_DIR, name)
                for name in ("smollm2-135m-instruct", "smollm2-135m-instruct-eagle3", "gemma3-270m")}

EAGLE_TABLE = (
    (r"fc\.weight", "fc/kernel", transpose),
    (r"fc\.bias", "fc/bias", identity),
    (r"layers\.0\.post_attention_layernorm\.weight", "layers_0/post_norm/scale", identity),
    (r"layers\.0\.self_attn\.q_proj\.weight", "layers_0/attn/q/kernel", q_kernel),
    (r"layers\.0\.self_attn\.k_proj\.weight", "layers_0/attn/k/kernel", kv_kernel),
    (r"layers\.0\.self_attn\.v_proj\.weight", "layers_0/attn/v/kernel", kv_kernel),
    (r"layers\.0\.self_attn\.q_proj\.bias", "layers_0/attn/q/bias", q_bias),
    (r"layers\.0\.self_attn\.k_proj\.bias", "layers_0/attn/k/bias", kv_bias),
    (r"layers\.0\.self_attn\.v_proj\.bias", "layers_0/attn/v/bias", kv_bias),
    (r"layers\.0\.self_attn\.o_proj\.weight", "layers_0/attn/o/kernel", o_kernel),
    (r"layers\.0\.mlp\.(gate|up|down)_proj\.weight", "layers_0/mlp/{0}/kernel", transpose),
)


def _q2(w, c):  # EAGLE-3 q_proj [H*Dh, 2D] -> [2D, H, Dh]
    return w.T.reshape(2 * c.hidden_size, c.num_attention_heads, c.head_dim)


def _kv2(w, c):
    return w.T.reshape(2 * c.hidden_size, c.num_key_value_heads, c.head_dim)


# the published EAGLE-3 layout (the official code's and SGLang's key names); d2t / t2d / embed_tokens apart
EAGLE3_TABLE = (
    (r"fc\.weight", "fc/kernel", transpose),
    (r"midlayer\.input_layernorm\.weight", "layers_0/input_norm/scale", identity),
    (r"midlayer\.hidden_norm\.weight", "layers_0/hidden_norm/scale", identity),
    (r"midlayer\.post_attention_layernorm\.weight", "layers_0/post_norm/scale", identity),
    (r"midlayer\.self_attn\.q_proj\.weight", "layers_0/attn/q/kernel", _q2),
    (r"midlayer\.self_attn\.(k|v)_proj\.weight", "layers_0/attn/{0}/kernel", _kv2),
    (r"midlayer\.self_attn\.o_proj\.weight", "layers_0/attn/o/kernel", o_kernel),
    (r"midlayer\.mlp\.(gate|up|down)_proj\.weight", "layers_0/mlp/{0}/kernel", transpose),
    (r"norm\.weight", "norm/scale", identity),
    (r"lm_head\.weight", "lm_head", transpose),
)
AUX_KEY = "eagle_aux_hidden_state_layer_ids"  # config key for the target layers feeding fc (optional)


def _read_eagle_tensors(directory: str) -> dict:
    st = os.path.join(directory, "model.safetensors")
    pt = os.path.join(directory, "pytorch_model.bin")
    if os.path.exists(st):
        from safetensors import safe_open
        try:
            h = safe_open(st, framework="flax")
            return {n: (lambda n=n: np.asarray(h.get_tensor(n), np.float32)) for n in h.keys()}
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"corrupt draft weights {st}: {e}") from None
    if os.path.exists(pt):
        try:
            import torch
        except ImportError:
            raise CheckpointError(f"{pt} is a PyTorch pickle: install torch to read it "
                                  f"(weights_only), or convert it to model.safetensors") from None
        try:
            sd = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read {pt} safely (weights_only): {e}") from None
        return {n: (lambda v=v: v.float().numpy()) for n, v in sd.items()}
    raise CheckpointError(f"no model.safetensors or pytorch_model.bin in {directory}")


def _is_eagle3(raw: dict, names) -> bool:
    return ("draft_vocab_size" in raw or any("Eagle3" in a for a in raw.get("architectures", []) or [])
            or any(n.startswith("midlayer.") for n in names))


def _load_eagle3(directory: str, raw: dict, tensors: dict, target: Target, dtype) -> Draft:
    where = f"draft {directory}"
    if "draft_vocab_size" not in raw:
        raise CheckpointError(f"{where}: EAGLE-3 weights (midlayer.*) but config.json has no draft_vocab_size "
                              "(an EAGLE-1/2 config?)")
    if not any(n.startswith("midlayer.") for n in tensors):
        raise CheckpointError(f"{where}: config.json describes an EAGLE-3 head but the weights have no midlayer.*")
    Vd, V = int(raw["draft_vocab_size"]), target.config.vocab_size
    # head_dim as the weights give it: the official code derives hidden / heads and ignores the field,
    # newer trainers (SpecForge, for Qwen3 heads) honour it; the q projection's rows settle which
    q = tensors.get("midlayer.self_attn.q_proj.weight")
    heads = int(raw.get("num_attention_heads", 0) or 0)
    raw = {k: v for k, v in raw.items() if k != "head_dim"}
    if q is not None and heads and tuple(q().shape)[0] % heads == 0:
        raw["head_dim"] = tuple(q().shape)[0] // heads
    config = ModelConfig.from_hf_dict({**raw, "num_hidden_layers": 1, "tie_word_embeddings": False,
                                       "model_type": raw.get("model_type", "llama")})
    check_compatible(config, target.config, what=f"{where}:")
    if not 0 < Vd <= V:
        raise CheckpointError(f"{where}: draft_vocab_size {Vd} must be in [1, {V}]")
    aux = tuple(int(i) for i in raw.get(AUX_KEY) or default_aux_layers(target.config.num_hidden_layers))
    try:
        check_aux_layers(aux, target.config)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    d2t = tensors.pop("d2t", None)
    t2d = tensors.pop("t2d", None)
    emb = tensors.pop("embed_tokens.weight", None)
    if emb is not None and tuple(emb().shape) != (V, target.config.hidden_size):
        raise CheckpointError(f"{where}: embed_tokens shape does not match the target")
    if d2t is None and Vd < V:
        raise CheckpointError(f"{where}: a {Vd}-token draft vocabulary needs the d2t map (draft id -> target id)")
    d2t = np.zeros((Vd,), np.int64) if d2t is None else np.asarray(d2t(), np.float64).astype(np.int64)
    if d2t.shape != (Vd,) or (np.arange(Vd) + d2t).min() < 0 or (np.arange(Vd) + d2t).max() >= V:
        raise CheckpointError(f"{where}: d2t must map {Vd} draft ids into [0, {V})")
    if t2d is not None and tuple(t2d().shape) != (V,):
        raise CheckpointError(f"{where}: t2d has shape {tuple(t2d().shape)}, expected ({V},)")
    params = convert(tensors, EAGLE3_TABLE, config, dtype, stack=False)
    params["d2t"] = d2t.astype(np.int32)
    check_params(params, abstract_draft_params(config, False, dtype, "eagle3", Vd), where)
    return Draft(config, shard_params(params, target.mesh), False, dtype, source=directory, ops=target.ops,
                 arch="eagle3", draft_vocab_size=Vd, aux_layers=aux)


def _load_eagle(directory: str, target: Target, dtype) -> Draft:
    cfg_path = os.path.join(directory, "config.json")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"corrupt draft config {cfg_path}: {e}") from None
    if _is_eagle3(raw, ()):
        return _load_eagle3(directory, raw, _read_eagle_tensors(directory), target, dtype)
    bias = bool(raw.get("bias", True))
    raw = {**raw, "num_hidden_layers": 1, "tie_word_embeddings": False}
    raw.setdefault("model_type", "llama")
    config = ModelConfig.from_hf_dict(raw)
    check_compatible(config, target.config, what=f"draft {directory}:")
    tensors = _read_eagle_tensors(directory)
    if _is_eagle3({}, tensors):
        raise CheckpointError(f"draft {directory}: EAGLE-3 weights (midlayer.*) but config.json has no "
                              "draft_vocab_size (an EAGLE-1/2 config?)")
    emb = tensors.pop("embed_tokens.weight", None)
    if emb is not None and tuple(emb().shape) != (target.config.vocab_size, target.config.hidden_size):
        raise CheckpointError(f"draft {directory}: embed_tokens shape does not match the target")
    params = convert(tensors, EAGLE_TABLE, config, dtype, stack=False)
    check_params(params, abstract_draft_params(config, bias, dtype), f"draft {directory}")
    return Draft(config, shard_params(params, target.mesh), bias, dtype, source=directory, ops=target.ops)


def _load_ours(directory: str, target: Target, dtype) -> Draft:
    import orbax.checkpoint as ocp
    with open(os.path.join(directory, OURS_META)) as f:
        meta = json.load(f)
    config = ModelConfig.from_hf_dict(meta["config"])
    check_compatible(config, target.config, what=f"draft {directory}:")
    bias = bool(meta.get("bias", True))
    arch, Vd, aux = meta.get("arch", "eagle2"), int(meta.get("draft_vocab_size", 0)), tuple(meta.get("aux_layers", ()))
    abstract = abstract_draft_params(config, bias, dtype, arch, Vd)
    try:
        params = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(directory, "params")))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"corrupt draft checkpoint {directory}: {type(e).__name__}: {e}") from None
    params = jax.tree_util.tree_map(lambda x, a: jnp.asarray(x, a.dtype), params, abstract)
    check_params(params, abstract, f"draft {directory}")
    extra = dict(arch=arch, draft_vocab_size=Vd, aux_layers=aux) if arch == "eagle3" else {}
    return Draft(config, shard_params(params, target.mesh), bias, dtype, source=directory, ops=target.ops, **extra)


def load_draft(source: str, target: Target, dtype: Optional[str] = None, draft_vocab: bool = True) -> Draft:
    """Load a draft head for `target`: a named head, an EAGLE-format directory, or ours.

    A `draft_vocab.json` beside the weights (and `draft_vocab=True`) restricts drafting to those tokens.
    `random` (or any `random:...` name) gives a randomly initialised head fitting `target`, for timing;
    for a vocabulary over RANDOM_DRAFT_VOCAB tokens (Llama 3's 128,256) it drafts over that many ids
    (a stand-in for a trained head's frequency-ranked draft vocabulary: each draft pass then reads a
    quarter of the LM head), unless `draft_vocab=False`. For a target with per-layer buffers (GPU),
    the head's gate and up weights become one buffer as the target's do (`layer_list.draft_like`).
    """
    return layer_list.draft_like(_load_draft_vocab(source, target, dtype, draft_vocab), target)


def _load_draft_vocab(source: str, target: Target, dtype, draft_vocab: bool) -> Draft:
    if str(source) == "random" or str(source).startswith("random:"):
        d = init_draft(target, dtype=dtype)
        if draft_vocab and target.config.vocab_size > RANDOM_DRAFT_VOCAB:
            d = with_draft_vocab(d, target, np.arange(RANDOM_DRAFT_VOCAB))
        return d
    d = _load_draft(source, target, dtype)
    vocab = os.path.join(d.source, VOCAB_FILE)
    if draft_vocab and os.path.exists(vocab):
        try:
            with open(vocab) as f:
                ids = json.load(f)["ids"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"corrupt {vocab}: {e}") from None
        d = with_draft_vocab(d, target, ids)
    return d


def _load_draft(source: str, target: Target, dtype: Optional[str] = None) -> Draft:
    dt = resolve_dtype(dtype) if dtype is not None else target.dtype
    path = NAMED_DRAFTS.get(str(source), str(source))
    if not os.path.isdir(path) and is_hub_id(path):
        path = snapshot(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"draft {source!r} not found: not a directory, a Hugging Face Hub id (org/name), "
                              f"'random', or one of {', '.join(sorted(NAMED_DRAFTS))}")
    if os.path.exists(os.path.join(path, OURS_META)):
        return _load_ours(path, target, dt)
    if os.path.exists(os.path.join(path, "config.json")):
        return _load_eagle(path, target, dt)
    raise CheckpointError(f"{path} is not a draft checkpoint (no config.json or {OURS_META})")


def eagle_state_dict(draft: Draft) -> dict:
    """Our params -> EAGLE key names and torch layouts (numpy float32)."""
    draft = _unfused(draft)
    c = draft.config
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), draft.params)
    L = p["layers_0"]
    sd = {"fc.weight": p["fc"]["kernel"].T,
          "layers.0.post_attention_layernorm.weight": L["post_norm"]["scale"]}
    if "bias" in p["fc"]:
        sd["fc.bias"] = p["fc"]["bias"]
    for n in ("q", "k", "v"):
        k = L["attn"][n]["kernel"]
        sd[f"layers.0.self_attn.{n}_proj.weight"] = k.reshape(c.hidden_size, -1).T
        if "bias" in L["attn"][n]:
            sd[f"layers.0.self_attn.{n}_proj.bias"] = L["attn"][n]["bias"].reshape(-1)
    sd["layers.0.self_attn.o_proj.weight"] = L["attn"]["o"]["kernel"].reshape(-1, c.hidden_size).T
    for n in ("gate", "up", "down"):
        sd[f"layers.0.mlp.{n}_proj.weight"] = L["mlp"][n]["kernel"].T
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def eagle3_state_dict(draft: Draft) -> dict:
    """An EAGLE-3 head's params -> the published key names and torch layouts (numpy)."""
    draft = _unfused(draft)
    c, V = draft.config, draft.config.vocab_size
    p = jax.tree_util.tree_map(lambda x: np.asarray(x), draft.params)
    L = p["layers_0"]
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    sd = {"fc.weight": f32(p["fc"]["kernel"]).T, "norm.weight": f32(p["norm"]["scale"]),
          "lm_head.weight": f32(p["lm_head"]).T,
          "midlayer.input_layernorm.weight": f32(L["input_norm"]["scale"]),
          "midlayer.hidden_norm.weight": f32(L["hidden_norm"]["scale"]),
          "midlayer.post_attention_layernorm.weight": f32(L["post_norm"]["scale"])}
    for n in ("q", "k", "v"):
        sd[f"midlayer.self_attn.{n}_proj.weight"] = f32(L["attn"][n]["kernel"]).reshape(2 * c.hidden_size, -1).T
    sd["midlayer.self_attn.o_proj.weight"] = f32(L["attn"]["o"]["kernel"]).reshape(-1, c.hidden_size).T
    for n in ("gate", "up", "down"):
        sd[f"midlayer.mlp.{n}_proj.weight"] = f32(L["mlp"][n]["kernel"]).T
    d2t = np.asarray(p["d2t"], np.int64)
    t2d = np.zeros((V,), bool)
    t2d[np.arange(d2t.size) + d2t] = True
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}, {"d2t": d2t, "t2d": t2d}


def _unfused(draft: Draft) -> Draft:
    """The draft with gate and up apart, as every written layout holds them (see layer_list.draft_like)."""
    layer = draft.params["layers_0"]
    if "gate_up" not in layer["mlp"]:
        return draft
    layer = {**layer, "mlp": layer_list.split_gate_up(layer["mlp"])}
    return dataclasses.replace(draft, params={**draft.params, "layers_0": layer})


def save_draft(draft: Draft, directory: str, format: str = "eagle", dtype: str = "bfloat16", target=None) -> str:
    """Write `draft` as an EAGLE-format directory (safetensors: format "eagle" for EAGLE-1/2 heads,
    "eagle3" for EAGLE-3 heads, the published layouts) or in our Orbax format (plus
    `draft_vocab.json` when the draft has a vocabulary subset). With `target`, an EAGLE-1/2 export
    also holds `embed_tokens.weight` (the target's embedding), as the official code's strict loader
    expects."""
    draft = _unfused(draft)
    if format == "eagle" and draft.arch == "eagle3":
        format = "eagle3"
    if format == "eagle3" and draft.arch != "eagle3":
        raise ValueError("format 'eagle3' writes EAGLE-3 heads; this is an EAGLE-1/2 head (format 'eagle')")
    os.makedirs(directory, exist_ok=True)
    if format == "eagle3":
        from safetensors.flax import save_file
        dt = resolve_dtype(dtype)
        weights, maps = eagle3_state_dict(draft)
        sd = {k: jnp.asarray(v, dt) for k, v in weights.items()}
        sd.update({k: jnp.asarray(v) for k, v in maps.items()})
        save_file(sd, os.path.join(directory, "model.safetensors"))
        cfg = draft.config.to_hf_dict()
        cfg.update(num_hidden_layers=1, torch_dtype=dtype, draft_vocab_size=draft.draft_vocab_size,
                   architectures=["LlamaForCausalLMEagle3"], **{AUX_KEY: list(draft.aux_layers)})
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        return directory
    vh = draft.params.get("vocab_head")
    if vh is not None:
        with open(os.path.join(directory, VOCAB_FILE), "w") as f:
            json.dump({"ids": np.asarray(vh["ids"]).tolist()}, f)
        draft = dataclasses.replace(draft, params={k: v for k, v in draft.params.items() if k != "vocab_head"})
    if format == "eagle":
        from safetensors.flax import save_file
        dt = resolve_dtype(dtype)
        sd = {k: jnp.asarray(v, dt) for k, v in eagle_state_dict(draft).items()}
        if target is not None:
            sd["embed_tokens.weight"] = jnp.asarray(target.ops.weight(target.params["embed"]), dt)  # backend form -> array
        save_file(sd, os.path.join(directory, "model.safetensors"))
        cfg = draft.config.to_hf_dict()
        cfg.update(bias=draft.bias, num_hidden_layers=1, torch_dtype=dtype)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        return directory
    if format == "orbax":
        import orbax.checkpoint as ocp
        target_dir = os.path.abspath(os.path.join(directory, "params"))
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(target_dir, draft.params, force=True)
        ckptr.wait_until_finished()
        meta = {"config": draft.config.to_hf_dict(), "bias": draft.bias}
        if draft.arch == "eagle3":
            meta.update(arch="eagle3", draft_vocab_size=draft.draft_vocab_size, aux_layers=list(draft.aux_layers))
        with open(os.path.join(directory, OURS_META), "w") as f:
            json.dump(meta, f, indent=2)
        return directory
    raise ValueError(f"format must be 'eagle', 'eagle3' or 'orbax', got {format!r}")
