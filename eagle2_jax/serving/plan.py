"""The serving engine's plan: for each slot bucket, the tree its rounds draft, or plain rounds (None).

Fixed plans come from the caller (one tree, or a table by batch size) or from the head's tree.json
(`by_batch`, timed per batch size for that platform). Where the head brings no table (every published
head) or the caller asks for "auto", the plan is measured where the engine runs (`Planner`):

* candidates: the head's tree (the reference tree 5/10/60 without a tree.json) and smaller trees of the
  same depth and top_k (2 and 8 tokens), and plain rounds; every one is compiled at warm-up;
* round time: each candidate's rounds timed at warm-up on the live device with the real weights, at
  every slot bucket (best of three dispatches of a few rounds over that many busy rows);
* tokens per round (tau): measured by a short calibration on a few built-in prompts (autotune.calibrate:
  one walk of greedy rounds of the largest candidate reads off what every smaller one accepts), or,
  without a tokenizer, a conservative prior;
* choice: per bucket, the most expected tokens per second, tau / round time (plain: 1 / its time);
* at run time the accept lengths the rows actually see update the running tree's tau (an exponential
  average), which rescales the other trees' estimates alike; a bucket moves to another compiled choice
  only when it wins by MARGIN, and not within DWELL dispatches of its last move (no oscillation).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import numpy as np

from ..config import TreeConfig
from ..decoding.autotune import calibrate, fresh_copy, resolve_tree
from ..decoding.defaults import for_batch, head_tree
from ..decoding.eagle import start
from ..models.draft import Draft

AUTO = "auto"
SIZES = (2, 8)  # total_tokens of the smaller candidates (each costs a compile per bucket and mode)
PRIOR_TAU = 1.2  # tokens per tree round assumed without a calibration (a weak head's)
MARGIN = 0.10  # another choice must promise this much more to take a bucket over
DWELL = 8  # dispatches a bucket keeps a choice before it may move again
EMA = 0.1  # weight of a dispatch's mean accept length in the running estimate
CALIBRATION_PROMPTS = ("Explain how a rainbow forms, step by step.", "Write a short poem about the autumn sea.",
                       "What are three good ways to learn a new language?", "Describe the water cycle to a child.")


def fixed_plan(draft: Draft, buckets, tree=None) -> Optional[dict]:
    """Slot bucket -> tree or None from a TreeConfig (every bucket), a table {batch size: TreeConfig or
    None} (the entry of the largest size at or below the bucket), or the head's tree.json by_batch;
    None where the head has no table for this platform (the plan is then measured: `Planner`)."""
    if isinstance(tree, dict):
        if not tree or not all(isinstance(v, (TreeConfig, type(None))) for v in tree.values()):
            raise ValueError(f"a tree table maps batch sizes to a TreeConfig or None, got {tree!r}")
        return {b: for_batch(tree, b) for b in buckets}
    if isinstance(tree, TreeConfig):
        return {b: tree for b in buckets}
    if tree is not None:
        raise ValueError(f"the plan must be a TreeConfig, a table of them by batch size, 'auto' or None, got {tree!r}")
    if "by_batch" not in head_tree(getattr(draft, "source", None)):
        return None
    return {b: resolve_tree(draft, batch=b) for b in buckets}


def parse_plan(text: str):
    """A plan from the command line: "auto" (measured), "head" (the head's tree.json table, else
    measured: returns None), or a table "BATCH=DEPTH/TOP_K/TOKENS|plain,..." ("1=5/10/60,4=plain")."""
    if text in (AUTO, "head"):
        return AUTO if text == AUTO else None
    table = {}
    for part in text.split(","):
        b, _, choice = part.strip().partition("=")
        try:
            if choice == "plain":
                table[int(b)] = None
            else:
                d, k, n = (int(x) for x in choice.split("/"))
                table[int(b)] = TreeConfig(d, k, n)
        except ValueError:
            raise ValueError(f"a plan is 'auto', 'head' or batch=depth/top_k/tokens|plain entries separated by "
                             f"commas (e.g. 1=5/10/60,4=plain); got {text!r}") from None
        if int(b) < 1:
            raise ValueError(f"plan batch sizes start at 1, got {text!r}")
    return table


def candidates(draft: Draft, vocab_size: int) -> list:
    """The trees an auto plan chooses among: the head's (or the reference tree) and smaller ones of the
    same depth and top_k, smallest first."""
    base = resolve_tree(draft)
    top = base.top_k + base.depth * base.top_k * base.top_k + 1  # the pool and the root
    sizes = sorted({min(n, top) for n in SIZES if n < base.total_tokens} | {base.total_tokens})
    return [TreeConfig(base.depth, min(base.top_k, vocab_size), n) for n in sizes]


@dataclasses.dataclass
class Choice:
    tree: Optional[TreeConfig]
    round_ms: float  # measured at warm-up at this bucket
    tau: float  # tokens per round per row (plain: 1)

    def rate(self, scale: float) -> float:
        """Expected tokens per second per row; `scale` rescales a tree's gain over one token."""
        tau = 1.0 if self.tree is None else 1.0 + (self.tau - 1.0) * scale
        return tau / self.round_ms * 1e3


