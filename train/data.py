"""Self-distillation data: prompts -> target-written responses -> token ids + loss masks.

    python -m train.data --out runs/data/smollm2 --max-prompts 1500

Prompts come from ShareGPT (`conversations`), Alpaca (`instruction`/`input`) and EAGLE/MT-bench
(`turns`) files; empty and duplicate prompts, and every prompt that also occurs in the evaluation
sets, are dropped. Each prompt is rendered with the target's chat template and the target writes
the response with batched on-device decoding. Output: shards `shard_XXXXX.npz` with
`tokens` (concatenated int32), `offsets` (example starts), `loss_mask` (1 on assistant tokens).
A shard is written atomically; a restart skips the shards that exist.
"""
from __future__ import annotations

import glob
import json
import os
import re
import time
from typing import Iterable

import numpy as np
from tqdm import tqdm

import eagle2_jax as e2
from infer.cli import Parser, fail, nonneg_float, nonneg_int, positive_int, writable_dir

DEFAULT_SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))
DEFAULT_TRAIN_FILES = ("train/sharegpt_v3_filtered_1000.json", "train/alpaca_en_demo_1k.json",
                       "train/sharegpt_v3_filtered_500.json", "train/alpaca_seed_tasks.jsonl",
                       "train/sharegpt_sg90k_first_sampled_sorted.json")
EVAL_FILES = ("eval/mt_bench.jsonl", "eval/humaneval.jsonl", "eval/gsm8k.jsonl", "eval/alpaca.jsonl")


def _records(path: str) -> list:
    with open(path) as f:
        try:
            if path.endswith(".jsonl"):
                recs = []
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            recs.append(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise ValueError(f"{path}, line {n}: not JSON ({e.msg})") from None
            else:
                data = json.load(f)
                recs = data if isinstance(data, list) else [data]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    if not all(isinstance(r, dict) for r in recs):
        raise ValueError(f"{path}: expected JSON objects (records), one per line or in a list")
    return recs


def prompt_of(rec: dict) -> str:
    """First user turn of a record in any of the supported formats ('' if none)."""
    if "conversations" in rec:  # ShareGPT
        for turn in rec["conversations"]:
            if turn.get("from") in ("human", "user"):
                return str(turn.get("value", ""))
        return ""
    if "turns" in rec:  # EAGLE / MT-bench
        return str(rec["turns"][0]) if rec["turns"] else ""
    if "instruction" in rec:  # Alpaca (+ seed tasks with `instances`)
        inp = rec.get("input") or ""
        if not inp and rec.get("instances"):
            inp = rec["instances"][0].get("input") or ""
        return f"{rec['instruction']}\n\n{inp}".strip() if inp else str(rec["instruction"])
    return ""


def response_of(rec: dict) -> str:
    """The record's own first assistant answer ('' if none): ShareGPT `gpt` turn, Alpaca `output`."""
    if "conversations" in rec:
        turns = rec["conversations"]
        for i, turn in enumerate(turns):
            if turn.get("from") in ("human", "user"):
                for nxt in turns[i + 1:]:
                    if nxt.get("from") in ("gpt", "assistant", "chatgpt"):
                        return str(nxt.get("value", ""))
                return ""
        return ""
    if "output" in rec:
        return str(rec["output"] or "")
    if rec.get("instances"):
        return str(rec["instances"][0].get("output") or "")
    return ""


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def eval_prompts(shared_data: str) -> set:
    out = set()
    for rel in EVAL_FILES:
        path = os.path.join(shared_data, rel)
        if os.path.exists(path):
            for rec in _records(path):
                for turn in rec.get("turns", []):
                    out.add(normalize(turn))
    return out


def load_prompts(paths: Iterable[str], exclude: set, with_responses: bool = False) -> list:
    """Non-empty, de-duplicated prompts (first occurrence wins) that are not in `exclude`.

    With `with_responses`, returns (prompt, the record's own response) pairs with a non-empty response.
    """
    seen, out = set(exclude), []
    for path in paths:
        for rec in _records(path):
            p = prompt_of(rec).strip()
            key = normalize(p)
            if not key or key in seen:
                continue
            if with_responses:
                r = response_of(rec).strip()
                if not r:
                    continue
                seen.add(key)
                out.append((p, r))
            else:
                seen.add(key)
                out.append(p)
    return out


def render_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt in the chat template; for a base model (no template) as plain text after the
    tokenizer's special tokens (Gemma's BOS), ending a paragraph for the model to continue."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(prompt.strip() + "\n\n", add_special_tokens=True)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def example(prompt_ids: list[int], response_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and loss mask: 1 exactly on the assistant's tokens (its end-of-turn token included)."""
    ids = np.asarray(list(prompt_ids) + list(response_ids), np.int32)
    mask = np.zeros(len(ids), np.uint8)
    mask[len(prompt_ids):] = 1
    return ids, mask


