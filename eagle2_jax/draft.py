"""The EAGLE-1/2 draft head.

Input at position j: fc(concat(embed(t_{j+1}), f_j)) with f_j the target's feature (final-norm
hidden state); then one Llama decoder layer without its input norm; no final norm. The target's
embedding and LM head are shared, never copied into the draft's params.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import cpu_kernels as few_rows
from .cache import KVCache, init_cache
from .config import ModelConfig
from .layers import DecoderLayer, dense_dot_general, split_masks
from .model import Target, resolve_dtype


class EagleDraft(nn.Module):
    config: ModelConfig  # the draft's own config (num_hidden_layers == 1)
    bias: bool = True
    dtype: Any = jnp.float32
    few_row_kernels: bool = False  # see eagle2_jax.cpu_kernels

    @nn.compact
    def __call__(self, embeds_BTD, features_BTD, positions_BT, cache: KVCache, local_mask_BTU,
                 offset: int = 0):
        """Returns (hidden [B,T,D] predicting the next feature, cache with the new keys/values
        written at length+offset; masks as in `Llama.__call__`)."""
        x = jnp.concatenate([embeds_BTD.astype(self.dtype), features_BTD.astype(self.dtype)], axis=-1)
        x = nn.Dense(self.config.hidden_size, use_bias=self.bias, dtype=self.dtype,
                     param_dtype=self.dtype, name="fc",
                     dot_general=dense_dot_general(self.few_row_kernels))(x)
        masks = split_masks(cache.length, local_mask_BTU, offset, cache.max_len)
        h, (k, v) = DecoderLayer(self.config, self.dtype, input_norm=False,
                                   few_row_kernels=self.few_row_kernels, name="layers_0")(
            x, positions_BT, cache.k[0], cache.v[0], cache.length + offset, masks)
        return h, cache.replace(k=(k,), v=(v,))


@dataclasses.dataclass
class Draft:
    config: ModelConfig
    params: Any
    bias: bool = True
    dtype: Any = jnp.float32
    source: str = "random"

    @property
    def module(self) -> EagleDraft:
        return EagleDraft(self.config, self.bias, self.dtype, few_rows.use_for(self.params))


def draft_config_for(target_config: ModelConfig, **overrides) -> ModelConfig:
    d = dataclasses.asdict(target_config)
    d.update(num_hidden_layers=1, tie_word_embeddings=False)
    d.update(overrides)
    return ModelConfig(**d)


def check_compatible(draft_config: ModelConfig, target_config: ModelConfig, what: str = "draft"):
    if draft_config.hidden_size != target_config.hidden_size:
        raise ValueError(f"{what} hidden size {draft_config.hidden_size} does not match the target's "
                         f"{target_config.hidden_size}")
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"{what} vocabulary {draft_config.vocab_size} does not match the target's "
                         f"{target_config.vocab_size}")


def abstract_draft_params(config: ModelConfig, bias: bool, dtype):
    module = EagleDraft(config, bias, dtype)
    return jax.eval_shape(lambda k: module.init(k, *_dummy_inputs(config, dtype)), jax.random.PRNGKey(0))["params"]


def _dummy_inputs(config, dtype):
    B, T, D = 1, 2, config.hidden_size
    from .layers import causal_mask
    z = jnp.zeros((B, T, D), dtype)
    cache = init_cache(1, B, T, config.num_key_value_heads, config.head_dim, dtype)
    return z, z, jnp.zeros((B, T), jnp.int32), cache, causal_mask(B, T)


@functools.partial(jax.jit, static_argnums=0)
def _init_params(module: EagleDraft, key):
    """Random parameters; compiled once per module (modules compare by configuration and dtype)."""
    return module.init(key, *_dummy_inputs(module.config, module.dtype))["params"]


def init_draft(target: Target, seed: int = 0, dtype=None, bias: bool = True, **config_overrides) -> Draft:
    """A randomly initialised draft head fitting `target` (for tests and training from scratch)."""
    dt = resolve_dtype(dtype) if dtype is not None else target.dtype
    config = draft_config_for(target.config, **config_overrides)
    check_compatible(config, target.config)
    module = EagleDraft(config, bias, dt)
    params = _init_params(module, jax.random.PRNGKey(seed))
    from .sharding import shard_params
    return Draft(config, shard_params(params, target.mesh), bias, dt)


def draft_apply(module: EagleDraft, params, embeds, features, positions, cache, local_mask, offset: int = 0):
    net = {k: v for k, v in params.items() if k != "vocab_head"}
    return module.apply({"params": net}, embeds, features, positions, cache, local_mask, offset)


def with_draft_vocab(draft: Draft, target: Target, token_ids) -> Draft:
    """Let the draft rank only `token_ids` (e.g. the most frequent tokens of its training data).

    Adds params["vocab_head"] = {ids [V'], w [D, V']} taken from the target's LM head ({ids, q8
    [V', D], d [V', D/32], w [V', D]}, a packed Q8_0 leaf of the same weights, when the target was
    loaded packed).
    """
    import numpy as np
    ids = np.unique(np.asarray(token_ids, np.int64))
    if ids.size == 0 or ids.min() < 0 or ids.max() >= target.config.vocab_size:
        raise ValueError(f"draft vocabulary must be non-empty ids in [0, {target.config.vocab_size})")
    p = target.params
    from .packed import is_packed
    ids_j = jnp.asarray(ids, jnp.int32)
    if target.config.tie_word_embeddings and is_packed(p["embed"]) and jnp.dtype(draft.dtype) == jnp.float32:
        # the same float32 weights, kept in the embedding's Q8_0 blocks (eagle2_jax.packed)
        vh = {"vocab_head": {k: jnp.take(p["embed"][k], ids_j, axis=0) for k in ("q8", "d", "w")
                             if k in p["embed"]}}  # "w" [V', D]: past the kernel's rows (packed.matmul_nt)
        vh["vocab_head"]["ids"] = ids_j
        net = {k: v for k, v in draft.params.items() if k != "vocab_head"}
        return dataclasses.replace(draft, params={**net, **vh})
    from .packed import dequantize
    head = dequantize(p["embed"]).T if target.config.tie_word_embeddings else p["lm_head"]  # [D, V]
    w = jnp.take(head, ids_j, axis=1).astype(draft.dtype)
    from .sharding import shard_params
    vh = shard_params({"vocab_head": {"ids": ids_j, "w": w}}, target.mesh)
    net = {k: v for k, v in draft.params.items() if k != "vocab_head"}
    return dataclasses.replace(draft, params={**net, **vh})
