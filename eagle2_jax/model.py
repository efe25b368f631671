"""The target: a Llama-family decoder as a Flax module over an explicit param pytree.

Param tree (per-layer params unstacked so no layer slice is ever copied on the hot path):
  embed [V, D]; layers_i/{input_norm,post_norm}/scale [D];
  layers_i/attn/{q,k,v}/kernel [D, H|K, Dh] (+ bias [H|K, Dh]); layers_i/attn/o/kernel [H, Dh, D];
  layers_i/mlp/{gate,up}/kernel [D, F]; layers_i/mlp/down/kernel [F, D]; norm/scale [D];
  lm_head [D, V] when embeddings are untied.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from .cache import KVCache
from .config import ModelConfig
from .layers import DecoderLayer, RMSNorm, causal_mask

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    return dtype


class Llama(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32

    def setup(self):
        c = self.config
        init = nn.initializers.normal(0.02)
        self.embed = self.param("embed", init, (c.vocab_size, c.hidden_size), self.dtype)
        self.layers = [DecoderLayer(c, self.dtype, name=f"layers_{i}")
                       for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = self.param("lm_head", init, (c.hidden_size, c.vocab_size), self.dtype)

    def embed_tokens(self, tokens_BT):
        return jnp.take(self.embed, tokens_BT, axis=0)

    def logits(self, features_BTD):
        """LM head, accumulated and returned in float32."""
        if self.config.tie_word_embeddings:
            return jnp.einsum("...d,vd->...v", features_BTD, self.embed,
                              preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", features_BTD, self.lm_head,
                          preferred_element_type=jnp.float32)

    def __call__(self, tokens_BT, positions_BT, cache: Optional[KVCache], local_mask_BTT):
        """Returns (features [B,T,D] after the final norm, per-layer local (k, v) [B,T,K,Dh])."""
        x = self.embed_tokens(tokens_BT)
        new_kv = []
        for i, layer in enumerate(self.layers):
            ck = cache.k[i] if cache is not None else None
            cv = cache.v[i] if cache is not None else None
            clen = cache.length if cache is not None else None
            x, kv = layer(x, positions_BT, ck, cv, clen, local_mask_BTT)
            new_kv.append(kv)
        return self.norm(x), tuple(new_kv)

    def init_all(self, tokens_BT):
        B, T = tokens_BT.shape
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        f, _ = self(tokens_BT, pos, None, causal_mask(B, T))
        return self.logits(f)


@dataclasses.dataclass
class Target:
    """A target model: config, param pytree, tokenizer (None for random models), optional mesh."""

    config: ModelConfig
    params: Any
    tokenizer: Any = None
    dtype: Any = jnp.float32
    mesh: Any = None
    source: str = "random"

    @property
    def module(self) -> Llama:
        return Llama(self.config, self.dtype)

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree_util.tree_leaves(self.params))


def init_target(config: ModelConfig, seed: int = 0, dtype="float32", mesh=None) -> Target:
    """A randomly initialised target (for tests and timing)."""
    from .sharding import shard_params
    dt = resolve_dtype(dtype)
    module = Llama(config, dt)
    params = jax.jit(lambda k: module.init(k, jnp.zeros((1, 2), jnp.int32), method=Llama.init_all))(
        jax.random.PRNGKey(seed))["params"]
    params = shard_params(params, mesh)
    return Target(config, params, None, dt, mesh)


def target_apply(module: Llama, params, tokens_BT, positions_BT, cache, local_mask_BTT):
    return module.apply({"params": params}, tokens_BT, positions_BT, cache, local_mask_BTT)


def target_logits(module: Llama, params, features):
    return module.apply({"params": params}, features, method=Llama.logits)


def target_embed(module: Llama, params, tokens):
    return module.apply({"params": params}, tokens, method=Llama.embed_tokens)


def forward(target: Target, input_ids) -> jax.Array:
    """Full causal forward without a cache: float32 logits [B, T, V]."""
    ids = jnp.asarray(input_ids, jnp.int32)
    if ids.ndim == 1:
        ids = ids[None]
    return _forward_jit(target.module, target.params, ids)




def _forward(module, params, ids):
    B, T = ids.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    f, _ = target_apply(module, params, ids, pos, None, causal_mask(B, T))
    return target_logits(module, params, f)


_forward_jit = jax.jit(_forward, static_argnums=0)
