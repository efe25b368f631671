"""The host's side of the slots, in one object: which request each slot holds and the per-row
sampling values the rounds take.

The device state (serving.slots) and this table change together: the engine admits into a slot
(`put`), packs a row lower (`move`) and frees a slot (`clear`); each dispatch's new tokens come in its
compact result (slots.Dispatch), so the table keeps no read offsets.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..config import SamplingConfig
from ..decoding.sampling import SamplingParams


class SlotTable:
    def __init__(self, slots: int):
        self.requests: dict = {}  # slot -> request (anything with .slot and .sampling)
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
        """`r` now holds `slot`."""
        r.slot, self.requests[slot] = slot, r
        s: SamplingConfig = r.sampling
        self.temperature[slot] = 0.0 if s.greedy else s.temperature
        self.top_k[slot], self.top_p[slot] = s.top_k, s.top_p

    def move(self, src: int, dst: int) -> None:
        """The request in `src` now holds `dst` (the device row was copied there)."""
        r = self.requests.pop(src)
        r.slot, self.requests[dst] = dst, r
        for a in (self.temperature, self.top_k, self.top_p):
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

    def _idle(self, slot: int) -> None:
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = 0.0, 0, 1.0
