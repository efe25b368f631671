"""The target: a Llama-family decoder as a Flax module over an explicit param pytree.

Param tree (per-layer params stacked on a leading layer axis L, run with `lax.scan`, so compile
time and program size do not grow with depth):
  embed [V, D]; layers/{input_norm,post_norm}/scale [L, D];
  layers/attn/{q,k,v}/kernel [L, D, H|K, Dh] (+ bias [L, H|K, Dh]); layers/attn/o/kernel [L, H, Dh, D];
  layers/attn/{q,k}_norm/scale [L, Dh] (Qwen3, Gemma 3); layers/{attn_out_norm,mlp_out_norm}/scale [L, D]
  (Gemma 3's sandwich norms);
  layers/mlp/{gate,up}/kernel [L, D, F]; layers/mlp/down/kernel [L, F, D]; norm/scale [D];
  lm_head [D, V] when embeddings are untied.
Every product goes through the module's `ops` (eagle2_jax.models.ops), chosen when the target is loaded.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .cache import KVCache, init_cache, write
from ..config import ModelConfig
from .layers import (attend_beside, attend_within, cache_mask, causal_mask, decoder_layer, init_layers, rms_norm,
    rope_tables, split_masks, window_masks)
from ..platform import default_dtype
from .layer_list import per_layer
from .ops import XLA, Ops, choose
from ..sharding import param_shardings, shard_params

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def cache_view(cache: KVCache, local_mask_BTU, offset: int, fresh: bool):
    """(keys, values, masks) a two-block forward (`attend_beside`) attends over: the whole cache, or
    with `fresh` (nothing committed, nothing written yet) no slot at all (S = 0), so a prefill
    computes no scores over empty slots."""
    S = 0 if fresh else cache.max_len
    return cache.k[..., :S, :], cache.v[..., :S, :], split_masks(cache.length, local_mask_BTU, offset, S)


def writes_first(ops: Ops, T: int, fresh: bool, static_layers: bool = True) -> bool:
    """Whether a forward over T new tokens writes their keys/values into the cache before attending
    over it (`attend_within`): on the ops that take one block, for T > 1, where each layer's cache
    is a static slice (`static_layers`: a one-layer draft, or the layer loop unrolled, as over the
    per-layer weight buffers used on GPU). A single token's own key is one score that XLA folds into
    the softmax's reductions, so a decode step keeps the two-block form and writes all layers after
    the loop (fewer kernels a layer), while tree verification writes first (fewer again). In a scan
    over stacked layers (TPU, CPU) the layer's cache would be cut out of a cache carried through the
    loop by a dynamic slice, a copy of the whole layer cache every layer; there the scan reads the
    cache in place as its input instead. A prefill into an empty cache attends over its own tokens
    alone. (Kernel counts of each form: docs/performance.md.)"""
    return ops.cache_first and T > 1 and not fresh and static_layers


def one_layer_forward(ops: Ops, cache: KVCache, local_mask_BTU, offset: int, fresh: bool, run,
                      window: int | None = None, positions_BT=None):
    """A draft's one layer over its cache [1, B, K, S, Dh]: `run(attend)` -> (h, state) with the
    `attend` this forward uses; with `window` (a head for a sliding-window target) its keys more than
    window - 1 positions before a query are hidden, as in the target's local layers. Returns (h, the
    cache with the new keys/values written at length+offset)."""
    start_B = cache.length + offset
    windowed = (lambda m: window_masks(m, cache.length, positions_BT, offset, window)) if window else (lambda m: m)
    if writes_first(ops, local_mask_BTU.shape[1], fresh):
        (mask,) = windowed((cache_mask(cache.length, local_mask_BTU, cache.max_len),))
        h, (k, v) = run(attend_within(ops, cache.k, cache.v, 0, start_B, mask))
        return h, cache.replace(k=k, v=v)
    k_read, v_read, masks = cache_view(cache, local_mask_BTU, offset, fresh)
    masks = windowed(masks)
    h, (k, v) = run(attend_beside(ops, k_read[0], v_read[0], masks))
    # written once the attention has read the cache: left unordered, XLA's GPU compiler copies
    # both caches to update them in place (2 copies a draft pass)
    h, k, v = jax.lax.optimization_barrier((h, k, v))
    return h, write(cache, k[None], v[None], start_B)


def resolve_dtype(dtype) -> Any:
    """A dtype from a name; None or "auto": the backend's default (eagle2_jax.decoding.defaults)."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        dtype = default_dtype()
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES) + ['auto']}, got {dtype!r}")
        return DTYPES[dtype]
    return dtype


def module_param(module: nn.Module, name: str, init, *args):
    """`module.param(name, init, *args)` while initialising; otherwise the loaded value as it is
    (a backend may keep a leaf in its own form, e.g. GGUF blocks, which Flax's shape check would refuse)."""
    if module.is_initializing():
        return module.param(name, init, *args)
    return module.get_variable("params", name)