class Planner:
    """Chooses each bucket's compiled tree from measured round times and observed acceptance."""

    def __init__(self, table: dict):
        """`table`: bucket -> [Choice]."""
        self.table = table
        self.scale = 1.0  # observed gain over the calibrated one, for the running tree
        self._ema: dict = {}  # tree -> running mean accept length
        self.plan = {b: max(cs, key=lambda c: c.rate(1.0)).tree for b, cs in table.items()}
        self._since = {b: DWELL for b in table}
        self.moves = 0

    def observe(self, bucket: int, tree: Optional[TreeConfig], accept_lengths) -> None:
        """Accept lengths of one dispatch's rows (tree rounds only teach anything)."""
        self._since[bucket] += 1
        if tree is None or not len(accept_lengths):
            return
        mean = float(np.mean(accept_lengths))
        ema = self._ema.get(tree)
        ema = mean if ema is None else (1 - EMA) * ema + EMA * mean
        self._ema[tree] = ema
        cal = next(c.tau for c in self.table[bucket] if c.tree == tree)
        if cal > 1.0:
            self.scale = float(np.clip((ema - 1.0) / (cal - 1.0), 0.0, 2.0))

    def choose(self, bucket: int) -> Optional[TreeConfig]:
        """This bucket's tree now: the current one unless another wins by MARGIN after DWELL dispatches."""
        cur = self.plan[bucket]
        if self._since[bucket] < DWELL:
            return cur
        cs = self.table[bucket]
        now = next(c for c in cs if c.tree == cur).rate(self.scale)
        best = max(cs, key=lambda c: c.rate(self.scale))
        if best.tree != cur and best.rate(self.scale) > now * (1 + MARGIN):
            self.plan[bucket], self._since[bucket] = best.tree, 0
            self.moves += 1
        return self.plan[bucket]

    def describe(self) -> str:
        def name(t):
            return "plain" if t is None else f"tree {t.depth}/{t.top_k}/{t.total_tokens}"
        return "; ".join(f"{b} rows: {name(self.plan[b])} (" + ", ".join(
            f"{name(c.tree)} {c.round_ms:.1f} ms tau {c.tau:.2f}" for c in cs) + ")" for b, cs in self.table.items())


def calibration_prompts(tokenizer) -> list:
    """Token ids of the built-in calibration prompts, in the chat template where the tokenizer has one."""
    out = []
    for text in CALIBRATION_PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            s = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True)
            out.append(tokenizer.encode(s, add_special_tokens=False))
        else:
            out.append(tokenizer.encode(text + "\n\n", add_special_tokens=True))
    return out


def measure_tau(target, draft, trees, rounds: int = 12) -> dict:
    """tree -> tokens per round on the calibration prompts (greedy), every tree from one walk of the
    largest (they share depth and top_k); the prior without a tokenizer."""
    if target.tokenizer is None:
        return {t: PRIOR_TAU for t in trees}
    big = max(trees, key=lambda t: t.total_tokens)
    st, _ = start(target, draft, calibration_prompts(target.tokenizer), max_new_tokens=4 * rounds * big.max_accept,
                  tree=big)
    acc, _ = calibrate(target, draft, st, big, rounds)
    return {t: acc.measured_tau(t.total_tokens) for t in trees}


def time_rounds(run, state, repeats: int = 3) -> float:
    """Milliseconds per round of `run(state copy)` (a dispatch of a few rounds), best of `repeats` after
    one untimed call; the rounds actually run are read from the state's step counter."""
    jax.block_until_ready(run(fresh_copy(state)))
    best = float("inf")
    for _ in range(repeats):
        s = fresh_copy(state)
        t0 = time.perf_counter()
        out = jax.block_until_ready(run(s))
        best = min(best, (time.perf_counter() - t0) / max(int(out.step) - int(state.step), 1))
    return best * 1e3
