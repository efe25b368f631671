"""The default tree per platform and batch size, shared by the library and the command line.

A head's `tree.json` may give one tree per platform ({"cpu": {...}, "gpu": {...}, "tpu": {...}})
or one flat tree (tuned on the CPU it was measured on: used there only). Without one, the
reference tree (depth 5, top_k 10, 60 tokens) everywhere: on GPU/TPU extra verified rows are nearly
free. An entry may add `"by_batch": {"<batch size>": total_tokens or "plain", ...}`: trees timed
per batch size ("plain": none pays there). `tree="auto"` (library) / `--total-tokens auto` (CLI) instead times rounds on the machine at
hand. `autotune.resolve_tree` combines these with the caller's fields.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from ..config import TreeConfig
from ..platform import platform

REFERENCE_TREE = TreeConfig(5, 10, 60)
TREE_FILE = "tree.json"


def head_tree(source: Optional[str], backend: Optional[str] = None) -> dict:
    """The tree fields a head's tree.json gives for this platform ({} when none)."""
    path = os.path.join(source or "", TREE_FILE)
    if not source or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt {path}: {e}") from None
    keys = ("depth", "top_k", "total_tokens")
    if any(k in d for k in keys):  # one flat tree: the CPU's
        d = d if platform(backend) == "cpu" else {}
    else:
        d = d.get(platform(backend), {})
    by_batch = d.get("by_batch")
    if by_batch is not None and not (isinstance(by_batch, dict) and all(
            str(b).isdigit() and int(b) >= 1 and (v == "plain" or (isinstance(v, int) and v >= 1))
            for b, v in by_batch.items())):
        raise ValueError(f"corrupt {path}: by_batch maps batch sizes to total_tokens or \"plain\", got {by_batch!r}")
    out = {k: v for k, v in d.items() if k in keys}
    return {**out, "by_batch": {int(b): v for b, v in by_batch.items()}} if by_batch else out


def for_batch(by_batch: dict, batch: int):
    """The entry of a tree.json's by_batch table for `batch` rows: that of the largest batch size
    listed at or below it (the smallest listed, below them all): total_tokens or "plain"."""
    sizes = sorted(by_batch)
    below = [b for b in sizes if b <= batch]
    return by_batch[below[-1] if below else sizes[0]]
