"""A disk cache of the target's features for the packed training sequences.

The target is frozen, so its last-layer features for a training sequence never change; computing
them once (float16, [n_seqs, T, D] in one memory-mapped .npy) instead of in every step takes the
target forward out of the training loop. Filling is resumable: rows are written in order and
`progress.json` records how many are done and a fingerprint of what they were computed from
(target, dtype, sequence length, the token ids), so a changed input starts a fresh cache instead of
reusing stale rows.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

STORE_DTYPE = np.float16


def fingerprint(seqs, target_source: str, dtype: str) -> str:
    h = hashlib.sha256(f"{target_source}|{dtype}|{len(seqs)}".encode())
    for ids, _ in seqs:
        h.update(np.ascontiguousarray(ids, np.int32).tobytes())
    return h.hexdigest()[:16]


class FeatureCache:
    """features.npy [n, T, D] float16 + progress.json {done, fingerprint}."""

    def __init__(self, directory: str, n: int, T: int, D: int, key: str):
        self.dir, self.key = directory, key
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "features.npy")
        self.meta = os.path.join(directory, "progress.json")
        shape = (n, T, D)
        prog = self._progress()
        fresh = prog.get("fingerprint") != key or not os.path.exists(self.path)
        if not fresh:
            try:
                self.array = np.load(self.path, mmap_mode="r+")
                fresh = self.array.shape != shape or self.array.dtype != STORE_DTYPE
            except (ValueError, OSError):
                fresh = True
        if fresh:
            self.array = np.lib.format.open_memmap(self.path, mode="w+", dtype=STORE_DTYPE, shape=shape)
            self._write_progress(0)

    def _progress(self) -> dict:
        try:
            with open(self.meta) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _write_progress(self, done: int):
        tmp = self.meta + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"done": done, "fingerprint": self.key}, f)
        os.replace(tmp, self.meta)

    @property
    def done(self) -> int:
        return int(self._progress().get("done", 0))

    def fill(self, seqs, compute, batch_size: int, progress: bool = True):
        """Compute rows done..n with compute(ids [b, T]) -> features [b, T, D]; resumable."""
        from tqdm import tqdm
        n, T = self.array.shape[:2]
        start = self.done
        if start >= n:
            return
        bar = tqdm(total=n, initial=start, unit="seq", desc="target features", disable=not progress,
                   dynamic_ncols=True)
        for lo in range(start, n, batch_size):
            hi = min(lo + batch_size, n)
            ids = np.zeros((batch_size, T), np.int32)
            for r, (t, _) in enumerate(seqs[lo:hi]):
                ids[r, :len(t[:T])] = t[:T]
            feats = np.asarray(compute(ids), dtype=np.float32)[:hi - lo]
            self.array[lo:hi] = feats.astype(STORE_DTYPE)
            self.array.flush()
            self._write_progress(hi)
            bar.update(hi - lo)
        bar.close()

    def rows(self, index) -> np.ndarray:
        return np.asarray(self.array[np.asarray(index)])
