"""A disk cache of the target's features, one entry per training example.

Each example's features are computed on the example alone: positions from 0, attending only to its
own tokens, as the target computes them at inference. (Features of a packed sequence under a plain
causal mask are not that: on SmolLM2 with the previous examples in context, 20% of the feature norm
differs and the target's next token changes at 8% of the assistant positions.) So an entry depends
only on the example's tokens and on the target, its dtype and the layers read (the `fingerprint`,
one subdirectory each), and a data set that adds examples computes only the new ones.

Layout of `<dir>/<fingerprint>/`: `chunk_NNNNN.npy` files of [tokens, F] float16 rows, one per
batch of examples, and `index.jsonl`, one line {"key", "chunk", "offset", "length"} per example,
appended only after its chunk is on disk; a fill that is interrupted resumes with the examples
the index lacks.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

STORE_DTYPE = np.float16
LENGTH_BUCKET = 128  # examples are padded to a multiple of this: few shapes, few compiles


def fingerprint(target_source: str, dtype: str, aux_layers=()) -> str:
    return hashlib.sha256(f"{target_source}|{dtype}|aux{tuple(aux_layers)}".encode()).hexdigest()[:16]


def example_key(ids) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, np.int32).tobytes()).hexdigest()[:24]


class FeatureCache:
    """Per-example target features [length, F] (float16) on disk, keyed by the example's tokens."""

    def __init__(self, directory: str, width: int, key: str):
        self.dir, self.width = os.path.join(directory, key), width
        os.makedirs(self.dir, exist_ok=True)
        self.index_path = os.path.join(self.dir, "index.jsonl")
        self.index: dict[str, tuple[int, int, int]] = {}
        self._chunks: dict[int, np.ndarray] = {}
        if os.path.exists(self.index_path):
            with open(self.index_path) as f:
                for line in f:
                    try:
                        r = json.loads(line)
                    except ValueError:  # a line cut short by a kill: its chunk is redone
                        continue
                    if os.path.exists(self._chunk_path(r["chunk"])):
                        self.index[r["key"]] = (r["chunk"], r["offset"], r["length"])
        self._next_chunk = 1 + max((c for c, _, _ in self.index.values()), default=-1)

    def _chunk_path(self, c: int) -> str:
        return os.path.join(self.dir, f"chunk_{c:05d}.npy")

    def missing(self, examples) -> list[int]:
        """Indices of examples (token arrays) without an entry, one per distinct example."""
        seen, out = set(), []
        for i, ids in enumerate(examples):
            k = example_key(ids)
            if k not in self.index and k not in seen:
                seen.add(k)
                out.append(i)
        return out

    def fill(self, examples, compute, token_budget: int, progress: bool = True) -> int:
        """Compute the missing entries with compute(ids [b, L]) -> [b, L, F], examples alone
        (right-padded, a causal mask keeps padding out of them), similar lengths batched:
        L a multiple of LENGTH_BUCKET, b = token_budget // L. Returns the tokens computed."""
        from tqdm import tqdm
        todo = sorted(self.missing(examples), key=lambda i: len(examples[i]))
        if not todo:
            return 0
        groups: list[list[int]] = []
        for i in todo:
            L = -(-len(examples[i]) // LENGTH_BUCKET) * LENGTH_BUCKET
            if groups and self._bucket(examples, groups[-1]) == L and len(groups[-1]) < max(1, token_budget // L):
                groups[-1].append(i)
            else:
                groups.append([i])
        total = sum(len(examples[i]) for i in todo)
        bar = tqdm(total=total, unit="tok", unit_scale=True, desc="target features", disable=not progress,
                   dynamic_ncols=True)
        with open(self.index_path, "a") as index:
            for g in groups:
                L = self._bucket(examples, g)
                ids = np.zeros((max(1, token_budget // L), L), np.int32)
                for r, i in enumerate(g):
                    ids[r, :len(examples[i])] = examples[i]
                feats = np.asarray(compute(ids), dtype=np.float32)
                lengths = [len(examples[i]) for i in g]
                rows = np.concatenate([feats[r, :n] for r, n in enumerate(lengths)]).astype(STORE_DTYPE)
                c = self._next_chunk
                self._next_chunk += 1
                tmp = self._chunk_path(c) + ".tmp.npy"
                np.save(tmp, rows)
                os.replace(tmp, self._chunk_path(c))
                offset = 0
                for i, n in zip(g, lengths):
                    k = example_key(examples[i])
                    index.write(json.dumps({"key": k, "chunk": c, "offset": offset, "length": n}) + "\n")
                    self.index[k] = (c, offset, n)
                    offset += n
                index.flush()
                bar.update(sum(lengths))
        bar.close()
        return total

    @staticmethod
    def _bucket(examples, group) -> int:
        return -(-max(len(examples[i]) for i in group) // LENGTH_BUCKET) * LENGTH_BUCKET

    def example(self, ids) -> np.ndarray:
        """The cached features [len(ids), F] of an example (KeyError when missing)."""
        c, offset, n = self.index[example_key(ids)]
        if c not in self._chunks:
            self._chunks[c] = np.load(self._chunk_path(c), mmap_mode="r")
        return self._chunks[c][offset:offset + n]
