"""The EAGLE draft loss: smooth-L1 feature regression + soft cross-entropy through the frozen LM head
(EAGLE-1/2 heads); for EAGLE-3 heads (eagle2_jax.models.eagle3) soft cross-entropy of the head's own
LM head over its draft vocabulary against the target's distribution renormalised over it.

Alignment (draft position j): input (embed(t_{j+1}), f_j) -> prediction of f_{j+1}, whose LM-head
distribution is the target's distribution of t_{j+2}. Position j counts when t_{j+1} is an
assistant token (mask[j+1]) and j+1 < T.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle2_jax.models.cache import init_cache
from eagle2_jax.models.draft import draft_apply
from eagle2_jax.models.eagle3 import Eagle3Draft
from eagle2_jax.models.layers import causal_mask
from eagle2_jax.models.target import target_apply, target_embed, target_logits


def segment_mask(seg_BT) -> jax.Array:
    """[B, T, T]: causal, and within one segment (a piece of one example in a packed sequence)."""
    B, T = seg_BT.shape
    return causal_mask(B, T) & (seg_BT[:, :, None] == seg_BT[:, None, :])


def target_features(tmodule, tparams, ids_BT, aux_layers: tuple = (), seg_BT=None, pos_BT=None):
    """The target's final-norm features [B, T, D]; with `aux_layers` (an EAGLE-3 head's) the hidden
    states entering those layers first: [B, T, A*D + D]. `seg_BT` / `pos_BT` (a packed batch): attend
    within a segment only, at those positions; default one sequence from position 0."""
    B, T = ids_BT.shape
    c = tmodule.config
    cache = init_cache(c.num_hidden_layers, B, T, c.num_key_value_heads, c.head_dim, tmodule.dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if pos_BT is None else pos_BT
    mask = causal_mask(B, T) if seg_BT is None else segment_mask(seg_BT)
    out = target_apply(tmodule, tparams, ids_BT, pos, cache, mask, fresh=True, aux_layers=aux_layers)
    f = jnp.concatenate([out[2], out[0]], axis=-1) if aux_layers else out[0]
    return jax.lax.stop_gradient(f)


def smooth_l1(x, y):
    d = jnp.abs(x - y)
    return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5)


def vocab_head(tmodule, tparams, ids_V):
    """The target's LM head restricted to the token ids `ids_V`: [D, V'] (frozen)."""
    # the LM head as a matrix (ops.weight: a backend's own form, e.g. GGUF blocks, as an array)
    head = tmodule.ops.weight(tparams["embed"]).T if tmodule.config.tie_word_embeddings else tparams["lm_head"]
    return jax.lax.stop_gradient(jnp.take(head, ids_V, axis=1))


def draft_loss(dparams, dmodule, tmodule, tparams, ids_BT, mask_BT, feats_BTD, noise_key, noise: float,
               v_weight: float, p_weight: float, head_DV=None, rollout: int = 1, rollout_decay: float = 0.8,
               mask_ids_V=None, seg_BT=None, pos_BT=None):
    """Returns (loss, metrics). Gradients flow into dparams only.

    With `head_DV` (a `vocab_head` over the draft's vocabulary) the cross-entropy and accuracy
    are taken over those tokens only, as the draft ranks them at inference; the target's
    distribution is renormalised over them. Otherwise over the full vocabulary.

    `rollout` > 1 also trains the head on its own outputs, as tree drafting uses it at depth
    2, 3, ...: step k (0-based) at anchor j reads token t_{j+k+1} with the head's step-(k-1)
    prediction as its feature (step 0 reads the target's feature f_j, with noise) and predicts
    f_{j+k+1}. It attends to the step-0 keys of anchors <= j (the accepted prefix at inference)
    and to its own earlier steps at anchor j (its branch of the tree); gradients flow through
    the chain. Step k's loss weighs rollout_decay**k. Metrics vloss/ploss/acc are step 0's,
    loss the weighted sum; acc_k (k >= 1) is step k's top-1 accuracy.

    `mask_ids_V` (the draft vocabulary's ids; the official EAGLE-3 recipe): positions whose next
    token under the target's full vocabulary (its argmax) is not among them are left out of the loss
    and the accuracy, instead of counting against the target renormalised over the draft tokens.
    Metric `in_vocab`: the share of step 0's positions kept.

    `seg_BT` / `pos_BT` (a packed batch, see train.batches.Batcher): the head attends within a
    segment only, at those positions, and position j counts at step k only when t_{j+k+1} is in
    j's segment. Default: one sequence from position 0.
    """
    B, T = ids_BT.shape
    R = int(rollout)
    if R < 1 or R >= T:
        raise ValueError(f"rollout must be in [1, seq_len); got {rollout} with seq_len {T}")
    feats_BTD = feats_BTD.astype(jnp.float32)  # a disk cache keeps them in float16
    eagle3 = bool(dmodule.aux_layers)
    if eagle3:  # [aux (A*D) | final (D)]: the head reads the aux features, the target's distribution the final
        D = tmodule.config.hidden_size
        f_in, feats_BTD = feats_BTD[..., :-D], feats_BTD[..., -D:]
    else:
        f_in = feats_BTD
        if noise > 0:
            f_in = f_in + jax.random.uniform(noise_key, f_in.shape, f_in.dtype, -noise, noise)
    if head_DV is None:
        head = lambda x: target_logits(tmodule, tparams, x)  # noqa: E731
    else:
        head = lambda x: jnp.einsum("...d,dv->...v", x, head_DV.astype(x.dtype),  # noqa: E731
                                    preferred_element_type=jnp.float32)
    tgt = feats_BTD[:, 1:]  # [B, T-1, D]: f_{j+1}
    t_logits = jax.lax.stop_gradient(head(tgt.astype(dmodule.dtype)))  # the target's next-token logits
    t_p = jax.nn.softmax(t_logits, axis=-1)
    t_top = jnp.argmax(t_logits, -1)
    keep = None  # [B, T-1]: the target's full-vocabulary argmax is a draft token
    if mask_ids_V is not None:
        full_top = jnp.argmax(target_logits(tmodule, tparams, tgt.astype(dmodule.dtype)), -1)
        in_vocab = jnp.zeros(tmodule.config.vocab_size, bool).at[mask_ids_V].set(True)
        keep = jax.lax.stop_gradient(in_vocab[full_top])
    embed = lambda ids: jax.lax.stop_gradient(target_embed(tmodule, tparams, ids))  # noqa: E731
    if eagle3:
        net = {k: v for k, v in dparams.items() if k != "vocab_head"}
        own_logits = lambda h: dmodule.apply({"params": net}, h, method=Eagle3Draft.logits)  # noqa: E731
    loss, metrics = 0.0, {}
    if seg_BT is None:
        seg_BT = jnp.ones((B, T), jnp.int32)
    for k, pred in enumerate(draft_rollout(dparams, dmodule, embed, ids_BT, f_in, R, seg_BT, pos_BT)):
        n_valid = T - 1 - k  # anchors j with j+k+1 < T
        p = pred[:, :n_valid]
        w = (mask_BT[:, k + 1:] * (seg_BT[:, k + 1:] == seg_BT[:, :n_valid])).astype(jnp.float32)
        if keep is not None:
            w = w * keep[:, k:]
        n = jnp.maximum(w.sum(), 1.0)
        if eagle3:  # no feature to regress to: token-level cross-entropy over its own draft vocabulary
            vloss = jnp.float32(0.0)
            logp = jax.nn.log_softmax(own_logits(p), axis=-1)
        else:
            vloss = (smooth_l1(p.astype(jnp.float32), tgt[:, k:]).mean(-1) * w).sum() / n
            logp = jax.nn.log_softmax(head(p), axis=-1)
        ploss = (-(t_p[:, k:] * logp).sum(-1) * w).sum() / n
        acc = ((jnp.argmax(logp, -1) == t_top[:, k:]) * w).sum() / n
        step_loss = ploss if eagle3 else v_weight * vloss + p_weight * ploss  # EAGLE-3: the cross-entropy alone
        loss = loss + (rollout_decay ** k) * step_loss
        if k == 0:
            metrics.update(vloss=vloss, ploss=ploss, acc=acc, tokens=w.sum())
            if keep is not None:
                metrics["in_vocab"] = w.sum() / jnp.maximum(mask_BT[:, 1:].astype(jnp.float32).sum(), 1.0)
        else:
            metrics[f"acc_{k}"] = acc
    metrics["loss"] = loss
    return loss, metrics


def draft_rollout(dparams, dmodule, embed, ids_BT, feats_BTD, steps: int, seg_BT=None, pos_BT=None):
    """The head's predictions over `steps` rollout steps: a list of [B, T, D].

    Step k at anchor j reads (embed(t_{j+k+1}), x) at position j+k, x = feats[j] for k = 0 and
    step k-1's output at j otherwise, and attends to the step-0 keys of anchors <= j and to steps
    1..k at anchor j: what the draft computes at depth k+1 of a tree branch grown after accepting
    t_{j+1} (tokens past the end read id 0 and are never scored). With `seg_BT` / `pos_BT` (a packed
    batch) the step-0 keys are those of anchors <= j in j's segment, at j's position in its example.
    """
    B, T = ids_BT.shape
    c = dmodule.config
    cache = init_cache(1, B, steps * T, c.num_key_value_heads, c.head_dim, dmodule.dtype)
    eye = jnp.broadcast_to(jnp.eye(T, dtype=bool), (B, T, T))
    prefix = causal_mask(B, T) if seg_BT is None else segment_mask(seg_BT)
    pos0 = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if pos_BT is None else pos_BT
    preds, x = [], feats_BTD
    for k in range(steps):
        ids = jnp.concatenate([ids_BT[:, k + 1:], jnp.zeros((B, k + 1), ids_BT.dtype)], axis=1)
        pos = pos0 + k
        local = jnp.concatenate([prefix] + [eye] * k, axis=2)  # [B, T, (k+1) T]
        x, cache = draft_apply(dmodule, dparams, embed(ids), x, pos, cache, local, offset=k * T)
        preds.append(x)
    return preds
