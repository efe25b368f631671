"""The OpenAI request bodies `infer.serve` takes, as pydantic models: every field typed and bounded, so
a value that passes fits the dtype it becomes on device, and `/openapi.json` describes the API as it is.

A field is honoured or refused: fields this server does not implement are declared with the one value
that means "off" (e.g. `logprobs: false`, `presence_penalty: 0`) and any other value is a 400 naming
the field; unknown fields are refused too (`extra="forbid"`), never accepted and ignored.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

INT32_MAX = 2 ** 31 - 1
MAX_STOPS = 4
GREEDY_BELOW = 1e-5  # a temperature under this decodes greedily (vLLM's rule): 1/T would overflow float32


def _integer(v: Any) -> Any:
    """JSON Schema's integer: an int, or a float with no fraction (2.0); never a bool or a string."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be an integer")
    if isinstance(v, float):
        if not (math.isfinite(v) and v.is_integer()):
            raise ValueError("must be an integer")
        return int(v)
    return v


def _number(v: Any) -> Any:
    """A finite JSON number; never a bool or a string."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be a number")
    if not math.isfinite(v):
        raise ValueError("must be a finite number")
    return float(v)


def _boolean(v: Any) -> Any:
    if not isinstance(v, bool):
        raise ValueError("must be a boolean")
    return v


def _string(v: Any) -> Any:
    if not isinstance(v, str):
        raise ValueError("must be a string")
    return v


def Int(**bounds):
    """An integer field type with bounds (ge, le, lt, ...); the bounds come before the validator so the
    JSON schema states them (minimum, maximum)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integer)]


def Float(**bounds):
    return Annotated[float, Field(**bounds), BeforeValidator(_number)]


def Str(**bounds):
    return Annotated[str, Field(**bounds), BeforeValidator(_string)]


Bool = Annotated[bool, BeforeValidator(_boolean)]
TokenId = Int(ge=0, le=INT32_MAX)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StreamOptions(_Strict):
    include_usage: Bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: Str()


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[Str(), list[TextPart]] = Field(description="a string or a list of text parts")
    name: Optional[Str()] = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Sampling(_Strict):
    """Fields both endpoints share."""
    model: Optional[Str()] = None
    max_tokens: Optional[Int(ge=1, le=INT32_MAX)] = None
    temperature: Float(ge=0, le=1e4, description=f"0 (or below {GREEDY_BELOW}): greedy") = 0.0
    top_p: Float(gt=0, le=1) = 1.0
    top_k: Int(ge=-1, le=INT32_MAX, description="-1 or 0: off (vLLM's and SGLang's field)") = 0
    seed: Optional[Int(ge=0, lt=2 ** 32)] = None
    n: Int(ge=1, le=1, description="only 1") = 1
    stop: Union[None, Str(min_length=1), Annotated[list[Str(min_length=1)], Field(max_length=MAX_STOPS)]] = None
    stream: Bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[Str(max_length=0, description="not supported: only null or empty")] = None
    # accepted only at the value that means "off"; anything else is refused with a 400 naming the field
    presence_penalty: Float(ge=0, le=0, description="not supported: only 0") = 0.0
    frequency_penalty: Float(ge=0, le=0, description="not supported: only 0") = 0.0
    logit_bias: Optional[dict[str, Any]] = Field(None, description="not supported: only null or {}")

    @model_validator(mode="after")
    def _off(self):
        if self.logit_bias:
            raise ValueError("logit_bias: not supported by this server")
        return self

    @property
    def stops(self) -> list:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a list holding one of those
    (a batch of one); a batch of several is refused (one prompt per request)."""
    prompt: Union[Str(), Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Union[Str(), Annotated[list[TokenId], Field(min_length=1)]]],
                            Field(min_length=1, max_length=1)]]
    echo: Annotated[Bool, Field(description="not supported: only false")] = False
    logprobs: Optional[Int(ge=0, le=0, description="not supported: only null or 0")] = None
    best_of: Optional[Int(ge=1, le=1, description="only 1")] = None
    suffix: Optional[Str(max_length=0, description="not supported: only null or empty")] = None

    @model_validator(mode="after")
    def _echo(self):
        if self.echo:
            raise ValueError("echo: not supported by this server")
        return self

    @property
    def one_prompt(self):
        """The prompt: a string or a list of token ids."""
        p = self.prompt
        return p[0] if isinstance(p, list) and p and not isinstance(p[0], int) else p


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Optional[Int(ge=1, le=INT32_MAX)] = None
    logprobs: Annotated[Bool, Field(description="not supported: only false")] = False
    top_logprobs: Optional[Int(ge=0, le=0, description="not supported: only null or 0")] = None
    response_format: Optional[dict[str, Any]] = Field(None, description='not supported: only {"type": "text"}')
    tools: Optional[Annotated[list[Any], Field(max_length=0, description="not supported: only null or []")]] = None
    tool_choice: Optional[Literal["none"]] = Field(None, description='not supported: only "none"')
    parallel_tool_calls: Optional[Literal[None]] = Field(None, description="not supported: only null (no tools)")

    @model_validator(mode="after")
    def _off(self):
        super()._off()
        if self.logprobs:
            raise ValueError("logprobs: not supported by this server")
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format: only {\"type\": \"text\"} is supported by this server")
        return self


UNSUPPORTED = {"presence_penalty": "0", "frequency_penalty": "0", "logit_bias": "null or {}", "echo": "false",
               "logprobs": "false / null / 0", "top_logprobs": "null or 0", "response_format": '{"type": "text"}',
               "tools": "null or []", "tool_choice": '"none"',
               "user": "null or \"\"", "parallel_tool_calls": "null", "suffix": "null or \"\"", "best_of": "1",
               "n": "1"}
UNION_TYPES = {  # what a field of several accepted shapes takes, said once (pydantic lists every branch)
    "prompt": "must be a string, a list of token ids in [0, 2**31), or a list holding one of those "
              "(one prompt per request)",
    "stop": f"must be a non-empty string or a list of up to {MAX_STOPS} non-empty strings",
    "content": 'must be a string or a list of {"type": "text", "text": ...} parts',
}


def error_param(e: ValidationError) -> tuple:
    """(message, param) for the first error of a validation: the field's path in the body, e.g.
    `messages[0].role`, and one line saying what is wrong with it."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return "the request body is not valid JSON", None
    loc, in_union = [], False
    for x in err["loc"]:
        if isinstance(x, str) and ("[" in x or "-" in x or x in ("str", "int", "float", "bool")):
            in_union = True  # pydantic names the union member it tried: not a field; the path ends here
            break
        loc.append(x)
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error" and not loc:  # a model validator's "field: reason"
        field, _, reason = msg.partition(": ")
        loc, msg = [field], reason
    param = ""
    for x in loc:
        param += f"[{x}]" if isinstance(x, int) else (f".{x}" if param else str(x))
    name = next((x for x in reversed(loc) if isinstance(x, str)), None)
    if err["type"] == "extra_forbidden":
        msg = "unknown field (not part of this API)"
    elif err["type"] == "model_type" and not param:
        return "the request body must be a JSON object", None
    elif len(loc) == 1 and name in UNSUPPORTED:
        msg = f"not supported by this server (only {UNSUPPORTED[name]})"
    elif in_union and name in UNION_TYPES:
        msg = UNION_TYPES[name]
    return (f"{param}: {msg}" if param else msg).replace("\n", " "), param or None