def write_shard(path: str, examples: list) -> None:
    tokens = np.concatenate([e[0] for e in examples])
    mask = np.concatenate([e[1] for e in examples])
    offsets = np.cumsum([0] + [len(e[0]) for e in examples]).astype(np.int64)
    tmp = path + ".tmp.npz"
    np.savez(tmp, tokens=tokens, loss_mask=mask, offsets=offsets)
    os.replace(tmp, path)


def read_shards(directory: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """All examples of all shards, in shard order: [(ids, loss_mask)]."""
    out = []
    files = sorted(glob.glob(os.path.join(directory, "shard_*.npz")))
    if not files:
        raise FileNotFoundError(f"no shard_*.npz in {directory}: run python -m train.data first")
    for fn in files:
        z = np.load(fn)
        off = z["offsets"]
        for i in range(len(off) - 1):
            out.append((z["tokens"][off[i]:off[i + 1]], z["loss_mask"][off[i]:off[i + 1]]))
    return out


def main(argv=None):
    ap = Parser(prog="python -m train.data", description=__doc__)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="target model (name, HF dir or .gguf)")
    ap.add_argument("--out", type=writable_dir, required=True,
                    help="output directory for shard_*.npz (a rerun with the same settings resumes)")
    ap.add_argument("--shared-data", default=DEFAULT_SHARED, help="the shared data folder (train/ and eval/)")
    ap.add_argument("--files", nargs="*", default=None, help="prompt files (default: all of shared train/)")
    ap.add_argument("--max-prompts", type=positive_int, default=1500, help="use at most this many prompts")
    ap.add_argument("--max-prompt-tokens", type=positive_int, default=384, help="skip longer rendered prompts")
    ap.add_argument("--max-new-tokens", type=positive_int, default=256, help="response length cap")
    ap.add_argument("--temperature", type=nonneg_float, default=0.0, help="response sampling temperature (0: greedy)")
    ap.add_argument("--batch-size", type=positive_int, default=16, help="prompts decoded together")
    ap.add_argument("--shard-size", type=positive_int, default=64, help="examples per shard")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the target's dtype while it writes the responses (default float32)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed at --temperature > 0 (default 0)")
    ap.add_argument("--responses", choices=["target", "dataset"], default="target",
                    help="target: the target writes the responses (self-distillation); dataset: use the files' own "
                         "answers (no generation; the loss still uses the target's distributions)")
    ap.add_argument("--skip", type=nonneg_int, default=0, help="skip the first N usable prompts (e.g. those self-distilled)")
    args = ap.parse_args(argv)
    files = args.files or [os.path.join(args.shared_data, f) for f in DEFAULT_TRAIN_FILES]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        fail(f"prompt file not found: {missing[0]}")
    meta = {"target": args.target, "skip": args.skip, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "files": [os.path.relpath(x, args.shared_data) for x in files],
            "dtype": args.dtype, "shard_size": args.shard_size, "max_prompt_tokens": args.max_prompt_tokens}
    if args.temperature > 0:  # (what sampled responses also depend on: batches draw from seed, shard, batch)
        meta.update(seed=args.seed, batch_size=args.batch_size)
    if args.responses == "target":
        check_resume(args.out, meta)
    try:
        if args.responses == "dataset":
            return _dataset_responses(args, files)
        prompts = load_prompts(files, eval_prompts(args.shared_data))
        target = e2.load_target(args.target, dtype=args.dtype)
    except (e2.CheckpointError, ValueError) as e:
        fail(str(e))
    tok = target.tokenizer
    rendered, usable = [], 0
    for p in prompts:
        ids = render_prompt(tok, p)
        if len(ids) > args.max_prompt_tokens:
            continue
        usable += 1
        if usable > args.skip:
            rendered.append(ids)
        if len(rendered) >= args.max_prompts:
            break
    if not rendered:
        fail(f"no usable prompts left after --skip {args.skip} ({usable} usable in {len(files)} files)")
    shards = [rendered[i:i + args.shard_size] for i in range(0, len(rendered), args.shard_size)]
    meta.update(prompts=len(rendered), shards=len(shards))
    check_resume(args.out, meta)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    eos = target.config.eos_token_id
    todo = [i for i in range(len(shards)) if not os.path.exists(os.path.join(args.out, f"shard_{i:05d}.npz"))]
    bar = tqdm(total=len(rendered), initial=(len(shards) - len(todo)) * args.shard_size, unit="prompt",
               desc="responses", dynamic_ncols=True)
    t0, new_tokens = time.time(), 0
    for si in todo:
        batch = shards[si]
        order = np.argsort([len(x) for x in batch])  # similar prompt lengths decode together
        examples = [None] * len(batch)
        for j in range(0, len(batch), args.batch_size):
            idx = order[j:j + args.batch_size]
            out = e2.generate_vanilla(target, [batch[i] for i in idx], max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, eos_token_id=eos, seed=args.seed + si * 1000 + j)
            for i, resp in zip(idx, out.tokens):
                examples[i] = example(batch[i], resp)
                new_tokens += len(resp)
            bar.update(len(idx))
            bar.set_postfix(tok_s=f"{new_tokens / (time.time() - t0):.0f}")
        write_shard(os.path.join(args.out, f"shard_{si:05d}.npz"), examples)
    bar.close()
    print(f"{len(rendered)} examples in {len(shards)} shards at {args.out}")


