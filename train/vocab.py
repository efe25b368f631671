"""Pick the draft's vocabulary: the most frequent assistant tokens of the training data.

    python -m train.vocab --data runs/data/smollm2,runs/data/smollm2_dataset --size 8192 \\
        --out eagle2_jax/heads/smollm2-135m-instruct/draft_vocab.json

The draft then ranks only these tokens (a V/size cheaper LM head per draft pass); verification
still uses the full vocabulary, so outputs are unchanged. Held-out examples (the last
`--heldout-examples` of the first directory, as in train.draft) are not counted.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from train.data import read_shards


def ranked_tokens(examples) -> np.ndarray:
    """The assistant tokens of `examples`, most frequent first (ties: lower id first)."""
    toks = np.concatenate([t[m == 1] for t, m in examples]) if examples else np.zeros(0, np.int64)
    counts = np.bincount(toks.astype(np.int64)) if toks.size else np.zeros(1, np.int64)
    order = np.argsort(-counts, kind="stable")
    return order[counts[order] > 0]


def frequent_tokens(examples, size: int, always=()) -> np.ndarray:
    """The `size` most frequent assistant tokens plus `always`, ascending ids."""
    chosen = ranked_tokens(examples)[:size]
    return np.unique(np.concatenate([chosen, np.asarray(always, np.int64)]).astype(np.int64))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m train.vocab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="shard directories, comma-separated")
    ap.add_argument("--size", type=int, default=8192, help="tokens to keep (default 8192)")
    ap.add_argument("--heldout-examples", type=int, default=32)
    ap.add_argument("--always", default="0,1,2", help="ids always kept (special tokens)")
    ap.add_argument("--out", required=True, help="output draft_vocab.json")
    args = ap.parse_args(argv)
    dirs = args.data.split(",")
    ex = read_shards(dirs[0])[:-args.heldout_examples or None]
    for d in dirs[1:]:
        ex += read_shards(d)
    always = [int(x) for x in args.always.split(",") if x.strip()]
    ids = frequent_tokens(ex, args.size, always)
    with open(args.out, "w") as f:
        json.dump({"ids": ids.tolist(), "source": dirs, "size": args.size}, f)
    print(f"{len(ids)} token ids -> {args.out}")


if __name__ == "__main__":
    main()
