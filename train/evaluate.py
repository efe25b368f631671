"""Held-out evaluation of a draft head during training: top-1 accuracy (and deeper into its own
rollout) on the held-out examples, and tau of tree generation with it."""
from __future__ import annotations

import time

import numpy as np

from eagle2_jax import TreeConfig, generate
from eagle2_jax.models.draft import with_draft_vocab
from train.batches import Batcher
from train.config import TrainConfig


def eval_tau(target, draft, examples, cfg: TrainConfig, vocab=None):
    """Mean tokens per round generating the first `eval_tau_prompts` prompts of `examples` with the
    `tree` of the config; None when there are none."""
    if vocab is not None and draft.arch != "eagle3":  # an EAGLE-3 head carries its vocabulary (d2t)
        draft = with_draft_vocab(draft, target, vocab)
    prompts = [t[:int(np.argmax(m))].tolist() for t, m in examples[:cfg.eval_tau_prompts] if m.any()]
    if not prompts:
        return None
    out = generate(target, draft, prompts, max_new_tokens=cfg.eval_tau_tokens, tree=TreeConfig(**cfg.tree),
                   eos_token_id=target.config.eos_token_id)
    return out.tau


def heldout_record(step: int, eval_fn, params, head, target, heldout, held: Batcher, cfg: TrainConfig,
                   vocab, vocab_dev) -> dict:
    """The log record of an evaluation at `step`: `eval_fn` (train.step.build_step's) over the held-out
    batches of `held` with the trained `params`, and tau of the whole `head` on the `heldout` examples."""
    em = [eval_fn(params, target.params, *held.batch(i), vocab_dev) for i in range(max(1, len(heldout) // held.B))]
    acc = float(np.mean([float(e["acc"]) for e in em]))
    deeper = {f"eval_{k}": float(np.mean([float(e[k]) for e in em])) for k in em[0] if k.startswith("acc_")}
    tau = eval_tau(target, head, heldout, cfg, vocab)
    return dict(step=step, eval_acc=acc, **deeper, eval_tau=tau, time=time.time())