def check_resume(out: str, meta: dict):
    """A rerun into `out` continues the run there: refuse one whose shards would differ. The shards
    are kept by index, so the settings that decide their contents must match those in meta.json
    (the ones it records), and the prompt count may change only where the last old shard is full."""
    shards = glob.glob(os.path.join(out, "shard_*.npz"))
    path = os.path.join(out, "meta.json")
    if not shards or not os.path.exists(path):
        return
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{path} is unreadable ({e}): use another --out")
    diff = sorted(k for k in old if k in meta and k not in ("prompts", "shards") and old[k] != meta[k])
    if "shard_size" not in old and "prompts" in old and "shards" in old:  # (older runs: implied by the counts)
        if -(-old["prompts"] // meta["shard_size"]) != old["shards"]:
            diff.append("shard_size")
    if diff:
        fail(f"{out} holds shards written with other settings ({', '.join(diff)}): use another --out, or the "
             f"same settings to resume")
    if "prompts" not in meta or old.get("prompts") in (None, meta["prompts"]):
        return
    if meta["prompts"] < old["prompts"]:
        fail(f"{out} holds {old['prompts']} prompts: resume with --max-prompts {old['prompts']} (or more), or use "
             "another --out")
    if old["prompts"] % meta["shard_size"]:
        fail(f"{out} holds {old['prompts']} prompts, its last shard partial: resume with --max-prompts "
             f"{old['prompts']}, or use another --out")


def _dataset_responses(args, files):
    pairs = load_prompts(files, eval_prompts(args.shared_data), with_responses=True)[args.skip:]
    tok = e2.load_target(args.target, dtype=args.dtype).tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
    examples = []
    for p, r in pairs:
        ids = render_prompt(tok, p)
        if len(ids) > args.max_prompt_tokens:
            continue
        resp = tok.encode(r, add_special_tokens=False)[:args.max_new_tokens - 1] + [eos]
        examples.append(example(ids, resp))
        if len(examples) >= args.max_prompts:
            break
    os.makedirs(args.out, exist_ok=True)
    for i in range(0, len(examples), args.shard_size):
        write_shard(os.path.join(args.out, f"shard_{i // args.shard_size:05d}.npz"), examples[i:i + args.shard_size])
    print(f"{len(examples)} examples with dataset responses at {args.out}")


if __name__ == "__main__":
    main()
