"""Host-side preparation shared by the decoders: validation, padding to buckets, results.

Buckets keep shapes static: a new prompt length or batch size inside a bucket reuses the
compiled program.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

MIN_PROMPT_BUCKET = 16
MIN_CACHE_BUCKET = 256


def next_pow2(n: int, minimum: int = 1) -> int:
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def cache_bucket(n: int) -> int:
    """Cache slots for n: the next of 256, 384, 512, 768, 1024, 1536, ... (powers of two and 1.5x
    them: at most a third of the slots unused, few distinct decode programs)."""
    p = next_pow2(n, MIN_CACHE_BUCKET)
    return p * 3 // 4 if p * 3 // 4 >= n and p > MIN_CACHE_BUCKET else p


@dataclasses.dataclass(frozen=True)
class Batch:
    prompt_BP: np.ndarray  # int32, right-padded with 0
    prompt_len_B: np.ndarray  # int32; padded rows have length 1 and are done from the start
    num_rows: int  # real rows (the rest is bucket padding)
    max_new: int  # max_new_tokens rounded up to a power of two (no program depends on it)
    cache_len: int  # static cache slots (the cache bucket: keys the decode program)


def prepare_batch(prompts: Sequence[Sequence[int]], max_new_tokens: int, *, vocab_size: int,
                  max_positions: int, slack: int, batch_multiple: int = 1,
                  cache_len: Optional[int] = None) -> Batch:
    """Validate prompts and pad to (batch bucket, prompt bucket); raise ValueError before any work."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of token-id lists")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise ValueError(f"prompt {i} is a string: tokenize it first (list of token ids)")
        arr = np.asarray(list(p), dtype=np.int64)
        if arr.size == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if arr.ndim != 1:
            raise ValueError(f"prompt {i} must be a flat list of token ids")
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
        rows.append(arr.astype(np.int32))
    longest = max(len(r) for r in rows)
    if longest + max_new_tokens > max_positions:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the "
                         f"model's {max_positions} positions")
    P = next_pow2(longest, MIN_PROMPT_BUCKET)
    M = next_pow2(max_new_tokens, 16)
    # the prefill writes P slots; the decode needs prompt + new tokens + a round's scratch slots
    need = max(P, longest + max_new_tokens + slack)
    if cache_len is None:
        S = cache_bucket(need)
    else:
        S = cache_len
        if need > S:
            raise ValueError(f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} "
                             f"(+{slack} tree slots) does not fit a cache of {S}")
    B = round_up(next_pow2(len(rows)), batch_multiple)
    prompt = np.zeros((B, P), np.int32)
    plen = np.ones((B,), np.int32)
    for i, r in enumerate(rows):
        prompt[i, :len(r)] = r
        plen[i] = len(r)
    return Batch(prompt, plen, len(rows), M, S)


@dataclasses.dataclass
class GenerateOutput:
    tokens: list  # per prompt: new token ids (EOS kept, nothing after it)
    accept_lengths: Optional[list] = None  # per prompt: tokens added per round (EAGLE-2 only)
    rounds: Optional[list] = None

    @property
    def tau(self) -> Optional[float]:
        if not self.accept_lengths:
            return None
        flat = [a for row in self.accept_lengths for a in row]
        return float(np.mean(flat)) if flat else None


def eos_value(eos_token_id) -> int:
    return -1 if eos_token_id is None else int(eos_token_id)
