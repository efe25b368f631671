"""Prompts the tools share: EAGLE/MT-bench question files (one JSON object a line with "turns") and the
chat rendering of a conversation into token ids."""
from __future__ import annotations

import json
import os

from infer.cli import fail

DEFAULT_QUESTIONS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "eval",
                                                 "mt_bench.jsonl"))


def load_questions(path, limit, categories):
    if not os.path.isfile(path):
        fail(f"question file not found: {path}")
    qs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{path}, line {n}: not JSON ({e.msg})")
            turns = q.get("turns") if isinstance(q, dict) else None
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
                fail(f"{path}, line {n}: expected an object with \"turns\", a list of non-empty strings")
            q.setdefault("question_id", len(qs))  # (rows and --resume key answers by it)
            qs.append(q)
    if categories:
        qs = [q for q in qs if q.get("category") in categories]
    return qs[:limit] if limit else qs


def render(tok, messages):
    """Token ids of a conversation in the chat template; a base model (no template) continues the
    user turns as plain text after BOS, as train.data renders its prompts."""
    if not getattr(tok, "chat_template", None):
        return tok.encode("\n\n".join(m["content"].strip() for m in messages) + "\n\n", add_special_tokens=True)
    s = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(s, add_special_tokens=False)