class Llama(nn.Module):
    config: ModelConfig
    dtype: Any = jnp.float32
    ops: Ops = XLA

    def setup(self):
        c, dt = self.config, self.dtype
        normal = nn.initializers.normal(0.02)
        self.embed = module_param(self, "embed", normal, (c.vocab_size, c.hidden_size), dt)
        self.layers = module_param(self, "layers", lambda key: init_layers(key, c, dt))
        self.norm = module_param(self, "norm", lambda key: {"scale": jnp.ones((c.hidden_size,), dt)})
        if not c.tie_word_embeddings:
            self.lm_head = module_param(self, "lm_head", normal, (c.hidden_size, c.vocab_size), dt)

    def embed_tokens(self, tokens_BT):
        x = self.ops.embed(self.embed, tokens_BT)
        if self.config.embed_scale:  # Gemma: times sqrt(hidden), the factor rounded to the embedding's dtype
            x = x * jnp.asarray(np.sqrt(self.config.hidden_size), x.dtype)
        return x

    def logits(self, features_BTD):
        """LM head, accumulated and returned in float32."""
        tied = self.config.tie_word_embeddings
        return self.ops.lm_head(features_BTD, self.embed if tied else self.lm_head, tied)

    def __call__(self, tokens_BT, positions_BT, cache: KVCache, local_mask_BTU, offset: int = 0,
                 fresh: bool = False, aux_layers: tuple = ()):
        """Forward over T new tokens written at cache slots length+offset .. +T-1.

        local_mask[b, t, u] lets token t see scratch slot length+u (itself included); committed
        slots are always visible. With `fresh` (a prefill into an empty cache) attention reads no
        cache slot at all, only the new tokens. Returns (features [B,T,D] after the final norm,
        cache with the new keys/values written; its length is unchanged), and with `aux_layers`
        also the hidden states entering those layers, concatenated [B,T,A*D] (an EAGLE-3 head's
        input features; index num_hidden_layers: the stream leaving the last layer, before the norm).
        """
        c, ops = self.config, self.ops
        x0 = self.embed_tokens(tokens_BT)
        A = len(aux_layers)
        aux0 = jnp.zeros((A,) + x0.shape, x0.dtype)
        index_L = np.arange(c.num_hidden_layers, dtype=np.int32)  # static per layer where the loop is unrolled
        start_B = cache.length + offset
        rope = rope_tables(c, positions_BT)  # once, outside the layer loop (as are the masks)
        G = c.num_attention_heads // c.num_key_value_heads
        # sliding-window layers (Gemma 3): their own RoPE tables and masks, picked per layer by a flag
        # scanned with the weights (data, not a branch)
        local_L = np.asarray(c.local_layers)
        W = c.sliding_window
        rope_local = rope_tables(c, positions_BT, local=True) if c.windowed else None

        def per_layer(is_local, local, whole):
            if not c.windowed:
                return whole
            flag = ops.weight(is_local)  # a backend may hand scanned inputs over unsliced
            return jax.tree_util.tree_map(lambda a, b: jnp.where(flag, a, b), local, whole)

        def keep_aux(aux_ABTD, x_BTD, i):  # the stream entering the aux layers
            if not A:
                return aux_ABTD
            hit = jnp.asarray(aux_layers, jnp.int32) == ops.weight(i)
            return jnp.where(hit[:, None, None, None], x_BTD[None], aux_ABTD)

        unrolled = ops.unroll_layers or ops.layers == "list"
        if writes_first(ops, tokens_BT.shape[1], fresh, unrolled):  # each layer writes, then attends over its cache
            whole = (cache_mask(cache.length, local_mask_BTU, cache.max_len),)
            (mask_BTS,) = ops.loop_masks(whole, G)
            (mask_win,) = ops.loop_masks(window_masks(whole, cache.length, positions_BT, offset, W), G) \
                if c.windowed else (None,)

            def layer(carry, xs):
                (x_BTD, aux_ABTD, k_LBKSD, v_LBKSD), (p, i, is_local) = carry, xs
                aux_ABTD = keep_aux(aux_ABTD, x_BTD, i)
                attend = attend_within(ops, k_LBKSD, v_LBKSD, i, start_B, per_layer(is_local, mask_win, mask_BTS))
                x_BTD, (k_LBKSD, v_LBKSD) = decoder_layer(ops, c, p, x_BTD, per_layer(is_local, rope_local, rope),
                                                          attend)
                return (x_BTD, aux_ABTD, k_LBKSD, v_LBKSD), None

            (x, aux, k, v), _ = ops.scan_layers(layer, (x0, aux0, cache.k, cache.v), (self.layers, index_L, local_L))
            cache = cache.replace(k=k, v=v)
        else:  # the cache is read as it was; all layers' new entries are written after the loop
            k_read, v_read, whole = cache_view(cache, local_mask_BTU, offset, fresh)
            masks = ops.loop_masks(whole, G)
            masks_win = ops.loop_masks(window_masks(whole, cache.length, positions_BT, offset, W), G) \
                if c.windowed else None

            def layer(carry, xs):
                (x_BTD, aux_ABTD), (p, k_BKSD, v_BKSD, i, is_local) = carry, xs
                aux_ABTD = keep_aux(aux_ABTD, x_BTD, i)
                attend = attend_beside(ops, k_BKSD, v_BKSD, per_layer(is_local, masks_win, masks))
                x_BTD, kv = decoder_layer(ops, c, p, x_BTD, per_layer(is_local, rope_local, rope), attend)
                return (x_BTD, aux_ABTD), kv

            (x, aux), (k_LBKTD, v_LBKTD) = ops.scan_layers(layer, (x0, aux0),
                                                           (self.layers, k_read, v_read, index_L, local_L))
            cache = write(cache, k_LBKTD, v_LBKTD, start_B)
        feats = rms_norm(ops, self.norm, x, c.rms_norm_eps)
        if not A:
            return feats, cache
        if c.num_hidden_layers in aux_layers:  # index L: the stream leaving the last layer (before the norm)
            aux = keep_aux(aux, x, jnp.int32(c.num_hidden_layers))
        return feats, cache, jnp.concatenate(list(aux), axis=-1)

    def init_all(self, tokens_BT):
        B, T = tokens_BT.shape
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        c = self.config
        cache = init_cache(c.num_hidden_layers, B, T, c.num_key_value_heads, c.head_dim, self.dtype)
        f, _ = self(tokens_BT, pos, cache, causal_mask(B, T))
        return self.logits(f)


