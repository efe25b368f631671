"""The target: a Llama-family decoder as a Flax module over an explicit param pytree.

Param tree (per-layer params unstacked so no layer slice is ever copied on the hot path):
  embed [V, D]; layers_i/{input_norm,post_norm}/scale [D];
  layers_i/attn/{q,k,v}/kernel [D, H|K, Dh] (+ bias [H|K, Dh]); layers_i/attn/o/kernel [H, Dh, D];
  layers_i/mlp/{gate,up}/kernel [D, F]; layers_i/mlp/down/kernel [F, D]; norm/scale [D];
  lm_head [D, V] when embeddings are untied.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import cpu_kernels as few_rows
from . import packed as packing
from .cache import KVCache, init_cache
from .config import ModelConfig
from .layers import DecoderLayer, RMSNorm, causal_mask, split_masks

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
    few_row_kernels: bool = False  # few-row matmul kernels for XLA:CPU (eagle2_jax.cpu_kernels)
    packed: bool = False  # params loaded packed (eagle2_jax.packed): GGUF blocks read by the kernels

    def setup(self):
        c = self.config
        init = nn.initializers.normal(0.02)
        if self.packed:  # loaded, never initialised; a dict leaf (no shape check)
            self.embed = self.variable("params", "embed").value
        else:
            self.embed = self.param("embed", init, (c.vocab_size, c.hidden_size), self.dtype)
        self.layers = [DecoderLayer(c, self.dtype, few_row_kernels=self.few_row_kernels,
                                    packed=self.packed, name=f"layers_{i}")
                       for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = self.param("lm_head", init, (c.hidden_size, c.vocab_size), self.dtype)

    def embed_tokens(self, tokens_BT):
        return packing.embed_rows(self.embed, tokens_BT)

    def logits(self, features_BTD):
        """LM head, accumulated and returned in float32."""
        if self.packed:  # tied (load_gguf packs only tied embeddings)
            lead = features_BTD.shape[:-1]
            y = packing.matmul_nt(features_BTD.reshape(-1, features_BTD.shape[-1]), self.embed)
            return y.reshape(lead + (y.shape[-1],))
        if self.few_row_kernels:
            last = features_BTD.ndim - 1
            w, dims = (self.embed, (1,)) if self.config.tie_word_embeddings else (self.lm_head, (0,))
            return few_rows.dot_general(features_BTD, w, (((last,), dims), ((), ())),
                                        preferred_element_type=jnp.float32)
        if self.config.tie_word_embeddings:
            return jnp.einsum("...d,vd->...v", features_BTD, self.embed,
                              preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", features_BTD, self.lm_head,
                          preferred_element_type=jnp.float32)

    def __call__(self, tokens_BT, positions_BT, cache: KVCache, local_mask_BTU, offset: int = 0):
        """Forward over T new tokens written at cache slots length+offset .. +T-1.

        local_mask[b, t, u] lets token t see scratch slot length+u (itself included); committed
        slots are always visible. Returns (features [B,T,D] after the final norm, cache with the
        new keys/values written; its length is unchanged).
        """
        x = self.embed_tokens(tokens_BT)
        masks = split_masks(cache.length, local_mask_BTU, offset, cache.max_len)
        write_at = cache.length + offset
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            x, (k, v) = layer(x, positions_BT, cache.k[i], cache.v[i], write_at, masks)
            ks.append(k)
            vs.append(v)
        return self.norm(x), cache.replace(k=tuple(ks), v=tuple(vs))

    def init_all(self, tokens_BT):
        B, T = tokens_BT.shape
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        c = self.config
        cache = init_cache(c.num_hidden_layers, B, T, c.num_key_value_heads, c.head_dim, self.dtype)
        f, _ = self(tokens_BT, pos, cache, causal_mask(B, T))
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
        return Llama(self.config, self.dtype, few_rows.use_for(self.params), packing.any_packed(self.params))

    @property
    def num_params(self) -> int:
        return packing.logical_size(self.params)


@functools.partial(jax.jit, static_argnums=0)
def _init_params(module: Llama, key):
    """Random parameters; compiled once per module (modules compare by configuration and dtype)."""
    return module.init(key, jnp.zeros((1, 2), jnp.int32), method=Llama.init_all)["params"]


def init_target(config: ModelConfig, seed: int = 0, dtype="float32", mesh=None) -> Target:
    """A randomly initialised target (for tests and timing)."""
    from .sharding import shard_params
    dt = resolve_dtype(dtype)
    module = Llama(config, dt)
    params = _init_params(module, jax.random.PRNGKey(seed))
    params = shard_params(params, mesh)
    return Target(config, params, None, dt, mesh)


def target_apply(module: Llama, params, tokens_BT, positions_BT, cache, local_mask_BTU, offset: int = 0):
    return module.apply({"params": params}, tokens_BT, positions_BT, cache, local_mask_BTU, offset)


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
    c = module.config
    cache = init_cache(c.num_hidden_layers, B, T, c.num_key_value_heads, c.head_dim, module.dtype)
    f, _ = target_apply(module, params, ids, pos, cache, causal_mask(B, T))
    return target_logits(module, params, f)


_forward_jit = jax.jit(_forward, static_argnums=0)
