"""The host's side of the slots, in one object: which request each slot holds, how much of its row's
output and accept lengths were handed out, and the per-row sampling values the rounds take.

The device state (serving.slots) and this table change together: the engine admits into a slot
(`put`), packs a row lower (`move`), frees a slot (`clear`), and after each dispatch reads what is new
per busy row (`new_output`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..config import SamplingConfig
from ..decoding.sampling import SamplingParams


class SlotTable:
    def __init__(self, slots: int):
        self.requests: dict = {}  # slot -> request (anything with .slot and .sampling)
        self.seen = np.zeros(slots, np.int64)  # tokens of the slot's row already handed out
        self.rounds = np.zeros(slots, np.int64)  # rounds of the slot's row already handed out
        self.temperature = np.zeros(slots, np.float32)  # 0: the row decodes greedily (also an idle slot's)
        self.top_k = np.zeros(slots, np.int32)
        self.top_p = np.ones(slots, np.float32)

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, slot: int) -> bool:
        return slot in self.requests

    def free(self, upto: int) -> list:
        """Free slots below `upto`, lowest first."""
        return [s for s in range(upto) if s not in self.requests]

    def put(self, slot: int, r) -> None:
        """`r` now holds `slot`, nothing of it handed out yet."""
        r.slot, self.requests[slot] = slot, r
        self.seen[slot] = self.rounds[slot] = 0
        s: SamplingConfig = r.sampling
        self.temperature[slot] = 0.0 if s.greedy else s.temperature
        self.top_k[slot], self.top_p[slot] = s.top_k, s.top_p

    def move(self, src: int, dst: int) -> None:
        """The request in `src` now holds `dst` (the device row was copied there)."""
        r = self.requests.pop(src)
        r.slot, self.requests[dst] = dst, r
        for a in (self.seen, self.rounds, self.temperature, self.top_k, self.top_p):
            a[dst] = a[src]
        self._idle(src)

    def clear(self, slot: int) -> Optional[object]:
        """Free `slot`; returns the request it held (None if none)."""
        self._idle(slot)
        return self.requests.pop(slot, None)

    def sampling(self, rows: int) -> SamplingParams:
        """The dispatch's sampling values over the first `rows` slots: the greedy program while every busy
        row is greedy, else one value per row."""
        if not np.any(self.temperature[:rows] > 0):
            return SamplingParams.of(SamplingConfig())
        return SamplingParams.rows(self.temperature[:rows], self.top_k[:rows], self.top_p[:rows])

    def new_output(self, out_BM, n_out_B, accept_BR, rounds_B):
        """(slot, request, new tokens, new accept lengths) of every busy slot since the last call."""
        for slot, r in list(self.requests.items()):
            new = out_BM[slot, self.seen[slot]:n_out_B[slot]].tolist()
            acc = accept_BR[slot, self.rounds[slot]:rounds_B[slot]].tolist()
            self.seen[slot], self.rounds[slot] = n_out_B[slot], rounds_B[slot]
            yield slot, r, new, acc

    def _idle(self, slot: int) -> None:
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = 0.0, 0, 1.0
