"""The EAGLE draft loss: smooth-L1 feature regression + soft cross-entropy through the frozen LM head.

Alignment (draft position j): input (embed(t_{j+1}), f_j) -> prediction of f_{j+1}, whose LM-head
distribution is the target's distribution of t_{j+2}. Position j counts when t_{j+1} is an
assistant token (mask[j+1]) and j+1 < T.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle2_jax.cache import init_cache
from eagle2_jax.draft import draft_apply
from eagle2_jax.layers import causal_mask
from eagle2_jax.model import target_apply, target_embed, target_logits


def target_features(tmodule, tparams, ids_BT):
    B, T = ids_BT.shape
    c = tmodule.config
    cache = init_cache(c.num_hidden_layers, B, T, c.num_key_value_heads, c.head_dim, tmodule.dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    f, _ = target_apply(tmodule, tparams, ids_BT, pos, cache, causal_mask(B, T))
    return jax.lax.stop_gradient(f)


def smooth_l1(x, y):
    d = jnp.abs(x - y)
    return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5)


def vocab_head(tmodule, tparams, ids_V):
    """The target's LM head restricted to the token ids `ids_V`: [D, V'] (frozen)."""
    head = tparams["embed"].T if tmodule.config.tie_word_embeddings else tparams["lm_head"]
    return jax.lax.stop_gradient(jnp.take(head, ids_V, axis=1))


def draft_loss(dparams, dmodule, tmodule, tparams, ids_BT, mask_BT, feats_BTD, noise_key, noise: float,
               v_weight: float, p_weight: float, head_DV=None):
    """Returns (loss, metrics). Gradients flow into dparams only.

    With `head_DV` (a `vocab_head` over the draft's vocabulary) the cross-entropy and accuracy
    are taken over those tokens only, as the draft ranks them at inference; the target's
    distribution is renormalised over them. Otherwise over the full vocabulary.
    """
    B, T = ids_BT.shape
    c = dmodule.config
    feats_BTD = feats_BTD.astype(jnp.float32)  # a disk cache keeps them in float16
    f_in = feats_BTD
    if noise > 0:
        f_in = f_in + jax.random.uniform(noise_key, f_in.shape, f_in.dtype, -noise, noise)
    next_tok = jnp.concatenate([ids_BT[:, 1:], jnp.zeros((B, 1), ids_BT.dtype)], axis=1)
    emb = jax.lax.stop_gradient(target_embed(tmodule, tparams, next_tok))
    cache = init_cache(1, B, T, c.num_key_value_heads, c.head_dim, dmodule.dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    pred, _ = draft_apply(dmodule, dparams, emb, f_in, pos, cache, causal_mask(B, T))
    pred, tgt = pred[:, :-1], feats_BTD[:, 1:]
    w = mask_BT[:, 1:].astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    vloss = (smooth_l1(pred.astype(jnp.float32), tgt.astype(jnp.float32)).mean(-1) * w).sum() / n
    if head_DV is None:
        head = lambda x: target_logits(tmodule, tparams, x)  # noqa: E731
    else:
        head = lambda x: jnp.einsum("...d,dv->...v", x, head_DV.astype(x.dtype),  # noqa: E731
                                    preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(head(pred), axis=-1)
    t_logits = jax.lax.stop_gradient(head(tgt.astype(pred.dtype)))
    t_p = jax.nn.softmax(t_logits, axis=-1)
    ploss = (-(t_p * logp).sum(-1) * w).sum() / n
    acc = ((jnp.argmax(logp, -1) == jnp.argmax(t_logits, -1)) * w).sum() / n
    loss = v_weight * vloss + p_weight * ploss
    return loss, {"loss": loss, "vloss": vloss, "ploss": ploss, "acc": acc, "tokens": w.sum()}