@dataclasses.dataclass
class Target:
    """A target model: config, param pytree, tokenizer (None for random models), optional mesh, and
    the ops its programs compute with (eagle2_jax.models.ops; chosen at load)."""

    config: ModelConfig
    params: Any
    tokenizer: Any = None
    dtype: Any = jnp.float32
    mesh: Any = None
    source: str = "random"
    ops: Ops = XLA

    @property
    def module(self) -> Llama:
        return Llama(self.config, self.dtype, self.ops)

    @property
    def abstract(self) -> bool:
        """Params are shapes only (jax.ShapeDtypeStruct): for compiling, not running."""
        return is_abstract(self.params)

    @property
    def num_params(self) -> int:
        total = 0
        for x in jax.tree_util.tree_leaves(self.params, is_leaf=lambda x: isinstance(x, dict) and "w" in x):
            total += x["w"].size if isinstance(x, dict) else x.size  # a backend's block leaf keeps "w"
        return total


def is_abstract(params) -> bool:
    """Whether a param tree holds shapes only (jax.ShapeDtypeStruct leaves)."""
    leaves = jax.tree_util.tree_leaves(params)
    return bool(leaves) and isinstance(leaves[0], jax.ShapeDtypeStruct)


def abstract_target_params(config: ModelConfig, dtype):
    module = Llama(config, dtype)
    return jax.eval_shape(lambda k: module.init(k, jnp.zeros((1, 2), jnp.int32), method=Llama.init_all),
                          jax.random.PRNGKey(0))["params"]


@functools.partial(jax.jit, static_argnums=0)
def _init_params(module: Llama, key):
    """Random parameters; compiled once per module (modules compare by configuration and dtype)."""
    return module.init(key, jnp.zeros((1, 2), jnp.int32), method=Llama.init_all)["params"]


def init_target(config: ModelConfig, seed: int = 0, dtype="auto", mesh=None, abstract: bool = False) -> Target:
    """A randomly initialised target (for tests and timing). With `abstract`, params are
    jax.ShapeDtypeStruct leaves (sharded like real ones): nothing is allocated, for compiling only.
    Its ops are the platform's, as a loaded target's (per-layer buffers where they say "list")."""
    dt = resolve_dtype(dtype)
    if abstract:
        params = abstract_target_params(config, dt)
        if mesh is not None:
            params = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                            params, param_shardings(params, mesh))
    else:
        params = shard_params(_init_params(Llama(config, dt), jax.random.PRNGKey(seed)), mesh)
    target = Target(config, params, None, dt, mesh, ops=choose(params, dt, mesh))
    return per_layer(target) if target.ops.layers == "list" else target


def target_apply(module: Llama, params, tokens_BT, positions_BT, cache, local_mask_BTU, offset: int = 0,
                 fresh: bool = False, aux_layers: tuple = ()):
    """(features, cache), or (features, cache, aux features) with `aux_layers` (see Llama.__call__)."""
    return module.apply({"params": params}, tokens_BT, positions_BT, cache, local_mask_BTU, offset, fresh, aux_layers)


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
    f, _ = target_apply(module, params, ids, pos, cache, causal_mask(B, T), fresh=True)
    return target_logits(module, params, f)


_forward_jit = jax.jit(_forward, static_argnums=0)
