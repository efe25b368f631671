"""The optimiser and the jitted train step and held-out evaluation of a draft head."""
from __future__ import annotations

import jax
import optax

from train.config import TrainConfig
from train.loss import draft_loss, target_features, vocab_head


def make_optimizer(cfg: TrainConfig):
    """Gradient clipping and AdamW at learning rate 1: the train step scales the update by the
    step's learning rate (train.schedule.learning_rate), a traced value, so the schedule can be fixed
    after the run has started (steps auto) without a recompile."""
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(1.0, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))


def build_step(tmodule, dmodule, opt, cfg: TrainConfig, fixed=None):
    """Jitted (train step, eval). Both take a Batcher batch (ids, mask, segment ids, positions); the
    train step also features [B, T, F] (from the cache) or None (computed inside by the target over
    the packed batch: a piece of an example past its first sees none of the example's earlier
    tokens, where the cache computed the whole example), and the draft-vocabulary ids or None. `fixed`: params
    that are not trained (an EAGLE-3 head's integer d2t map), joined to the trained ones in the loss."""
    aux = tuple(dmodule.aux_layers)

    fixed = fixed or {}
    loss_fn = lambda dparams, *a: draft_loss({**dparams, **fixed}, *a)  # noqa: E731

    def step(dparams, opt_state, lr, tparams, ids, mask, seg, pos, feats, vocab_ids, key):
        if feats is None:
            feats = target_features(tmodule, tparams, ids, aux, seg, pos)
        head = None if vocab_ids is None else vocab_head(tmodule, tparams, vocab_ids)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(dparams, dmodule, tmodule, tparams, ids, mask, feats, key, cfg.noise,
                                      cfg.v_weight, cfg.p_weight, head, cfg.rollout, cfg.rollout_decay,
                                      vocab_ids if cfg.vocab_mask else None, seg, pos)
        updates, opt_state = opt.update(grads, opt_state, dparams)
        updates = jax.tree_util.tree_map(lambda u: (lr * u).astype(u.dtype), updates)
        return optax.apply_updates(dparams, updates), opt_state, metrics

    def evaluate(dparams, tparams, ids, mask, seg, pos, vocab_ids):
        feats = target_features(tmodule, tparams, ids, aux, seg, pos)
        head = None if vocab_ids is None else vocab_head(tmodule, tparams, vocab_ids)
        _, metrics = loss_fn(dparams, dmodule, tmodule, tparams, ids, mask, feats, None, 0.0,
                             cfg.v_weight, cfg.p_weight, head, cfg.rollout, cfg.rollout_decay,
                             vocab_ids if cfg.vocab_mask else None, seg, pos)
        return metrics

    return jax.jit(step, donate_argnums=(0, 1)), jax.jit(evaluate)
