"""The EAGLE-2 round's phases as standalone jitted programs, for the tools that time them
(infer.roundcost) or read their compiled cost (infer.analytic). Each wraps the function the decode
loop runs (eagle2_jax.decoding.eagle) as it is; each donates what it updates in place, as the loop does (JAX
warns, harmlessly, about the state's scalars a phase leaves alone)."""
from __future__ import annotations

import jax

from eagle2_jax.decoding import eagle


def _draft(tp, dp, st, *, tm, dm, tree):
    return eagle.draft_tree(tm, tp, dm, dp, st, tree)


def _verify(tp, st, t, *, tm, dm):
    return eagle.verify_tree(tm, tp, dm, st, t)


def _accept(tp, dp, st, t, v, dcache, sampling, *, tm, dm, tree):
    return eagle.accept_and_commit(tm, tp, dm, dp, st, t, v, dcache, sampling, tree.max_accept)


def _round(tp, dp, st, sampling, *, tm, dm, tree):
    return eagle.eagle_round(tm, tp, dm, dp, st, sampling, tree)


DRAFT = jax.jit(_draft, static_argnames=("tm", "dm", "tree"), donate_argnames=("st",))
VERIFY = jax.jit(_verify, static_argnames=("tm", "dm"), donate_argnames=("st",))
ACCEPT = jax.jit(_accept, static_argnames=("tm", "dm", "tree"), donate_argnames=("st", "v", "dcache"))
ROUND = jax.jit(_round, static_argnames=("tm", "dm", "tree"), donate_argnames=("st",))
