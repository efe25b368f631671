"""A continuous-batching engine of EAGLE-2 rounds: S slots over one cache bucket, a queue of requests,
and a host loop that admits, dispatches a bounded number of rounds, hands out tokens and frees slots.

    engine = Engine(target, draft, slots=4, max_len=1024)
    engine.warmup()                      # every program compiled here, never again
    r = engine.submit(prompt_ids, max_new_tokens=64)
    while not r.finished:
        engine.step()
    r.tokens

Each request is prefilled alone (eagle.PREFILL, batch 1, the engine's cache bucket: one program per
prompt bucket) and inserted into a free slot (programs.INSERT); `step` then runs up to
`rounds_per_dispatch` rounds on device (programs.ROUNDS, returning early when a row finishes), reads
each active row's new tokens and frees the slots whose rows are done. Rows are independent, so a
greedy request's tokens never depend on what else is in the batch. Sampling settings are the
engine's (one `SamplingConfig` for every row); stop token ids beyond the model's EOS are checked on
the host, which then retires the row.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from ..autotune import resolve_tree
from ..batching import MIN_PROMPT_BUCKET, cache_bucket, eos_value, next_pow2
from ..config import SamplingConfig, TreeConfig
from ..draft import Draft, check_compatible
from ..eagle import PREFILL, program_inputs, scratch_slots
from ..model import Target
from ..sampling import SamplingParams
from ..sharding import to_host
from .programs import INSERT, RETIRE, ROUNDS


def engine_cache_len(max_len: int, tree: TreeConfig) -> int:
    """The one cache bucket of an engine whose requests fit max_len (prompt + max_tokens) and a round's
    scratch slots."""
    return cache_bucket(max(max_len + scratch_slots(tree), MIN_PROMPT_BUCKET))


def bucket_prompts(max_len: int) -> list:
    """One dummy prompt per prompt bucket a request of at most max_len - 1 prompt tokens can fall in:
    prefilling them compiles every prefill program the engine can need."""
    sizes = sorted({next_pow2(n, MIN_PROMPT_BUCKET) for n in range(1, max_len)})
    return [[0] * min(p, max_len - 1) for p in sizes]


@dataclasses.dataclass(eq=False)
class Request:
    """One request's progress; `tokens` grows as the engine hands them out (compared by identity)."""
    id: int
    prompt: list
    max_new_tokens: int
    stop_ids: tuple = ()
    on_tokens: Optional[Callable[[list], None]] = None
    on_done: Optional[Callable[[], None]] = None  # for a caller waiting on another thread
    tokens: list = dataclasses.field(default_factory=list)
    accept_lengths: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop" (EOS or a stop id), "length", "cancelled"
    slot: Optional[int] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(self, target: Target, draft: Draft, *, slots: int = 4, max_len: int = 1024,
                 tree: Optional[TreeConfig] = None, sampling: SamplingConfig = SamplingConfig(),
                 eos_token_id: Optional[int] = None, rounds_per_dispatch: int = 8, seed: int = 0):
        """`slots`: rows decoded together (rounded up to a power of two, the batch bucket); `max_len`:
        the longest prompt + max_new_tokens a request may ask for; `tree`: None, the head's tree for
        this platform (autotune.resolve_tree)."""
        check_compatible(draft.config, target.config)
        self.target, self.draft = target, draft
        self.tree = tree if tree is not None else resolve_tree(draft)
        self.sampling, self.eos = sampling, eos_token_id
        self.slots, self.max_len, self.k = next_pow2(slots), max_len, rounds_per_dispatch
        self.cache_len = engine_cache_len(max_len, self.tree)
        self.seed = seed
        self.queue: collections.deque = collections.deque()
        self.running: dict = {}  # slot -> Request
        self._ids = itertools.count()
        self._seen = np.zeros(self.slots, np.int64)  # tokens of each slot's row already handed out
        self._rounds = np.zeros(self.slots, np.int64)
        # the slots' state: every row done (idle) until a request is inserted
        self.state = self._prefill([[0]] * self.slots, 1, seed)
        self.state = RETIRE(self.state, np.ones(self.slots, bool))

    # ---- requests ---------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
               on_tokens: Optional[Callable[[list], None]] = None,
               on_done: Optional[Callable[[], None]] = None) -> Request:
        """Queue a request (token ids); bad input raises ValueError at once, nothing queued."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty")
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} exceeds the "
                             f"engine's max_len {self.max_len}")
        V = self.target.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= V:
            raise ValueError(f"the prompt has token ids outside [0, {V})")
        r = Request(next(self._ids), prompt, int(max_new_tokens), tuple(int(s) for s in stop_ids), on_tokens,
                    on_done)
        self.queue.append(r)
        return r

    def cancel(self, r: Request) -> None:
        """Stop a request (queued or running); its slot is free for the next arrival."""
        if r.finished:
            return
        if r in self.queue:
            self.queue.remove(r)
        elif r.slot is not None:
            self._retire([r.slot])
        r.finish_reason = "cancelled"

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit waiting requests into free slots, run up to rounds_per_dispatch rounds, hand out the
        new tokens and free finished slots."""
        free = [s for s in range(self.slots) if s not in self.running]
        while self.queue and free:
            self._admit(self.queue.popleft(), free.pop(0))
        if not self.running:
            return
        self.state = ROUNDS(self.target.params, self.draft.params, self.state, SamplingParams.of(self.sampling),
                            np.int32(self.k), tmodule=self.target.module, dmodule=self.draft.module, tree=self.tree)
        self._hand_out()

    def run(self, max_steps: int = 100_000) -> None:
        """Step until every request has finished (bounded by max_steps dispatches)."""
        for _ in range(max_steps):
            if self.idle:
                return
            self.step()
        raise RuntimeError(f"the engine did not drain in {max_steps} dispatches")

    def warmup(self, progress: Optional[Callable[[str], None]] = None) -> None:
        """Compile every program a run can need now: the prefill of each prompt bucket up to max_len,
        the insert, the rounds and the retire programs (with a zero-row effect: nothing changes)."""
        for prompt in bucket_prompts(self.max_len):
            one = self._prefill([prompt], 1, self.seed)
            if progress:
                progress(f"prefill {len(prompt)}")
        self.state = INSERT(self.state, one, np.int32(0))
        self.state = RETIRE(self.state, np.ones(self.slots, bool))
        self.state = ROUNDS(self.target.params, self.draft.params, self.state, SamplingParams.of(self.sampling),
                            np.int32(0), tmodule=self.target.module, dmodule=self.draft.module, tree=self.tree)
        jax.block_until_ready(self.state)

    # ---- internals --------------------------------------------------------------------------------
    def _prefill(self, prompts, max_new: int, seed: int):
        _, args, static = program_inputs(self.target, self.draft, prompts, max_new, self.eos, seed,
                                         self.sampling, self.tree, cache_len=self.cache_len)
        return PREFILL(*args, **static)

    def _admit(self, r: Request, slot: int) -> None:
        one = self._prefill([r.prompt], r.max_new_tokens, self.seed + 1 + r.id)  # each request its own key
        self.state = INSERT(self.state, one, np.int32(slot))
        r.slot = slot
        self.running[slot] = r
        self._seen[slot] = 0
        self._rounds[slot] = 0

    def _retire(self, slots) -> None:
        stop = np.zeros(self.slots, bool)
        stop[list(slots)] = True
        self.state = RETIRE(self.state, stop)
        for s in slots:
            self.running.pop(s, None)

    def _hand_out(self) -> None:
        n_out, done, rounds = (to_host(x) for x in (self.state.n_out_B, self.state.done_B, self.state.rounds_B))
        out = to_host(self.state.out_BM)
        acc = to_host(self.state.accept_BR)
        eos = eos_value(self.eos)
        stopped = []
        for slot, r in list(self.running.items()):
            new = out[slot, self._seen[slot]:n_out[slot]].tolist()
            r.accept_lengths.extend(acc[slot, self._rounds[slot]:rounds[slot]].tolist())
            self._seen[slot], self._rounds[slot] = n_out[slot], rounds[slot]
            hit = next((i for i, t in enumerate(new) if t in r.stop_ids), None)
            if hit is not None:  # a stop id the device does not know: cut after it, retire the row
                new = new[:hit + 1]
            if new:
                r.tokens.extend(new)
                if r.on_tokens is not None:
                    r.on_tokens(new)
            if hit is not None or done[slot]:
                stop = hit is not None or (r.tokens and r.tokens[-1] == eos)
                r.finish_reason = "stop" if stop else "length"
                stopped.append(slot)
        if stopped:
            self._retire(stopped)


