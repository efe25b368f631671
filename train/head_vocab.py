"""The draft vocabulary a run's loss ranks (a token count, a draft_vocab.json, or an EAGLE-3 head's own)
and the surgery on a head's LM head that goes with it: growing an EAGLE-3 head's vocabulary, starting
one from the target's head."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax.numpy as jnp
import numpy as np

from train.vocab import frequent_tokens, ranked_tokens


def is_count(spec) -> bool:
    """Whether a `draft_vocab` setting is a token count (else a draft_vocab.json path, or unset)."""
    return isinstance(spec, int) or str(spec).isdigit()


def resolve_vocab(spec, train, out_dir):
    """None, a token count (the most frequent assistant tokens of `train`) or a json path -> ids."""
    if spec is None or spec == "" or spec == 0:
        return None
    if is_count(spec):
        ids = frequent_tokens(train, int(spec), always=(0, 1, 2))
        with open(os.path.join(out_dir, "draft_vocab.json"), "w") as f:
            json.dump({"ids": ids.tolist(), "size": int(spec)}, f)
        return ids
    if not os.path.exists(str(spec)):
        sys.exit(f"error: draft_vocab file not found: {spec}")
    with open(spec) as f:
        return np.asarray(json.load(f)["ids"], np.int64)


def eagle3_own_vocab(init, cfg, train):
    """The draft vocabulary of an EAGLE-3 head to continue from: its LM head's row i ranks token
    i + d2t[i], and the loss must rank the same tokens in that order. A `draft_vocab` count (which
    would build another vocabulary from the data) is ignored; a draft_vocab.json must hold its tokens."""
    own = np.asarray(init.params["d2t"]) + np.arange(len(init.params["d2t"]))
    spec = cfg.draft_vocab
    if spec and not is_count(spec):
        given = resolve_vocab(spec, train, cfg.out)
        if not np.array_equal(np.unique(given), np.unique(own)):
            sys.exit(f"error: --init-from {cfg.init_from} ranks {len(own)} draft tokens that differ from "
                     f"{spec} ({len(given)} tokens): leave --draft-vocab out to keep the head's own")
    return own


def grow_eagle3_vocab(init, target, train, size: int):
    """(head, vocabulary): an EAGLE-3 head to continue from with its draft vocabulary grown to `size`
    tokens, its own plus the most frequent assistant tokens of `train` it lacks (ascending ids, d2t
    rebuilt). A kept token keeps its trained LM-head column. A new one gets the target's LM-head
    column for it mapped by the linear map, fitted by least squares over the kept tokens, that takes
    the target's columns to the head's (training moved the head's output space: the target's columns
    as they are, even rescaled, outscore the trained ones and the head proposes only new tokens,
    tau 1.0 on SmolLM2; zero columns, 1.55; mapped, 2.53 against 2.58 before growing, untrained).
    The rest of the head is unchanged."""
    d2t = np.asarray(init.params["d2t"])
    own = d2t + np.arange(len(d2t))
    have = set(own.tolist())
    new = np.asarray([t for t in ranked_tokens(train).tolist() if t not in have][:size - len(own)], np.int64)
    vocab = np.sort(np.concatenate([own, new]))
    w = np.asarray(target_lm_head(target), np.float32)  # [D, V]
    head = np.asarray(init.params["lm_head"], np.float32)  # [D, Vd], column i ranks own[i]
    m_DD = np.linalg.lstsq(w[:, own].T, head.T, rcond=None)[0]  # head.T ~ w[:, own].T @ m_DD
    column = {int(t): i for i, t in enumerate(own)}
    lm = np.stack([head[:, column[t]] if t in column else m_DD.T @ w[:, t] for t in vocab.tolist()], axis=1)
    params = {**init.params, "lm_head": jnp.asarray(lm, init.params["lm_head"].dtype),
              "d2t": jnp.asarray(vocab - np.arange(len(vocab)), jnp.int32)}
    return dataclasses.replace(init, params=params, draft_vocab_size=len(vocab)), vocab


def target_lm_head(target):
    """The target's LM head as [D, V] (the embedding's transpose when tied)."""
    tp = target.params
    return target.ops.weight(tp["embed"]).T if target.config.tie_word_embeddings else target.ops.weight(tp["lm_head"])


def eagle3_head_from_target(target, vocab, params) -> dict:
    """An EAGLE-3 head's final norm and LM head [D, Vd] copied from the target's (final norm, LM head
    columns of the draft vocabulary, ascending ids): the head starts out ranking tokens the way the
    target would from a feature like its own last one, instead of from random rows."""
    tp = target.params
    lm = jnp.take(jnp.asarray(target_lm_head(target)), jnp.asarray(vocab), axis=1).astype(params["lm_head"].dtype)
    # a copy: training donates the head's params, which must not free the target's buffer
    scale = jnp.array(target.ops.weight(tp["norm"]["scale"]), params["norm"]["scale"].dtype, copy=True)
    return {"lm_head": lm, "norm": {"scale": scale}}
