"""The serving engine's device programs over a state of R slots: insert a prefilled request into a slot,
move a row between slots, resize the state to another slot bucket, run a bounded number of rounds,
retire slots.

A slot is one row of an `eagle.EagleState`; an idle slot is a done row, which every round leaves
untouched. A request is prefilled on its own (eagle.PREFILL, batch 1, the engine's cache bucket),
then INSERT writes that one-row state into its slot. The state holds R rows, R the slot bucket (a
power of two) covering the busy slots, so one request on an eight-slot engine runs batch-1 rounds;
RESIZE grows it with idle rows or drops idle rows at the end when the load changes bucket. ROUNDS
returns, beside the state, the dispatch's compact result (`Dispatch`) for the host to copy. Every
program here is compiled once per (slot bucket, cache bucket, tree or plain, greedy or sampling):
arrivals, departures, lengths and sampling values are data.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ..decoding.eagle import EagleState, eagle_round
from ..decoding.programs import Program
from ..decoding.spec import RoundSpec
from ..models.cache import KVCache

ROW_FIELDS = ("root_B", "hidden_BD", "out_BM", "n_out_B", "done_B", "max_new_B", "keys_B", "accept_BR", "rounds_B")


def _map_rows(fn, *states: EagleState) -> EagleState:
    """fn(arrays, row_axis) over every per-row array of the states (KV buffers: rows on axis 1)."""
    def cache(*cs):
        return KVCache(k=fn([c.k for c in cs], 1), v=fn([c.v for c in cs], 1), length=fn([c.length for c in cs], 0))
    rows = {f: fn([getattr(s, f) for s in states], 0) for f in ROW_FIELDS}
    return states[0].replace(tcache=cache(*(s.tcache for s in states)), dcache=cache(*(s.dcache for s in states)),
                             **rows)


def _put(big, part, start, axis: int):
    at = [jnp.int32(0)] * big.ndim
    at[axis] = start
    return jax.lax.dynamic_update_slice(big, part.astype(big.dtype), at)


def insert(st: EagleState, one: EagleState, slot) -> EagleState:
    """The slots' state with slot `slot` holding the one-row state `one` (same cache bucket): both
    caches, root, hidden state, output row, counters and key."""
    return _map_rows(lambda xs, axis: _put(xs[0], jax.lax.slice_in_dim(xs[1], 0, 1, axis=axis), slot, axis),
                     st, one)


def move(st: EagleState, src, dst) -> EagleState:
    """Row `src` copied into slot `dst` (the engine then retires `src`): packs busy rows low."""
    return insert(st, _map_rows(lambda xs, axis: jax.lax.dynamic_slice_in_dim(xs[0], src, 1, axis), st), dst)


def resize(st: EagleState, rows: int) -> EagleState:
    """The state with `rows` rows: idle rows (done, empty caches) appended, or the rows from `rows` on
    dropped (the engine only drops idle rows)."""
    B = st.done_B.shape[0]
    if rows <= B:
        return _map_rows(lambda xs, axis: jax.lax.slice_in_dim(xs[0], 0, rows, axis=axis), st)

    def pad(xs, axis):
        x = xs[0]
        shape = list(x.shape)
        shape[axis] = rows - B
        fill = jnp.ones(shape, x.dtype) if x.dtype == jnp.bool_ else jnp.zeros(shape, x.dtype)  # done_B: idle
        return jnp.concatenate([x, fill], axis=axis)
    return _map_rows(pad, st)


def retire(st: EagleState, stop_B) -> EagleState:
    """Rows where `stop_B` is set are done (a cancelled request, a stop string found on the host)."""
    return st.replace(done_B=st.done_B | stop_B)


@struct.dataclass
class Dispatch:
    """What one dispatch of rounds gives the host, small enough to copy whole: each row's new tokens
    and the accept lengths of the rounds it ran (J = max_rounds * the most tokens a round commits)."""
    tokens_BJ: jax.Array  # the row's tokens emitted in this dispatch; the first n_new_B hold them
    n_new_B: jax.Array
    accept_BK: jax.Array  # K = max_rounds: tokens each round added; the first n_rounds_B hold them
    n_rounds_B: jax.Array
    done_B: jax.Array


def rounds(params, st: EagleState, sampling, *, spec: RoundSpec, max_rounds: int):
    """Up to `max_rounds` rounds of spec (a tree, or plain decoding steps) over every row, returning early
    once a row finishes (its slot can then be reused). `sampling`: scalars or one value per row.
    Returns (the state, the dispatch's Dispatch)."""
    done0, r0 = jnp.sum(st.done_B), st.rounds_B
    # a row's first dispatch also hands out its prefill's token (rows are inserted with n_out 1, no round)
    n0 = st.n_out_B - ((r0 == 0) & (st.n_out_B > 0)).astype(st.n_out_B.dtype)

    def more(carry):
        s, i = carry
        return (i < max_rounds) & (jnp.sum(s.done_B) == done0) & ~jnp.all(s.done_B)

    def body(carry):
        s, i = carry
        return eagle_round(spec, params, s, sampling), i + 1
    st = jax.lax.while_loop(more, body, (st, jnp.int32(0)))[0]
    J = max_rounds * (1 if spec.tree is None else spec.tree.max_accept) + 1

    def window(buf, start, n):
        idx = jnp.minimum(start[:, None] + jnp.arange(n, dtype=jnp.int32)[None], buf.shape[1] - 1)
        return jnp.take_along_axis(buf, idx, axis=1, mode="promise_in_bounds")
    return st, Dispatch(window(st.out_BM, n0, J), st.n_out_B - n0, window(st.accept_BR, r0, max_rounds),
                        st.rounds_B - r0, st.done_B)


INSERT = Program(insert, (), donate=("st",))
MOVE = Program(move, (), donate=("st",))
RETIRE = Program(retire, (), donate=("st",))
RESIZE = Program(resize, ("rows",))  # new shapes: nothing to donate
ROUNDS = Program(rounds, ("spec", "max_rounds"), donate=("st",), loop=True)