def compile_programs(target: Target, draft: Draft, *, slots: int = 4, max_len: int = 1024,
                     tree: Optional[TreeConfig] = None, sampling: SamplingConfig = SamplingConfig(),
                     eos_token_id: Optional[int] = None, progress: Optional[Callable[[str], None]] = None) -> int:
    """Compile every program an Engine with these settings runs, without running any: for abstract
    params (load_target(..., abstract=True)), e.g. to fill a persistent compile cache before a
    deployment. Returns how many programs were compiled."""
    tree = tree if tree is not None else resolve_tree(draft)
    S = next_pow2(slots)
    cache_len = engine_cache_len(max_len, tree)
    count = 0

    def compile_(program, *args, what, **static):
        nonlocal count
        exe = program.compile(*args, **static)
        count += 1
        if progress:
            progress(what)
        return exe.out_info

    def prefill(prompts):
        _, args, static = program_inputs(target, draft, prompts, 1, eos_token_id, 0, sampling, tree, cache_len=cache_len)
        return compile_(PREFILL, *args, what=f"prefill {len(prompts[0])}", **static)
    state = prefill([[0]] * S)
    compile_(RETIRE, state, np.ones(S, bool), what="retire")
    for prompt in bucket_prompts(max_len):
        one = prefill([prompt])
    compile_(INSERT, state, one, np.int32(0), what="insert")
    compile_(ROUNDS, target.params, draft.params, state, SamplingParams.of(sampling), np.int32(0), what="rounds",
             tmodule=target.module, dmodule=draft.module, tree=tree)
    return count
