"""The EAGLE-1/2 draft head.

Input at position j: fc(concat(embed(t_{j+1}), f_j)) with f_j the target's feature (final-norm
hidden state); then one Llama decoder layer without its input norm; no final norm. The target's
embedding and LM head are shared, never copied into the draft's params.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .cache import KVCache, init_cache
from .config import ModelConfig
from .layers import DecoderLayer, cache_mask
from .model import Target, resolve_dtype


class EagleDraft(nn.Module):
    config: ModelConfig  # the draft's own config (num_hidden_layers == 1)
    bias: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, embeds_BTD, features_BTD, positions_BT, cache: KVCache, local_mask_BTU,
                 offset: int = 0):
        """Returns (hidden [B,T,D] predicting the next feature, cache with the new keys/values
        written at length+offset; masks as in `Llama.__call__`)."""
        x = jnp.concatenate([embeds_BTD.astype(self.dtype), features_BTD.astype(self.dtype)], axis=-1)
        x = nn.Dense(self.config.hidden_size, use_bias=self.bias, dtype=self.dtype,
                     param_dtype=self.dtype, name="fc")(x)
        mask = cache_mask(cache.length, local_mask_BTU, cache.max_len)
        h, (k, v) = DecoderLayer(self.config, self.dtype, input_norm=False, name="layers_0")(
            x, positions_BT, cache.k[0], cache.v[0], cache.length + offset, mask)
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
        return EagleDraft(self.config, self.bias, self.dtype)


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


def init_draft(target: Target, seed: int = 0, dtype=None, bias: bool = True, **config_overrides) -> Draft:
    """A randomly initialised draft head fitting `target` (for tests and training from scratch)."""
    dt = resolve_dtype(dtype) if dtype is not None else target.dtype
    config = draft_config_for(target.config, **config_overrides)
    check_compatible(config, target.config)
    module = EagleDraft(config, bias, dt)
    params = jax.jit(lambda k: module.init(k, *_dummy_inputs(config, dt)))(jax.random.PRNGKey(seed))["params"]
    from .sharding import shard_params
    return Draft(config, shard_params(params, target.mesh), bias, dt)


def draft_apply(module: EagleDraft, params, embeds, features, positions, cache, local_mask, offset: int = 0):
    return module.apply({"params": params}, embeds, features, positions, cache, local_mask, offset)
