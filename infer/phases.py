"""The EAGLE-2 round's phases as standalone jitted programs, for the tools that time them
(infer.roundcost) or read their compiled cost (infer.analytic). Each is the function the decode loop
runs (eagle2_jax.decoding.eagle) as it is, over (params, state, ..., spec); each donates what it
updates in place, as the loop does (JAX warns, harmlessly, about the state's scalars a phase leaves
alone). VERIFY reads no tree from its spec (the tree's shape is its input's): give it spec.prefill()."""
from __future__ import annotations

import jax

from eagle2_jax.decoding import eagle


def _draft(params, st, *, spec):
    return eagle.draft_tree(spec, params, st)


def _verify(params, st, t, *, spec):
    return eagle.verify_tree(spec, params, st, t)


def _accept(params, st, t, v, dcache, sampling, *, spec):
    return eagle.accept_and_commit(spec, params, st, t, v, dcache, sampling, spec.tree.max_accept)


DRAFT = jax.jit(_draft, static_argnames=("spec",), donate_argnames=("st",))
VERIFY = jax.jit(_verify, static_argnames=("spec",), donate_argnames=("st",))
ACCEPT = jax.jit(_accept, static_argnames=("spec",), donate_argnames=("st", "v", "dcache"))
ROUND = jax.jit(lambda params, st, sampling, *, spec: eagle.eagle_round(spec, params, st, sampling),
                static_argnames=("spec",), donate_argnames=("st",))
