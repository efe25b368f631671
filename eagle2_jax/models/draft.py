"""The EAGLE-1/2 draft head.

Input at position j: fc(concat(embed(t_{j+1}), f_j)) with f_j the target's feature (final-norm
hidden state); then one Llama decoder layer without its input norm; no final norm. The target's
embedding and LM head are shared, never copied into the draft's params.

Params: fc/kernel [2D, D] (+ fc/bias [D]); layers_0/... one decoder layer (eagle2_jax.models.layers) without
input_norm; optionally vocab_head {ids [V'], w [D, V']} (see `with_draft_vocab`). The draft cache is
a stacked cache with L = 1.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .cache import KVCache, init_cache
from ..config import ModelConfig
from .layers import causal_mask, decoder_layer, dense, init_dense, init_layer, rope_tables
from .eagle3 import Eagle3Draft, default_aux_layers
from .target import Target, module_param, one_layer_forward, resolve_dtype
from .ops import XLA, Ops
from ..sharding import param_shardings, shard_params


class EagleDraft(nn.Module):
    config: ModelConfig  # the draft's own config (num_hidden_layers == 1)
    bias: bool = True
    dtype: Any = jnp.float32
    ops: Ops = XLA
    aux_layers: tuple = ()  # EAGLE-1/2 heads read the target's final features, no other layer

    def setup(self):
        c, dt = self.config, self.dtype
        D = c.hidden_size
        self.fc = module_param(self, "fc", lambda key: init_dense(key, (2 * D,), (D,), self.bias, dt))
        self.layer = module_param(self, "layers_0", lambda key: init_layer(key, c, dt, input_norm=False))

    def __call__(self, embeds_BTD, features_BTD, positions_BT, cache: KVCache, local_mask_BTU,
                 offset: int = 0, fresh: bool = False):
        """Returns (hidden [B,T,D] predicting the next feature, cache with the new keys/values
        written at length+offset; masks and `fresh` as in `Llama.__call__`)."""
        x = jnp.concatenate([embeds_BTD.astype(self.dtype), features_BTD.astype(self.dtype)], axis=-1)
        x = dense(self.ops, self.fc, x)
        c = self.config
        rope = rope_tables(c, positions_BT, local=c.windowed)
        return one_layer_forward(self.ops, cache, local_mask_BTU, offset, fresh,
                                 lambda attend: decoder_layer(self.ops, c, self.layer, x, rope, attend),
                                 c.sliding_window if c.windowed else None, positions_BT)


@dataclasses.dataclass
class Draft:
    config: ModelConfig
    params: Any
    bias: bool = True
    dtype: Any = jnp.float32
    source: str = "random"
    ops: Ops = XLA  # the target's (set by the loaders)
    arch: str = "eagle2"  # "eagle2" (EAGLE-1/2 heads) or "eagle3" (eagle2_jax.models.eagle3)
    draft_vocab_size: int = 0  # EAGLE-3: its LM head's rows
    aux_layers: tuple = ()  # EAGLE-3: the target layers feeding fc

    @property
    def proposal_vocab_size(self) -> int | None:
        """How many tokens the head can propose: its draft vocabulary (EAGLE-3 LM head rows, or a
        reduced `vocab_head`), None where it drafts over the target's whole vocabulary."""
        if self.arch == "eagle3":
            return self.draft_vocab_size
        if isinstance(self.params, dict) and "vocab_head" in self.params:
            return int(self.params["vocab_head"]["ids"].shape[0])
        return None

    @property
    def module(self):
        if self.arch == "eagle3":
            return Eagle3Draft(self.config, self.draft_vocab_size, self.aux_layers, self.dtype, self.ops)
        return EagleDraft(self.config, self.bias, self.dtype, self.ops)


def draft_config_for(target_config: ModelConfig, **overrides) -> ModelConfig:
    d = dataclasses.asdict(target_config)
    # heads use the Llama layer, for Qwen3 and Gemma 3 targets too: full attention, SwiGLU, no extra norms
    # a sliding-window target's head attends within the same window (one local layer whose RoPE is
    # the target's global base, as heads trained before the window had)
    window = target_config.sliding_window if target_config.windowed else None
    d.update(num_hidden_layers=1, tie_word_embeddings=False, qk_norm=False, sliding_window=window,
             layer_types=("sliding_attention",) if window else None, rope_local_base_freq=target_config.rope_theta,
             query_pre_attn_scalar=None, hidden_activation="silu", sandwich_norm=False, embed_scale=False)
    if d["model_type"] in ("qwen3", "gemma3_text"):  # so the head's config.json reads back as the Llama layer it is
        d["model_type"] = "llama"
    d.update(overrides)
    return ModelConfig(**d)


def check_compatible(draft_config: ModelConfig, target_config: ModelConfig, what: str = "draft"):
    if draft_config.hidden_size != target_config.hidden_size:
        raise ValueError(f"{what} hidden size {draft_config.hidden_size} does not match the target's "
                         f"{target_config.hidden_size}")
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"{what} vocabulary {draft_config.vocab_size} does not match the target's "
                         f"{target_config.vocab_size}")


