"""A request's answer as text, token by token: incremental detokenization and stop strings held back.

    text = TextStream(tokenizer, stops=["\\n\\n"])
    for t in tokens:
        fresh = text.push(t)      # text now safe to send ("" while a stop string may be starting)
        if text.stopped: break    # a stop string completed: the answer ends before it
    fresh = text.finish()         # the rest, once the request has ended without a stop string

Streamed and whole answers are built by the same object, so they are the same text. Each token is
decoded with a few tokens before it (the offsets vLLM and HF's TextStreamer keep), never the whole
answer again, and text ending in an incomplete UTF-8 character waits for the next token. Text that
could still be the start of a stop string is held back until it no longer can be, so no part of a stop
string is ever sent.
"""
from __future__ import annotations

from typing import Sequence


class TextStream:
    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.tokens: list = []
        self._prefix = self._read = 0  # tokens[prefix:read] were decoded last; their text is out already
        self.text = ""  # everything decoded so far (stop strings and held-back text included)
        self.sent = 0  # characters of self.text handed out
        self.stopped = False  # a stop string completed; self.text is cut before it
        self.used = 0  # tokens whose text was (at least partly) needed: what usage counts

    def push(self, token: int) -> str:
        """Add one token; returns the text that became safe to send."""
        if self.stopped:
            return ""
        self.tokens.append(int(token))
        self.used = len(self.tokens)
        before = self._decode(self.tokens[self._prefix:self._read])
        now = self._decode(self.tokens[self._prefix:])
        pending = ""  # text before an incomplete character at the end: searched, not yet kept
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.tokens)
        elif len(now) > len(before):
            pending = now[len(before):].rstrip("\ufffd")
        seen = self.text + pending
        cut = min((i for i in (seen.find(s, max(self.sent - len(s), 0)) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.text, self.stopped = seen[:cut], True
            return self._hand_out(len(self.text))
        return self._hand_out(len(self.text) - self._held())

    def finish(self) -> str:
        """The request ended (EOS, length, cancel): everything not yet sent."""
        if not self.stopped and self._read < len(self.tokens):  # an incomplete character at the very end
            self.text += self._decode(self.tokens[self._prefix:])[len(self._decode(self.tokens[self._prefix:self._read])):]
            self._read = len(self.tokens)
        return self._hand_out(len(self.text))

    def _held(self) -> int:
        """Length of the longest end of the text that is a proper start of some stop string."""
        tail = self.text[self.sent:]
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(tail)), 0, -1)
                    if tail.endswith(s[:k])), default=0)

    def _hand_out(self, upto: int) -> str:
        fresh = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return fresh

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
