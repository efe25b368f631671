"""Hugging Face Llama directories: reading config.json + safetensors weights, and writing them."""
from __future__ import annotations

import glob
import json
import os
from typing import Callable

import jax
import numpy as np

from ..models import layer_list
from ..config import ModelConfig
from .convert import CheckpointError, check_params, convert, hf_table
from ..models.target import Target, abstract_target_params, resolve_dtype
from ..models.ops import choose as choose_ops
from ..sharding import shard_params


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
    """A target from a Hugging Face Llama directory (config.json + safetensors, its tokenizer if any)."""
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"no config.json in {directory}")
    config = ModelConfig.from_json_file(cfg_path)
    dt = resolve_dtype(dtype)
    tensors = _read_safetensors(directory)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    params = convert(tensors, hf_table(config), config, dt)
    check_params(params, abstract_target_params(config, dt), f"checkpoint {directory}")
    tok = None
    if tokenizer and any(os.path.exists(os.path.join(directory, f))
                         for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(directory)
    params = shard_params(params, mesh)
    return Target(config, params, tok, dt, mesh, source=directory, ops=choose_ops(params, dt, mesh))


def save_hf_dir(target: Target, directory: str) -> str:
    """Write `target` as a Hugging Face directory of its architecture (config.json + model.safetensors, float32)."""
    from safetensors.numpy import save_file
    c = target.config
    if c.model_type == "gemma3_text":
        raise CheckpointError("saving Gemma 3 targets as Hugging Face directories is not supported")
    if isinstance(target.params.get("embed"), dict):
        raise CheckpointError("this target keeps its weights in a backend's own form (GGUF blocks): "
                              "load it with packed=False to save it")
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
        for n in ("q", "k"):
            if f"{n}_norm" in L["attn"]:
                sd[pre + f"self_attn.{n}_norm.weight"] = L["attn"][f"{n}_norm"]["scale"]
        mlp = layer_list.split_gate_up(L["mlp"])  # (per-layer buffers hold gate and up concatenated)
        for n in ("gate", "up", "down"):
            sd[pre + f"mlp.{n}_proj.weight"] = mlp[n]["kernel"].T
    os.makedirs(directory, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(c.to_hf_dict(), f, indent=2)
    return directory