def abstract_draft_params(config: ModelConfig, bias: bool, dtype, arch: str = "eagle2", draft_vocab_size: int = 0):
    module = _module(config, bias, dtype, arch, draft_vocab_size)
    return jax.eval_shape(lambda k: module.init(k, *_dummy_inputs(module)), jax.random.PRNGKey(0))["params"]


def _module(config, bias, dtype, arch, draft_vocab_size):
    if arch == "eagle3":
        return Eagle3Draft(config, draft_vocab_size, (), dtype)
    if arch != "eagle2":
        raise ValueError(f"draft arch must be 'eagle2' or 'eagle3', got {arch!r}")
    return EagleDraft(config, bias, dtype)


def _dummy_inputs(module):
    config, dtype = module.config, module.dtype
    B, T, D = 1, 2, config.hidden_size
    z = jnp.zeros((B, T, D), dtype)
    f = jnp.zeros((B, T, 3 * D), dtype) if getattr(module, "draft_vocab_size", 0) else z  # EAGLE-3: through fc
    cache = init_cache(1, B, T, config.num_key_value_heads, config.head_dim, dtype)
    return z, f, jnp.zeros((B, T), jnp.int32), cache, causal_mask(B, T)


@functools.partial(jax.jit, static_argnums=0)
def _init_params(module, key):
    """Random parameters; compiled once per module (modules compare by configuration and dtype)."""
    return module.init(key, *_dummy_inputs(module))["params"]


def init_draft(target: Target, seed: int = 0, dtype=None, bias: bool = True, arch: str = "eagle2",
               draft_vocab_size: int = 0, aux_layers=None, **config_overrides) -> Draft:
    """A randomly initialised draft head fitting `target` (for tests and training from scratch); for
    an abstract target (shapes only), an abstract head. arch "eagle3": an EAGLE-3 head drafting over
    `draft_vocab_size` tokens (default: the whole vocabulary; d2t maps index i to token i) from the
    target layers `aux_layers` (default eagle3.default_aux_layers)."""
    dt = resolve_dtype(dtype) if dtype is not None else target.dtype
    config = draft_config_for(target.config, **config_overrides)
    check_compatible(config, target.config)
    extra = {}
    if arch == "eagle3":
        draft_vocab_size = draft_vocab_size or target.config.vocab_size
        aux = tuple(aux_layers) if aux_layers is not None else default_aux_layers(target.config.num_hidden_layers)
        check_aux_layers(aux, target.config)
        extra = dict(arch="eagle3", draft_vocab_size=draft_vocab_size, aux_layers=aux)
        bias = False
    module = _module(config, bias, dt, arch, draft_vocab_size)
    if target.abstract:
        params = abstract_draft_params(config, bias, dt, arch, draft_vocab_size)
        if target.mesh is not None:
            params = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                            params, param_shardings(params, target.mesh))
        return Draft(config, params, bias, dt, ops=target.ops, **extra)
    params = _init_params(module, jax.random.PRNGKey(seed))
    return Draft(config, shard_params(params, target.mesh), bias, dt, ops=target.ops, **extra)


def check_aux_layers(aux_layers: tuple, target_config: ModelConfig):
    L = target_config.num_hidden_layers
    if len(aux_layers) != 3 or any(not (0 <= int(i) <= L) for i in aux_layers):  # L: after the last layer
        raise ValueError(f"EAGLE-3 aux layers must be three target layer indices in [0, {L}], got {aux_layers}")


def draft_apply(module: EagleDraft, params, embeds, features, positions, cache, local_mask, offset: int = 0,
                fresh: bool = False):
    net = {k: v for k, v in params.items() if k != "vocab_head"}
    return module.apply({"params": net}, embeds, features, positions, cache, local_mask, offset, fresh)


def draft_own_topk(module, params, h, k: int):
    """An EAGLE-3 head's k best next tokens (its own norm and LM head, d2t to target ids)."""
    return module.apply({"params": params}, h, k, method=Eagle3Draft.topk)


def with_draft_vocab(draft: Draft, target: Target, token_ids) -> Draft:
    """Let the draft rank only `token_ids` (e.g. the most frequent tokens of its training data).

    Adds params["vocab_head"] = {ids [V'], w [D, V']} cut from the target's LM head by the target's
    ops (a backend may keep it in its own form). For an abstract target, an abstract leaf.
    """
    ids = np.unique(np.asarray(token_ids, np.int64))
    if ids.size == 0 or ids.min() < 0 or ids.max() >= target.config.vocab_size:
        raise ValueError(f"draft vocabulary must be non-empty ids in [0, {target.config.vocab_size})")
    ids_j = jnp.asarray(ids, jnp.int32)
    tied = target.config.tie_word_embeddings
    if target.abstract:
        vh = jax.eval_shape(lambda p: XLA.vocab_head(p, tied, ids_j, draft.dtype), target.params)
    else:
        vh = shard_params({"vocab_head": target.ops.vocab_head(target.params, tied, ids_j, draft.dtype)},
                          target.mesh)["vocab_head"]
    net = {k: v for k, v in draft.params.items() if k != "vocab_head"}
    return dataclasses.replace(draft, params={**net, "vocab_head": vh})
