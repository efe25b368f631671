"""A continuous-batching engine of EAGLE-2 rounds: S slots over one cache bucket, a queue of requests,
and a host loop that admits, dispatches a bounded number of rounds, hands out tokens and frees slots.

    engine = Engine(target, draft, slots=4, max_len=1024)
    engine.warmup()                      # every program compiled here, never again
    r = engine.submit(prompt_ids, max_new_tokens=64, temperature=0.7, seed=1)
    while not r.finished:
        engine.step()
    r.tokens

Each request is prefilled alone (eagle.PREFILL, batch 1, the engine's cache bucket: one program per
prompt bucket) and inserted into the lowest free slot (slots.INSERT). The device state holds as
many rows as the slot bucket covering the busy slots (a power of two up to `slots`; programs.RESIZE
when the load changes bucket, after slots.MOVE packs busy rows low), so a dispatch computes no
more rows than that. `step` runs up to `rounds_per_dispatch` rounds on device (slots.ROUNDS,
returning early when a row finishes), reads each busy row's new tokens and frees the slots whose
rows are done.

Speculation adapts to load: the plan maps each slot bucket to a tree or to plain decoding (None):
given (one tree, or a table by batch size), from the head's tree.json (`by_batch`, timed per batch
size), or measured at warm-up where neither is given ("auto", serving.plan: round times of a few
candidate trees and of plain rounds at every bucket, tau from a calibration; at run time the accept
lengths the rows see move a bucket to another compiled choice when it wins by a margin);
`mode="vanilla"` serves plain decoding only. A plain round also feeds the draft the token it commits (one draft-layer
position, no draft LM head), so every row can draft again as soon as the load falls back to a tree
bucket; in vanilla mode the draft is never run. Sampling is per request (temperature, top-p, top-k,
seed; temperature 0 is greedy): the greedy program runs while every busy row is greedy, the sampling program (greedy rows kept greedy)
otherwise. Rows are independent, so a request's tokens never depend on what else is in the batch.
Stop token ids beyond the model's EOS are checked on the host, which then retires the row.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from ..config import SamplingConfig
from ..decoding.batching import MIN_PROMPT_BUCKET, cache_bucket, eos_value, next_pow2, round_up
from ..decoding.eagle import PREFILL, program_inputs, scratch_slots
from ..decoding.sampling import SamplingParams
from ..decoding.spec import RoundSpec, params_of
from ..models.draft import Draft, check_compatible
from ..models.target import Target
from ..sharding import batch_multiple, to_host
from .plan import AUTO, Choice, Planner, calibration_prompts, candidates, fixed_plan, measure_tau, time_rounds
from .slot_table import SlotTable
from .slots import INSERT, MOVE, RESIZE, RETIRE, ROUNDS

MODES = ("eagle", "vanilla")


def engine_cache_len(max_len: int, trees) -> int:
    """The one cache bucket of an engine whose requests fit max_len (prompt + max_tokens) and the
    scratch slots of a round of any of `trees` (None: a plain round)."""
    scratch = max(scratch_slots(t) for t in trees)
    return cache_bucket(max(max_len + scratch, MIN_PROMPT_BUCKET))


def bucket_prompts(max_len: int) -> list:
    """One dummy prompt per prompt bucket a request of at most max_len - 1 prompt tokens can fall in:
    prefilling them compiles every prefill program the engine can need."""
    sizes = sorted({next_pow2(n, MIN_PROMPT_BUCKET) for n in range(1, max_len)})
    return [[0] * min(p, max_len - 1) for p in sizes]


def slot_buckets(slots: int, multiple: int = 1) -> list:
    """Row counts ROUNDS is compiled for: powers of two (multiples of the mesh's data axis) up to slots."""
    return sorted({min(round_up(next_pow2(n), multiple), slots) for n in range(1, slots + 1)})


@dataclasses.dataclass(eq=False)
class Request:
    """One request's progress; `tokens` grows as the engine hands them out (compared by identity)."""
    id: int
    prompt: list
    max_new_tokens: int
    stop_ids: tuple = ()
    sampling: SamplingConfig = SamplingConfig()
    seed: Optional[int] = None  # None: one the engine derives from its own seed and the request's id
    on_tokens: Optional[Callable[[list], None]] = None
    on_done: Optional[Callable[[], None]] = None  # for a caller waiting on another thread
    tokens: list = dataclasses.field(default_factory=list)
    accept_lengths: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop" (EOS or a stop id), "length", "cancelled", "error"
    error: Optional[str] = None  # with finish_reason "error": what failed, in one line
    slot: Optional[int] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(self, target: Target, draft: Draft, *, slots: int = 4, max_len: int = 1024,
                 tree=None, plan=None, mode: str = "eagle", eos_token_id: Optional[int] = None,
                 rounds_per_dispatch: int = 8, seed: int = 0, sampling: bool = True, ahead: bool = False):
        """`slots`: most rows decoded together (rounded up to a power of two); `max_len`: the longest
        prompt + max_new_tokens a request may ask for; `plan` (or `tree`): one TreeConfig at every load,
        a table {batch size: TreeConfig or None}, "auto" (measured at warm-up, adapted at run time:
        serving.plan), or None: the head's tree.json table, else "auto"; `mode`: "eagle" or "vanilla"
        (plain decoding only). `sampling` False: greedy requests only (half the programs to compile).
        `ahead`: dispatch the next rounds before handing out the last dispatch's tokens, so the device
        computes while the host works (tokens then reach requests one step later; a server's choice).
        Nothing runs until `warmup()` or the first `step()`."""
        check_compatible(draft.config, target.config)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.target, self.draft, self.mode = target, draft, mode
        m = batch_multiple(target.mesh)
        self.slots = round_up(next_pow2(slots), m)
        self.buckets = slot_buckets(self.slots, m)
        plan = plan if plan is not None else tree
        fixed = {b: None for b in self.buckets} if mode == "vanilla" else (
            None if plan == AUTO else fixed_plan(draft, self.buckets, plan))
        self.auto = fixed is None
        trees = candidates(draft, target.config.vocab_size) if self.auto else []
        # bucket -> the choices compiled for it (the plan's tree and plain rounds; auto: every candidate)
        self.choices = {b: trees + [None] if self.auto else list(dict.fromkeys((fixed[b], None)))
                        for b in self.buckets}
        self.plan = {b: trees[-1] for b in self.buckets} if self.auto else fixed  # auto: measured at warm-up
        self.planner: Optional[Planner] = None
        # plain rounds feed the draft only where a tree may follow them (a plan without trees never drafts)
        self.catch_up = mode != "vanilla" and (self.auto or any(t is not None for t in fixed.values()))
        self.eos, self.max_len, self.k, self.seed = eos_token_id, max_len, rounds_per_dispatch, seed
        self.modes = (True, False) if sampling else (True,)  # greedy program, sampling program
        every = [t for cs in self.choices.values() for t in cs]
        self.cache_len = engine_cache_len(max_len, every)
        self.params = params_of(target, draft)
        self._slack = max(scratch_slots(t) for t in every)  # checked against the cache bucket
        self.queue: collections.deque = collections.deque()
        self.table = SlotTable(self.slots)  # the host's side of the slots
        self.ahead = ahead
        self._pending: collections.deque = collections.deque()  # dispatches whose results are not handed out
        self._ids = itertools.count()
        self.dispatches: collections.Counter = collections.Counter()  # (rows, tree or None: plain) -> count
        self.state = None  # the busy slots' EagleState (self.rows rows), made on first use: every row idle
        self.rows = self.buckets[0]

    # ---- requests ---------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (), *,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None,
               on_tokens: Optional[Callable[[list], None]] = None,
               on_done: Optional[Callable[[], None]] = None) -> Request:
        """Queue a request (token ids); bad input raises ValueError at once, nothing queued."""
        r = self.request(prompt, max_new_tokens, stop_ids, temperature=temperature, top_p=top_p, top_k=top_k,
                         seed=seed, on_tokens=on_tokens, on_done=on_done)
        self.enqueue(r)
        return r

    def request(self, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (), *,
                temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: Optional[int] = None,
                on_tokens: Optional[Callable[[list], None]] = None,
                on_done: Optional[Callable[[], None]] = None) -> Request:
        """A checked request, not yet queued (`enqueue`): every value fits the dtype it becomes on
        device, or ValueError names the first that does not. Reads no engine state, so another
        thread may call it while the engine steps."""
        if isinstance(prompt, (str, bytes)) or not all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            raise ValueError("the prompt must be a sequence of token ids")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty")
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if len(prompt) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room to generate within the engine's "
                             f"max_len {self.max_len}")
        if len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} exceeds the "
                             f"engine's max_len {self.max_len}")
        V = self.target.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= V:
            raise ValueError(f"the prompt has token ids outside [0, {V})")
        if not all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
                   for x in (temperature, top_p, top_k)) or int(top_k) != top_k:
            raise ValueError("temperature and top_p must be numbers, top_k an integer")
        sampling = SamplingConfig(float(temperature), int(top_k), float(top_p))  # checks the ranges
        if not sampling.greedy and False not in self.modes:
            raise ValueError("this engine serves greedy requests only (temperature 0)")
        if seed is not None and not (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool)
                                     and 0 <= seed < 2 ** 32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        return Request(next(self._ids), prompt, int(max_new_tokens), tuple(int(s) for s in stop_ids), sampling,
                       seed, on_tokens, on_done)

    def enqueue(self, r: Request) -> None:
        """Queue a request made by `request`."""
        self.queue.append(r)

    def cancel(self, r: Request, reason: str = "cancelled") -> None:
        """Stop a request (queued or running); its slot is free for the next arrival."""
        if r.finished:
            return
        if r in self.queue:
            self.queue.remove(r)
        elif r.slot is not None and self.running.get(r.slot) is r:
            self._retire([r.slot])
        r.finish_reason = reason

    def fail(self, r: Request, e: BaseException) -> None:
        """End one request with an error (its slot freed); the engine goes on with the others."""
        self.cancel(r, "error")
        r.error = f"{type(e).__name__}: {e}".splitlines()[0]

    @property
    def running(self) -> dict:
        """slot -> the request it holds."""
        return self.table.requests

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running and not self._pending

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> None:
        """Admit waiting requests into the lowest free slots, run up to rounds_per_dispatch rounds over
        the slot bucket covering the busy slots, hand out the new tokens and free finished slots."""
        self._ensure_state()
        n = min(len(self.queue), self.slots - len(self.running))
        if n:
            self._resize(max(self.rows, self.bucket_for(len(self.running) + n)))
            for slot in self.table.free(self.rows)[:n]:
                r = self.queue.popleft()
                try:
                    self._admit(r, slot)
                except Exception as e:  # noqa: BLE001 - this request fails; the state is as before it
                    self.fail(r, e)
        self._pack()
        dispatched = bool(self.running)
        if dispatched:
            rows = self.rows
            tree = self.planner.choose(rows) if self.planner is not None else self.plan[rows]
            self.state, result = self._dispatch(self.state, tree, self.table.sampling(rows))
            for x in jax.tree_util.tree_leaves(result):
                x.copy_to_host_async()  # the small result travels while the host goes on
            self._pending.append((result, dict(self.running), rows, tree))
            self.dispatches[rows, tree] += 1
        while len(self._pending) > (1 if self.ahead and dispatched else 0):
            self._hand_out(*self._pending.popleft())

    def bucket_for(self, busy: int) -> int:
        """The smallest slot bucket holding `busy` rows."""
        return next(b for b in self.buckets if b >= busy)

    def run(self, max_steps: int = 100_000) -> None:
        """Step until every request has finished (bounded by max_steps dispatches)."""
        for _ in range(max_steps):
            if self.idle:
                return
            self.step()
        raise RuntimeError(f"the engine did not drain in {max_steps} dispatches")

    def warmup(self, progress: Optional[Callable[[str], None]] = None) -> int:
        """Compile every program a run can need now (each run once, leaving every slot idle: call it
        before the first request); returns how many there are. `progress(label)` is called after each."""
        def run(program, *args, label, **static):
            out = program(*args, **static)
            if progress:
                progress(label)
            return out
        n = 1 + self._programs(run, self._idle_state())  # the slots' own prefill first
        jax.block_until_ready(self.state)
        if self.auto:
            self._measure_plan(progress)
            if all(t is None for t in self.plan.values()):  # no tree pays anywhere: the planner cannot move
                self.catch_up = False  # (it learns only from tree rounds), so plain rounds skip the draft
                self._programs(lambda program, *args, label, **static: program(*args, **static), self._idle_state())
                n += len(self.buckets) * len(self.modes)  # the plain rounds without catch-up, new; the rest cached
        return n

    def describe_plan(self) -> str:
        """The plan in one line: each bucket's choice (auto: with every candidate's figures)."""
        if self.planner is not None:
            return self.planner.describe()
        return ", ".join(f"{b} rows: " + ("plain" if t is None else f"tree {t.depth}/{t.top_k}/{t.total_tokens}")
                         for b, t in self.plan.items()) + (" (auto: measured at warm-up)" if self.auto else "")

    def _measure_plan(self, progress=None) -> None:
        """Time every compiled choice at every bucket over that many busy rows, calibrate tau, and
        let the planner pick (serving.plan)."""
        trees = [t for t in self.choices[self.buckets[0]] if t is not None]
        taus = measure_tau(self.target, self.draft, trees)
        prompt = (calibration_prompts(self.target.tokenizer)[0] if self.target.tokenizer is not None
                  else [1] * MIN_PROMPT_BUCKET)[:self.max_len // 2]
        greedy = SamplingParams.of(SamplingConfig())
        table = {}
        for b in self.buckets:
            args, static = self._prefill_args([prompt] * b, self.max_len - len(prompt), self.seed, SamplingConfig())
            busy = PREFILL(*args, **static)
            table[b] = [Choice(t, time_rounds(lambda s, t=t: self._dispatch(s, t, greedy)[0], busy),
                        1.0 if t is None else taus[t]) for t in self.choices[b]]
            if progress:
                progress(f"timed {b} rows")
        self.planner = Planner(table)
        self.plan = self.planner.plan

    # ---- internals --------------------------------------------------------------------------------
    def _programs(self, call, state) -> int:
        """Every program this engine runs, each called once through call(program, *args, label=..., **static)
        (warm-up runs them; compile_programs compiles them): prefills per prompt bucket, greedy and
        sampling; insert, move and retire; rounds per slot bucket, greedy and sampling. Rows stay idle."""
        count = 0

        def counted(*args, **kw):
            nonlocal count
            count += 1
            return call(*args, **kw)
        for greedy in self.modes:
            for prompt in bucket_prompts(self.max_len):
                args, static = self._prefill_args([prompt], 1, 0, self._sampling_of(greedy))
                one = counted(PREFILL, *args, label=f"prefill {len(prompt)}{'' if greedy else ' (sampling)'}",
                              **static)
        cur, pairs = self.buckets[0], set()

        def resize(to):
            nonlocal state, cur
            if to != cur:
                if (cur, to) in pairs:  # compiled already: run it, count it once
                    state = call(RESIZE, state, label=f"resize {cur} to {to} rows", rows=to)
                else:
                    pairs.add((cur, to))
                    state = counted(RESIZE, state, label=f"resize {cur} to {to} rows", rows=to)
                cur = to
        for rows in self.buckets:  # the state at each bucket: every program over it
            resize(rows)
            state = counted(INSERT, state, one, np.int32(0), label=f"insert ({rows} rows)")
            state = counted(MOVE, state, np.int32(0), np.int32(rows - 1), label=f"move ({rows} rows)")
            state = counted(RETIRE, state, np.ones(rows, bool), label=f"retire ({rows} rows)")
            for tree in self.choices[rows]:
                for greedy in self.modes:
                    s = SamplingParams.of(SamplingConfig()) if greedy else SamplingParams.rows(
                        np.ones(rows), np.zeros(rows), np.ones(rows))
                    what = "plain" if tree is None else f"tree {tree.depth}/{tree.top_k}/{tree.total_tokens}"
                    state = counted(ROUNDS, self.params, state, s,  # every row idle: no round runs
                                    label=f"rounds {rows} rows, {what}{'' if greedy else ' (sampling)'}",
                                    **self._rounds_static(tree))[0]
        for a in self.buckets:  # every other resize a load change can ask for
            for b in self.buckets:
                if a != b and (a, b) not in pairs:
                    resize(a)
                    resize(b)
        resize(self.buckets[0])
        self.state, self.rows = state, cur
        return count

    @staticmethod
    def _sampling_of(greedy: bool) -> SamplingConfig:
        return SamplingConfig() if greedy else SamplingConfig(temperature=1.0)

    def _prefill_args(self, prompts, max_new: int, seed: int, sampling: SamplingConfig):
        _, args, static = program_inputs(self.target, self.draft, prompts, max_new, self.eos, seed, sampling,
                                         self._slack, cache_len=self.cache_len)
        return args, static

    def _idle_state(self):
        """A state of the smallest bucket's rows, all idle."""
        rows = self.buckets[0]
        args, static = self._prefill_args([[0]] * rows, 1, self.seed, SamplingConfig())
        return RETIRE(PREFILL(*args, **static), np.ones(rows, bool))

    def _ensure_state(self) -> None:
        if self.state is None:
            self.state, self.rows = self._idle_state(), self.buckets[0]

    def _resize(self, rows: int) -> None:
        if rows != self.rows:
            self.state = RESIZE(self.state, rows=rows)
            self.rows = rows

    def _rounds_static(self, tree):
        """A dispatch's spec (plain rounds feed the draft their token where a tree may follow) and its
        bound on rounds."""
        return dict(spec=RoundSpec.of(self.target, self.draft, tree, catch_up=self.catch_up), max_rounds=self.k)

    def _dispatch(self, state, tree, sampling):
        """(state, slots.Dispatch) after up to rounds_per_dispatch rounds of `tree` (None: plain)."""
        return ROUNDS(self.params, state, sampling, **self._rounds_static(tree))

    def _admit(self, r: Request, slot: int) -> None:
        seed = r.seed if r.seed is not None else (self.seed + 1 + r.id) % 2 ** 32  # each request its own key
        args, static = self._prefill_args([r.prompt], r.max_new_tokens, seed, r.sampling)
        self.state = INSERT(self.state, PREFILL(*args, **static), np.int32(slot))
        self.table.put(slot, r)

    def _pack(self) -> None:
        """Move rows from slots above the bucket the busy count needs into free slots below it, then
        shrink the state to that bucket."""
        need = self.bucket_for(len(self.running))
        high = sorted((s for s in self.running if s >= need), reverse=True)
        for src, dst in zip(high, self.table.free(need)):
            self.state = MOVE(self.state, np.int32(src), np.int32(dst))
            self.state = RETIRE(self.state, np.arange(self.rows) == src)
            self.table.move(src, dst)
        if need < self.rows:
            self._resize(need)

    def _retire(self, slots) -> None:
        stop = np.zeros(self.rows, bool)
        stop[list(slots)] = True
        self.state = RETIRE(self.state, stop)
        for s in slots:
            self.table.clear(s)

    def _hand_out(self, result, owners: dict, rows: int, tree) -> None:
        """Hand out one dispatch's result (`owners`: slot -> request when it was dispatched): new tokens
        to each request still holding its row, finished rows retired; the accept lengths to the planner."""
        toks, n_new, acc, n_rounds, done = (to_host(x) for x in (result.tokens_BJ, result.n_new_B, result.accept_BK,
                                                                  result.n_rounds_B, result.done_B))
        eos = eos_value(self.eos)
        stopped, accepted = [], []
        for slot, r in owners.items():
            if r.finished or self.running.get(r.slot) is not r:
                continue  # ended on the host since (a stop id, a cancel): what its row made after is dropped
            new, new_acc = toks[slot, :n_new[slot]].tolist(), acc[slot, :n_rounds[slot]].tolist()
            r.accept_lengths.extend(new_acc)
            accepted.extend(new_acc)
            hit = next((i for i, t in enumerate(new) if t in r.stop_ids), None)
            if hit is not None:  # a stop id the device does not know: cut after it, retire the row
                new = new[:hit + 1]
            if new:
                r.tokens.extend(new)
                if r.on_tokens is not None:
                    try:
                        r.on_tokens(new)
                    except Exception as e:  # noqa: BLE001 - the caller is gone: its request ends, no one else's
                        r.finish_reason, r.error = "error", f"on_tokens: {type(e).__name__}: {e}".splitlines()[0]
                        stopped.append(r.slot)
                        continue
            if hit is not None or done[slot]:
                stop = hit is not None or (r.tokens and r.tokens[-1] == eos)
                r.finish_reason = "stop" if stop else "length"
                stopped.append(r.slot)
        if stopped:
            self._retire(stopped)
        if self.planner is not None:
            self.planner.observe(rows, tree, accepted)


def compile_programs(target: Target, draft: Draft, *, slots: int = 4, max_len: int = 1024,
                     tree=None, mode: str = "eagle", eos_token_id: Optional[int] = None,
                     progress: Optional[Callable[[str], None]] = None) -> int:
    """Compile every program an Engine with these settings runs, without running any: for abstract
    params (load_target(..., abstract=True)), e.g. to fill a persistent compile cache before a
    deployment. Returns how many programs were compiled."""
    engine = Engine(target, draft, slots=slots, max_len=max_len, tree=tree, mode=mode, eos_token_id=eos_token_id)

    def compile_(program, *args, label, **static):
        exe = program.compile(*args, **static)
        if progress:
            progress(label)
        return exe.out_info
    args, static = engine._prefill_args([[0]] * engine.buckets[0], 1, 0, SamplingConfig())
    state = compile_(PREFILL, *args, label="prefill (idle slots)", **static)
    return 1 + engine._programs(compile_, state)
