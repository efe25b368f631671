"""The serving engine's device programs over S slots: insert a prefilled request into a slot, run a
bounded number of EAGLE-2 rounds, retire slots.

A slot is one row of an `eagle.EagleState` whose batch is the slot count; an idle slot is a done row,
which every round leaves untouched. A request is prefilled on its own (eagle.PREFILL, batch 1, the
engine's cache bucket), then INSERT writes that one-row state into its slot. Every program here is
compiled once per (slot count, cache bucket, tree): arrivals, departures and lengths are data.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..cache import KVCache
from ..eagle import EagleState, eagle_round
from ..programs import Program


def _put_row(big, one, slot, axis: int):
    """`big` with its row `slot` along `axis` replaced by `one`'s row 0."""
    row = jax.lax.index_in_dim(one, 0, axis, keepdims=True).astype(big.dtype)
    start = [jnp.int32(0)] * big.ndim
    start[axis] = slot
    return jax.lax.dynamic_update_slice(big, row, start)


def _put_cache(big: KVCache, one: KVCache, slot) -> KVCache:
    return KVCache(k=_put_row(big.k, one.k, slot, 1), v=_put_row(big.v, one.v, slot, 1),
                   length=_put_row(big.length, one.length, slot, 0))


def insert(st: EagleState, one: EagleState, slot) -> EagleState:
    """The slots' state with slot `slot` holding the prefilled request `one` (a one-row state of the
    same cache bucket): both caches, root, hidden state, output row, counters and key."""
    rows = {f: _put_row(getattr(st, f), getattr(one, f), slot, 0)
            for f in ("root_B", "hidden_BD", "out_BM", "n_out_B", "done_B", "max_new_B", "keys_B", "accept_BR",
                      "rounds_B")}
    return st.replace(tcache=_put_cache(st.tcache, one.tcache, slot), dcache=_put_cache(st.dcache, one.dcache, slot),
                      **rows)


def retire(st: EagleState, stop_B) -> EagleState:
    """Rows where `stop_B` is set are done (a cancelled request, a stop string found on the host)."""
    return st.replace(done_B=st.done_B | stop_B)


def rounds(tmodule, tparams, dmodule, dparams, st: EagleState, sampling, max_rounds, *, tree) -> EagleState:
    """Up to `max_rounds` rounds, returning early once a row finishes (its slot can then be reused)."""
    done0 = jnp.sum(st.done_B)

    def more(carry):
        s, i = carry
        return (i < max_rounds) & (jnp.sum(s.done_B) == done0) & ~jnp.all(s.done_B)

    def body(carry):
        s, i = carry
        return eagle_round(tmodule, tparams, dmodule, dparams, s, sampling, tree), i + 1
    return jax.lax.while_loop(more, body, (st, jnp.int32(0)))[0]


def _insert(st, one, slot):
    return insert(st, one, slot)


def _retire(st, stop_B):
    return retire(st, stop_B)


def _rounds(tparams, dparams, st, sampling, max_rounds, *, tmodule, dmodule, tree):
    return rounds(tmodule, tparams, dmodule, dparams, st, sampling, max_rounds, tree=tree)


INSERT = Program(_insert, (), donate=("st",))
RETIRE = Program(_retire, (), donate=("st",))
ROUNDS = Program(_rounds, ("tmodule", "dmodule", "tree"), donate=("st",), loop=True)
