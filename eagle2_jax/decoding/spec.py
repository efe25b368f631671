"""What a decoding program is compiled for, in one object, and the weights it runs on, in one pytree.

    spec = RoundSpec.of(target, draft, tree)          # static: hashable, the programs' `spec` argument
    params = params_of(target, draft)                 # {"target": ..., "draft": ...}: traced
    state = eagle.LOOP(params, state, sampling, spec=spec)

A program reads every field of its spec and is compiled once per distinct spec (and input shapes):
no compile key it does not read. Greedy or sampling is the static flag of the `SamplingParams` the
program is given; shapes (batch, cache and prompt buckets) come from its inputs; prefill programs
add the cache and output lengths and the mesh.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..config import TreeConfig
from ..models.draft import Draft, EagleDraft
from ..models.target import Llama, Target


@dataclasses.dataclass(frozen=True)
class RoundSpec:
    target: Llama  # the target network (config, dtype, ops)
    draft: Optional[EagleDraft] = None  # the draft head; None: plain decoding (no draft state)
    tree: Optional[TreeConfig] = None  # the round's tree; None: plain rounds (the root alone is verified)
    catch_up: bool = True  # a plain round also feeds the draft the token it commits

    def __post_init__(self):
        if self.tree is not None and not self.catch_up:  # a tree round always catches the draft up
            object.__setattr__(self, "catch_up", True)

    @classmethod
    def of(cls, target: Target, draft: Optional[Draft] = None, tree: Optional[TreeConfig] = None,
           catch_up: bool = True) -> "RoundSpec":
        return cls(target.module, None if draft is None else draft.module, tree, catch_up)

    def prefill(self) -> "RoundSpec":
        """The spec a prefill is compiled for: the networks only (a prefill builds no tree)."""
        return RoundSpec(self.target, self.draft)


def params_of(target: Target, draft: Optional[Draft] = None) -> dict:
    """The weights of a program in one pytree: {"target": ...} (+ "draft")."""
    return {"target": target.params} if draft is None else {"target": target.params, "draft": draft.params}
