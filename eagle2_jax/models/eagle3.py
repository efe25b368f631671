"""The EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840) on EAGLE-2's dynamic tree.

What differs from the EAGLE-1/2 head (eagle2_jax.models.draft); the tree, verification and acceptance do
not change, so outputs stay lossless:
- Input features: the target's hidden states entering three of its layers (low, middle, high:
  `aux_layers`, by default (2, L // 2, L - 3) as the published heads), concatenated ([3D], in that
  order) and fused by `fc` (3D -> D, no bias). While the tree is drafted, a node's input is its
  parent's draft output ([D]: no fc).
- One decoder layer whose attention reads concat(input_norm(token embedding), hidden_norm(h)) (2D
  wide); the residual stream is h; post-attention norm and MLP as in Llama.
- Its own final norm and LM head over a draft vocabulary of Vd tokens; `d2t` maps draft index i to
  target token i + d2t[i].

Params: fc/kernel [3D, D]; layers_0/{input_norm,hidden_norm,post_norm}/scale [D];
layers_0/attn/{q,k,v}/kernel [2D, H|K, Dh]; layers_0/attn/o/kernel [H, Dh, D]; layers_0/mlp/...;
norm/scale [D]; lm_head [D, Vd]; d2t [Vd] int32. The target's embedding is shared.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .cache import KVCache
from ..config import ModelConfig
from .layers import attention, dense, init_dense, init_layer, mlp, rms_norm, rope_tables
from .target import module_param, one_layer_forward
from .ops import XLA, Ops
from .layers import top_log_probs


def default_aux_layers(num_target_layers: int) -> tuple:
    """The published heads' feature layers (2, L // 2, L - 3), kept inside a shallow target."""
    L = num_target_layers
    return (min(2, L - 1), L // 2, max(L - 3, 0))


def eagle3_layer(ops: Ops, c: ModelConfig, p, embeds_BTD, h_BTD, positions_BT, attend):
    """Returns (h [B,T,D], the state `attend` returns; see layers.attention)."""
    eps = c.rms_norm_eps
    x = jnp.concatenate([rms_norm(ops, p["input_norm"], embeds_BTD, eps), rms_norm(ops, p["hidden_norm"], h_BTD, eps)],
                        axis=-1)
    a, kv = attention(ops, p["attn"], x, rope_tables(c, positions_BT), attend, eps)
    h = h_BTD + a
    return h + mlp(ops, p["mlp"], rms_norm(ops, p["post_norm"], h, eps)), kv


def init_eagle3_layer(key, c: ModelConfig, dtype) -> dict:
    D, H, K, Dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    p = init_layer(key, c, dtype, input_norm=True)
    ks = jax.random.split(jax.random.fold_in(key, 1), 3)
    p["attn"]["q"] = init_dense(ks[0], (2 * D,), (H, Dh), c.attention_bias, dtype)
    p["attn"]["k"] = init_dense(ks[1], (2 * D,), (K, Dh), c.attention_bias, dtype)
    p["attn"]["v"] = init_dense(ks[2], (2 * D,), (K, Dh), c.attention_bias, dtype)
    p["hidden_norm"] = {"scale": jnp.ones((D,), dtype)}
    return p


class Eagle3Draft(nn.Module):
    config: ModelConfig  # the head's own (num_hidden_layers 1; vocab_size = the target's)
    draft_vocab_size: int
    aux_layers: tuple  # target layers whose input hidden states feed fc
    dtype: Any = jnp.float32
    ops: Ops = XLA

    def setup(self):
        c, dt, D = self.config, self.dtype, self.config.hidden_size
        self.fc = module_param(self, "fc", lambda key: init_dense(key, (3 * D,), (D,), False, dt))
        self.layer = module_param(self, "layers_0", lambda key: init_eagle3_layer(key, c, dt))
        self.norm = module_param(self, "norm", lambda key: {"scale": jnp.ones((D,), dt)})
        self.lm_head = module_param(self, "lm_head", nn.initializers.normal(0.02), (D, self.draft_vocab_size), dt)
        self.d2t = module_param(self, "d2t", lambda key: jnp.zeros((self.draft_vocab_size,), jnp.int32))

    def __call__(self, embeds_BTD, features_BTF, positions_BT, cache: KVCache, local_mask_BTU, offset: int = 0,
                 fresh: bool = False):
        """features: the target's three-layer features [B,T,3D] (through fc) or the parent's draft
        output [B,T,D]. Returns (h [B,T,D], the cache with the new keys/values written)."""
        h = features_BTF.astype(self.dtype)
        if h.shape[-1] != self.config.hidden_size:
            h = dense(self.ops, self.fc, h)
        e = embeds_BTD.astype(self.dtype)
        return one_layer_forward(self.ops, cache, local_mask_BTU, offset, fresh,
                                 lambda attend: eagle3_layer(self.ops, self.config, self.layer, e, h, positions_BT, attend))

    def logits(self, h):
        """float32 logits [..., Vd] over the draft vocabulary (index i is target token i + d2t[i])."""
        x = rms_norm(self.ops, self.norm, h, self.config.rms_norm_eps)
        return self.ops.vocab_logits(x, {"w": self.lm_head})

    def topk(self, h, k: int):
        """The k best next target tokens and their log-probs (over the draft vocabulary)."""
        score, idx = top_log_probs(self.logits(h), k)
        return score, (idx + jnp.take(self.d2t, idx)).astype(jnp.int32)
