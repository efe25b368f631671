"""What the command-line tools share: a parser whose errors are one line, value types that reject
bad input while the arguments are parsed (before a model loads), output paths checked before any
work, and the argument groups (model, tree, sampling, backend) with one help text each. Used by
infer.* and train.* entry points; no command imports another's module."""
from __future__ import annotations

import argparse
import os
import sys

import eagle2_jax as e2
from eagle2_jax.backends import pallas
from eagle2_jax.decoding.autotune import resolve_tree
from eagle2_jax.loading.draft_io import NAMED_DRAFTS


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


def positive_floats(text: str) -> list:
    """A comma list of finite numbers above 0 ("0.25,0.5,1")."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        out = [positive_float(p) for p in parts]
    except argparse.ArgumentTypeError:
        out = []
    if not out:
        raise argparse.ArgumentTypeError(f"expected numbers above 0 separated by commas, got {text!r}")
    return out


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


# ---- argument groups the commands share (one definition, one help text each) ----------------------------

def add_model_args(ap, model_default: str = "smollm2-135m-instruct", allow_none_draft: bool = False):
    g = ap.add_argument_group("model")
    g.add_argument("--model", default=model_default,
                   help="target: a named model (smollm2-135m-instruct), a Hugging Face directory (config.json + "
                        "safetensors) or Hub id (org/name[@revision]; HF_TOKEN, HF_HUB_CACHE and HF_HUB_OFFLINE=1 as "
                        "huggingface_hub reads them), a .gguf file, or random:<shape> (random weights of a published shape, e.g. "
                        f"random:llama-3.1-8b: for timing, no tokenizer) (default {model_default})")
    g.add_argument("--draft", default="auto",
                   help="draft head: 'auto' (the head shipped for --model), a named head, or a directory or Hub "
                        "id in the EAGLE format or ours" + (", or 'none' (plain decoding)" if allow_none_draft else ""))
    return g


def add_tree_args(ap, sizes: bool = False, depth=None, top_k=None, total_tokens=None):
    """--depth, --top-k, --total-tokens; `sizes`: --total-tokens takes a comma list (a sweep). A value
    left None comes from the head's tree.json for this platform, else the reference tree (5, 10, 60)."""
    g = ap.add_argument_group("EAGLE-2 tree")
    src = lambda v, ref: f"default {v}" if v is not None else f"default from the head, else {ref}"  # noqa: E731
    g.add_argument("--depth", type=positive_int, default=depth,
                   help=f"draft passes after the root's children ({src(depth, 5)})")
    g.add_argument("--top-k", type=positive_int, default=top_k,
                   help=f"children per node and frontier width ({src(top_k, 10)})")
    if sizes:
        g.add_argument("--total-tokens", type=positive_ints, default=total_tokens,
                       help=f"comma list of tree sizes N, tokens verified per round, root included (default {total_tokens})")
    else:
        g.add_argument("--total-tokens", type=tree_size, default=total_tokens,
                       help=f"tokens verified per round, root included ({src(total_tokens, 60)}); 'auto' times "
                            "rounds on this machine and picks the size with the best expected tokens/s")
    return g


def add_sampling_args(ap, top: bool = True):
    g = ap.add_argument_group("sampling")
    g.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy (default); > 0 samples")
    if top:
        g.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass (default 1.0: off)")
        g.add_argument("--sample-top-k", type=nonneg_int, default=0,
                       help="sample only among the k most likely tokens (default 0: off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed; rows draw independent numbers (default 0)")
    return g


def add_layer_layout(g):
    g.add_argument("--layer-layout", choices=["auto", "scan", "list"], default="auto",
                   help="how the target's layers run: scan (stacked weights, one compiled layer body), list "
                        "(a buffer per layer, the loop unrolled); auto: the platform's choice (eagle2_jax.models.ops.xla_for)")


def add_backend_args(ap, attention: bool = True, gpu_graphs: bool = True, draft: bool = True):
    g = ap.add_argument_group("backend")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="parameter and cache dtype; auto: float32 on CPU, bfloat16 on GPU/TPU")
    add_layer_layout(g)
    g.add_argument("--no-packed", dest="packed", action="store_false",
                   help="dequantise a GGUF target to --dtype in memory. By default, float32 on one CPU device, its "
                        "Q4_1/Q8_0 blocks stay packed and the CPU kernels read them (eagle2_jax.backends.cpu.packed)")
    if draft:
        g.add_argument("--draft-dtype", choices=["float32", "bfloat16"], default=None,
                       help="draft head dtype (default: the target's); the draft only proposes, so outputs are unchanged")
        g.add_argument("--full-draft-vocab", action="store_true",
                       help="draft over the whole vocabulary instead of the head's draft_vocab.json subset (changes "
                            "which tokens are proposed, never the output)")
    if attention:
        g.add_argument("--attention", choices=["xla", "pallas"], default="xla",
                       help="pallas: attention as one Pallas kernel reading only the live cache blocks (GPU/TPU; "
                            "eagle2_jax.backends.pallas, opt-in until a device has timed it)")
    if gpu_graphs:
        g.add_argument("--gpu-graphs", choices=["body", "loop", "off"], default="body",
                       help="GPU: CUDA graphs of the on-device decode loop: body (XLA's own, one graph per step or "
                            "round, the host waiting on the loop condition each time; default), loop (the whole "
                            "loop in one graph), off (none). Outputs are the same")
    return g


def load_models(args, need_draft: bool = True, mesh=None):
    """(target, draft or None) as the backend and model groups ask; a bad source or setting exits
    with one line. The draft: None when --draft is 'none', or 'auto' and no head is shipped for the
    model and `need_draft` is False."""
    try:
        target = e2.load_target(args.model, dtype=args.dtype, mesh=mesh, packed=None if args.packed else False,
                             layers=None if args.layer_layout == "auto" else args.layer_layout)
        draft = None
        name = args.model if args.draft == "auto" else args.draft
        shipped = name in NAMED_DRAFTS and os.path.isdir(NAMED_DRAFTS[name])
        if need_draft and args.draft == "auto" and not shipped and not name.startswith("random:"):
            fail(f"EAGLE-2 needs a draft head: none is shipped for {args.model!r}; pass --draft")
        if args.draft != "none" and (need_draft or args.draft != "auto" or shipped or name.startswith("random:")):
            draft = e2.load_draft(name, target, dtype=getattr(args, "draft_dtype", None),
                               draft_vocab=not getattr(args, "full_draft_vocab", False))
        target, draft = pallas.by_name(getattr(args, "attention", "xla"), target, draft)
    except (e2.CheckpointError, ValueError) as e:
        fail(str(e))
    return target, draft


def tree_of(args, draft, target=None, prompts=None, batch=None):
    """The tree the tree group asks for (autotune.resolve_tree: flags over the head's tree.json over the
    reference tree), for `batch` rows (None: no tree pays there, decode plainly); 'auto' prints the
    timed table to stderr."""

    def report(choice):
        for r in choice.table:
            print(f"  total_tokens {r['total_tokens']:3d}: expected tau {r['expected_tau']:.2f}, round "
                  f"{r['round_ms']:.1f} ms, ~{r['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
        print(f"auto tree: {choice.tree}", file=sys.stderr)
    try:
        return resolve_tree(draft, args.depth, args.top_k, args.total_tokens, batch=batch, target=target,
                            prompts=prompts, report=report)
    except ValueError as e:
        fail(str(e))
