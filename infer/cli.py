"""What the command-line tools share: a parser whose errors are one line, value types that reject
bad input while the arguments are parsed (before a model loads), and output paths checked before
any work. Used by infer.* and train.* entry points."""
from __future__ import annotations

import argparse
import os
import sys


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors ("error: argument --batch: ...") and exit status 2."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*a, **kw)

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def fail(message: str):
    """Exit with one line on stderr (status 1)."""
    sys.exit(f"error: {message}")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def _checked(name: str, convert, ok, wants: str, doc: str):
    """A value type: `convert` the text, then refuse what `ok` rejects with "<wants>, got <value>"."""
    def check(text: str):
        v = convert(text)
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{wants}, got {v:g}" if isinstance(v, float) else f"{wants}, got {v}")
        return v
    check.__name__ = check.__qualname__ = name
    check.__doc__ = doc
    return check


positive_int = _checked("positive_int", _int, lambda v: v >= 1, "must be at least 1", "An integer >= 1.")
nonneg_int = _checked("nonneg_int", _int, lambda v: v >= 0, "must be 0 or more", "An integer >= 0.")
nonneg_float = _checked("nonneg_float", _float, lambda v: v >= 0, "must be 0 or more", "A finite number >= 0.")
positive_float = _checked("positive_float", _float, lambda v: v > 0, "must be above 0", "A finite number > 0.")
probability = _checked("probability", _float, lambda v: 0 < v <= 1, "must be in (0, 1]", "A mass in (0, 1] (top-p).")
tokens_per_round = _checked("tokens_per_round", _float, lambda v: v >= 1,
                            "tokens per round are at least 1 (the bonus token)",
                            "tau: at least 1 (every round adds the bonus token).")


def positive_ints(text: str) -> list:
    """A comma list of positive integers ("1,4,16")."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    out = [_int_or_zero(p) for p in parts]
    if min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return out


def tree_size(text: str):
    """--total-tokens: a positive integer or 'auto'."""
    if text == "auto":
        return "auto"
    v = _int_or_zero(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")
    return v


def _int_or_zero(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


def writable_dir(path: str) -> str:
    """An output directory: it may exist (as a directory) or not yet; a file there is refused."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} exists and is not a directory")
    _check_parents(path)
    return path


def writable_file(path: str) -> str:
    """An output file: not a directory; its folder is made when it is written (see `ensure_parent`)."""
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a directory")
    _check_parents(path)
    return path


def _check_parents(path: str):
    """The nearest existing folder above `path` must be a directory (so it can be made below it)."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {path!r}: {parent!r} is not a directory")


def ensure_parent(path: str) -> str:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    return path
