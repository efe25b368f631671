"""What a draft-training run steps through: its training and held-out examples, their seeded order,
and the packed batches (`Batcher`)."""
from __future__ import annotations

import sys
import zlib

import jax
import numpy as np

from train.data import read_shards


def read_examples(dirs: list, heldout_examples: int) -> tuple[list, list]:
    """(training examples, held-out examples) of the shard directories `dirs`: the held-out ones are the
    last of the first (self-distilled) set, the rest of it and every other set train."""
    try:
        sets = [read_shards(d) for d in dirs]
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    if len(sets[0]) <= heldout_examples:
        sys.exit(f"error: {len(sets[0])} examples in {dirs[0]}: need more than heldout_examples")
    heldout = sets[0][-heldout_examples:]
    train = sets[0][:-heldout_examples] + [e for s in sets[1:] for e in s]
    print(f"{len(train)} training examples from {', '.join(dirs)}; {len(heldout)} held out")
    return train, heldout


def data_order_seed(seed: int, init_params) -> int:
    """The batch order's seed for a run that starts from a trained head: `seed` mixed with a
    fingerprint of that head's weights. Chained runs (each --init-from the last one's export) then
    do not replay the batches every run began with; a resumed run starts from the same head and
    keeps its order."""
    first = np.ascontiguousarray(np.asarray(jax.tree_util.tree_leaves(init_params)[0]))
    return (int(seed) + zlib.crc32(first.tobytes())) % 2**31


class Batcher:
    """Deterministic batches of packed sequences that never attend across examples.

    Examples (cropped to `example_len` tokens) are cut into pieces of at most seq_len tokens and
    the pieces, in a seeded order, are packed best-fit into sequences of seq_len, so few steps are
    spent on padding. Each sequence carries a segment id per token (1, 2, ... per piece, 0 on
    padding) and each token its position in its example: attention stays within a piece and RoPE
    sees the positions the example has at inference. Step s takes sequences [s*B, (s+1)*B) of the
    concatenation of per-epoch permutations, so a resumed run sees exactly the batches it would
    have seen. `pack=False` (held-out evaluation): one example per sequence, cropped to seq_len.
    """

    def __init__(self, examples, batch_size, seq_len, seed, pack: bool = True, example_len: int = 2048):
        self.B, self.T, self.seed = batch_size, seq_len, seed
        self.examples = [(np.asarray(t)[:example_len], np.asarray(m)[:example_len]) for t, m in examples]
        order = np.random.default_rng(seed).permutation(len(examples))
        if not pack:
            self.seqs = [[(int(i), 0, min(len(self.examples[i][0]), seq_len))] for i in order]
        else:
            pieces = [(int(i), s, min(s + seq_len, len(self.examples[i][0])))
                      for i in order for s in range(0, len(self.examples[i][0]), seq_len)]
            self.seqs = []
            by_room = [[] for _ in range(seq_len + 1)]  # sequences by their free tokens
            for p in pieces:
                n = p[2] - p[1]
                room = next((r for r in range(n, seq_len + 1) if by_room[r]), None)
                if room is None:
                    self.seqs.append([])
                    k, room = len(self.seqs) - 1, seq_len
                else:
                    k = by_room[room].pop()
                self.seqs[k].append(p)
                by_room[room - n].append(k)
        self._perms = {}

    def __len__(self):
        return len(self.seqs)

    def _perm(self, epoch):
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng(self.seed + 1 + epoch).permutation(len(self.seqs))
        return self._perms[epoch]

    def indices(self, step):
        n = len(self.seqs)
        return [int(self._perm(g // n)[g % n]) for g in range(step * self.B, (step + 1) * self.B)]

    def batch(self, step):
        """(ids, loss mask, segment ids, positions), each [B, T] int32."""
        ids, mask, seg, pos = (np.zeros((self.B, self.T), np.int32) for _ in range(4))
        for r, k in enumerate(self.indices(step)):
            at = 0
            for j, (i, s, e) in enumerate(self.seqs[k]):
                t, m = self.examples[i]
                ids[r, at:at + e - s], mask[r, at:at + e - s] = t[s:e], m[s:e]
                seg[r, at:at + e - s], pos[r, at:at + e - s] = j + 1, np.arange(s, e)
                at += e - s
        return ids, mask, seg, pos

    def features(self, step, cache) -> np.ndarray:
        """The step's target features [B, T, F] from a train.features.FeatureCache (zeros on padding)."""
        out = np.zeros((self.B, self.T, cache.width), np.float16)
        for r, k in enumerate(self.indices(step)):
            at = 0
            for i, s, e in self.seqs[k]:
                out[r, at:at + e - s] = cache.example(self.examples[i][0])[s:e]
                at += e - s
        return out
