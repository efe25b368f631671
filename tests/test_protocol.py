"""The server's request models (infer.protocol) and its text stream (serving.detokenize), without a
server: every field typed and bounded, errors naming the field, unsupported fields refused; streamed
text with stop strings equal to the whole text cut at the first stop, over many stop strings and two
tokenizers (byte-level BPE and SentencePiece)."""
import json
import random

import pytest
from pydantic import ValidationError

from eagle2_jax.loading.registry import NAMED_TOKENIZERS, shipped_tokenizer
from eagle2_jax.serving.detokenize import TextStream
from infer.protocol import ChatRequest, CompletionRequest, error_param

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def check(model, body):
    """(message, param) of the refusal, or None when the body passes."""
    try:
        model.model_validate_json(json.dumps(body) if not isinstance(body, bytes) else body)
        return None
    except ValidationError as e:
        return error_param(e)


@pytest.mark.parametrize("extra, param", [
    ({"top_k": 2 ** 31}, "top_k"), ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"seed": -1}, "seed"), ({"seed": 2 ** 32}, "seed"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"), ({"max_tokens": "3"}, "max_tokens"),
    ({"max_tokens": 2 ** 31}, "max_tokens"), ({"n": 2}, "n"), ({"stream": "yes"}, "stream"),
    ({"stream_options": "yes"}, "stream_options"), ({"stream_options": {"include_usage": 1}},
                                                    "stream_options.include_usage"),
    ({"stop": ["a", ""]}, "stop"), ({"stop": ["a"] * 5}, "stop"), ({"stop": 3}, "stop"),
    ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": None, "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"), ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"frobnicate": 1}, "frobnicate"), ({"model": 3}, "model"), ({"user": "u1"}, "user"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
])
def test_chat_fields_are_typed_bounded_and_named(extra, param):
    got = check(ChatRequest, {**CHAT, **extra})
    assert got is not None, extra
    message, where = got
    assert where == param and message.startswith(param) and "\n" not in message


@pytest.mark.parametrize("body", [
    {**CHAT, "max_tokens": 2.0, "temperature": 0.5, "top_k": 2 ** 31 - 1, "seed": 2 ** 32 - 1},
    {**CHAT, "stop": "x", "stream": True, "stream_options": {"include_usage": True}, "user": None},
    {**CHAT, "presence_penalty": 0, "logprobs": False, "tools": [], "tool_choice": "none", "logit_bias": {},
     "response_format": {"type": "text"}, "n": 1},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}]},
])
def test_chat_bodies_that_pass(body):
    assert check(ChatRequest, body) is None


def test_content_parts_join_and_integral_floats_become_ints():
    r = ChatRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                               {"type": "text", "text": "b"}]}],
                                    "max_tokens": 3.0})
    assert r.messages[0].text == "ab" and r.max_tokens == 3 and isinstance(r.max_tokens, int)


@pytest.mark.parametrize("prompt, want", [("Hi", "Hi"), (["Hi"], "Hi"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])])
def test_completion_prompts_accepted_as_vllm_accepts_them(prompt, want):
    assert CompletionRequest.model_validate({"prompt": prompt}).one_prompt == want


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, -2]}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": None}, "prompt"), ({}, "prompt"), ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "logprobs": 3}, "logprobs"), ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": [[1], [2]]}, "prompt"),
])
def test_completion_refusals_name_the_field(body, param):
    message, where = check(CompletionRequest, body)
    assert where == param and message.startswith(param)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"null", b'"x"', b"\xff\xfe"])
def test_bodies_that_are_not_an_object(raw):
    message, where = check(CompletionRequest, raw)
    assert where is None and "JSON" in message


def test_openapi_schema_is_the_models():
    s = ChatRequest.model_json_schema()
    assert s["additionalProperties"] is False and "messages" in s["required"]
    assert s["properties"]["top_k"]["maximum"] == 2 ** 31 - 1


@pytest.fixture(scope="module", params=sorted(NAMED_TOKENIZERS))
def tokenizer(request):
    return shipped_tokenizer(NAMED_TOKENIZERS[request.param])


TEXTS = ["Hello, world! Here's some text with émojis 😀 and ünïcode… and\n\nnewlines.  Double  spaces.",
         "def f(x):\n    return x ** 2  # square\n\nprint(f(3))", "中文字符和日本語のテキスト。Mixed with English.",
         "The answer is 42.\n\nThe end. THE END. the end!"]


def stream(tokenizer, ids, stops, chunk=1):
    """Text handed out as a server would: tokens in chunks, stopping at a stop string."""
    ts, out = TextStream(tokenizer, stops), []
    for i in range(0, len(ids), chunk):
        for t in ids[i:i + chunk]:
            out.append(ts.push(t))
        if ts.stopped:
            break
    out.append(ts.finish())
    return out, ts


def test_streamed_text_equals_the_whole_text_without_stops(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        out, ts = stream(tokenizer, ids, [])
        assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True) and ts.used == len(ids)


def test_streamed_text_with_stop_strings_equals_the_cut_whole_text(tokenizer):
    """Every short substring of each text as a stop string (and pairs of them): the pieces never hold
    any part of a stop string, and together they are the text before the stop string that appears
    first; `used` counts the tokens up to the one that completed it."""
    rng = random.Random(0)
    cases = 0
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        subs = sorted({full[i:i + n] for n in (1, 2, 3, 6) for i in range(len(full) - n + 1)})
        for stops in [[s] for s in subs] + [rng.sample(subs, 2) for _ in range(40)]:
            out, ts = stream(tokenizer, ids, stops, chunk=rng.choice([1, 3]))
            # generation stops at the first token after which some stop string has appeared; the text
            # ends where the earliest stop string then present begins
            need = next(n for n in range(1, len(ids) + 1)
                        if any(s in tokenizer.decode(ids[:n], skip_special_tokens=True) for s in stops))
            seen = tokenizer.decode(ids[:need], skip_special_tokens=True)
            cut = min(seen.find(s) for s in stops if s in seen)
            assert "".join(out) == full[:cut], (stops, out)
            assert ts.stopped and ts.used == need
            cases += 1
    assert cases > 500
