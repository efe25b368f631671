"""The head a run starts from (a fresh one, or the `init_from` head) and the draft vocabulary its loss
ranks."""
from __future__ import annotations

import dataclasses
import sys

import jax.numpy as jnp
import numpy as np

from eagle2_jax import CheckpointError, init_draft, load_draft
from eagle2_jax.models.draft import check_aux_layers
from train.config import TrainConfig
from train.head_vocab import eagle3_head_from_target, eagle3_own_vocab, grow_eagle3_vocab, is_count, resolve_vocab


def aux_layers_of(cfg: TrainConfig, target_config) -> tuple | None:
    """cfg.aux_layers ("2,15,29" or a list) as a checked tuple; None where not set."""
    raw = cfg.aux_layers
    if raw is None:
        return None
    if cfg.arch != "eagle3":
        sys.exit("error: --aux-layers is for an EAGLE-3 head (--arch eagle3)")
    try:
        aux = tuple(int(x) for x in (raw.split(",") if isinstance(raw, str) else raw))
        check_aux_layers(aux, target_config)
    except ValueError as e:
        sys.exit(f"error: --aux-layers {raw}: {e}")
    return aux


def start_head(cfg: TrainConfig, target, train, aux) -> tuple:
    """(head, draft vocabulary ids or None): the `init_from` head re-pointed to the target layers `aux`
    (if given), else a fresh one of `cfg.arch` (an EAGLE-3 one over the vocabulary, reading `aux`)."""
    init = _load_init(cfg, target, aux) if cfg.init_from else None
    init, vocab = _vocabulary(cfg, init, target, train)
    if cfg.vocab_mask and vocab is None:
        sys.exit("error: --vocab-mask needs a draft vocabulary (--draft-vocab)")
    if init is not None:
        return init, vocab
    if cfg.arch != "eagle3":
        return init_draft(target, cfg.seed), vocab
    draft = init_draft(target, cfg.seed, arch="eagle3", draft_vocab_size=len(vocab), aux_layers=aux)
    draft.params = {**draft.params, "d2t": jnp.asarray(vocab - np.arange(len(vocab)), jnp.int32)}
    if cfg.eagle3_head_init == "target":  # start from the target's own head over the draft vocabulary
        draft.params = {**draft.params, **eagle3_head_from_target(target, vocab, draft.params)}
    return draft, vocab


def _load_init(cfg: TrainConfig, target, aux):
    try:
        init = load_draft(cfg.init_from, target, draft_vocab=False)  # (an EAGLE-2 head's subset: draft_vocab)
    except (CheckpointError, ValueError) as e:
        sys.exit(f"error: --init-from {cfg.init_from}: {e}")
    if init.arch != cfg.arch:
        sys.exit(f"error: --init-from {cfg.init_from} is an {init.arch} head, not {cfg.arch}")
    if aux is not None and tuple(init.aux_layers) != aux:
        print(f"the head read target layers {tuple(init.aux_layers)}; it now reads {aux}")
        init = dataclasses.replace(init, aux_layers=aux)
    return init


def _vocabulary(cfg: TrainConfig, init, target, train) -> tuple:
    """(the head to continue from, grown where asked, or None; the vocabulary ids or None)."""
    if init is not None and init.arch == "eagle3":
        vocab = eagle3_own_vocab(init, cfg, train)
        if is_count(cfg.draft_vocab) and int(cfg.draft_vocab) > len(vocab):
            before = len(vocab)
            init, vocab = grow_eagle3_vocab(init, target, train, int(cfg.draft_vocab))
            print(f"draft vocabulary grown from {before} to {len(vocab)} tokens (new LM-head columns: the target's, mapped)")
        return init, vocab
    vocab = resolve_vocab(cfg.draft_vocab, train, cfg.out)
    if cfg.arch == "eagle3":  # the head's LM head rows in ascending token order; d2t maps to them
        vocab = np.sort(vocab) if vocab is not None else np.arange(target.config.vocab_size)
    return init, vocab
