"""Train an EAGLE draft head with Optax.

    python -m train.draft --config configs/smollm2-135m-instruct.yaml [--steps N] [--lr X] ...

Every YAML key can be overridden by the flag of the same name (dashes or underscores); `data`
takes one shard directory or several (comma-separated; held-out examples come from the first).

Batches pack whole examples (pieces of seq_len tokens for longer ones, up to `example_len`) into
sequences without attention across examples, at each example's own positions (see
train.batches.Batcher). Target features: with `feature_cache: true` (the default) jitted batched
forwards compute them once per example, alone as at inference, into `<out>/features` (float16,
resumable; a data set that adds examples computes only those, see train.features), and steps read
them from there; with `false` each step runs the target forward itself over the packed batch.
`draft_vocab` (a token count, or a draft_vocab.json path) restricts the cross-entropy to the tokens
the draft will rank at inference (a V/V' cheaper LM head in every step); the list is written next
to the exported head so `load_draft` applies it. Orbax checkpoints every `ckpt_every` steps and at
exit (Ctrl-C / SIGTERM included); a restart resumes from the latest one with the same data order.
At the end the head is exported in the EAGLE format (bf16 safetensors) and in ours.

`rollout: R` (> 1) adds R-1 steps in which the head reads its own predicted features, as tree
drafting does at depth 2..R, with loss weights `rollout_decay**k` (see train.loss.draft_loss);
the log then also reports acc_k, the top-1 accuracy k steps into the draft's own rollout.
`arch: eagle3` trains an EAGLE-3 head (eagle2_jax.models.eagle3) instead: features from three target layers
(the feature cache holds them beside the final features), the head's own LM head over the draft
vocabulary (`draft_vocab`, sorted ids; d2t from them), the cross-entropy alone (v_weight, p_weight and
noise are EAGLE-2's), the training-time test with `rollout` steps (the paper uses 7), and the export
in the published EAGLE-3 layout. `eagle3_head_init: target` (the default; `random` for the
initialiser's rows) starts the head's final norm and LM head from the target's (its LM head columns
of the draft vocabulary). `vocab_mask: true` (with a draft vocabulary) leaves out of the loss the
positions whose target argmax over the full vocabulary is not a draft token, as the official
EAGLE-3 training does (the log's in_vocab: the share kept).
With `init_from` (a head to continue from), that head is evaluated on the held-out examples before
the first step (step 0 in the log), the baseline the run's later evaluations compare against. An
EAGLE-3 head keeps its own draft vocabulary (its d2t): a `draft_vocab` count up to its size is
ignored for it, a larger one grows it (train.head_vocab.grow_eagle3_vocab: the most frequent tokens
it lacks, their LM-head columns the target's, mapped as the head's trained ones are), and a
draft_vocab.json with other tokens is refused. Its batch order mixes `seed` with a fingerprint of
that head's weights (train.batches.data_order_seed): a chain of runs, each from the last one's
export, would otherwise train the same first batches in every run (a fresh optimiser and warmup
each time). `aux_layers: 2,15,29` (eagle3) picks the target layers whose entering streams `fc` fuses
(default: the `init_from` head's, else 2, L/2, L-3 as the published heads; L itself: the stream
leaving the last layer, before the final norm, which the EAGLE-2 head reads normed); from a head
that reads other layers, its weights start the run and fc's three input blocks read the new layers
(the feature cache is per set of layers). `time_limit` (minutes, 0: none) ends training after that
much wall time (the feature cache not counted) and exports the head as it is then, as if `steps`
had been reached; a rerun resumes.
`steps: auto` (with a time limit) trains as many steps as fit in it: the step rate is measured over
the run's first steps (at least 5 after the first, which compiles, and 5% of the limit), the count
fixed then and kept in <out>/steps.json (a rerun resumes the same schedule), so the cosine decay
reaches its floor as the time runs out instead of stopping at a learning rate near the peak.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import eagle2_jax
from infer.cli import Parser
from train.batches import data_order_seed, read_examples
from train.config import HELP, TrainConfig, defaults, read_config
from train.init_head import aux_layers_of, start_head
from train.loop import train_head


def parse_tree(text: str) -> dict:
    parts = str(text).split(",")
    try:
        d, k, n = (int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected depth,top_k,total_tokens (e.g. 3,4,16), got {text!r}") from None
    return dict(depth=d, top_k=k, total_tokens=n)


def _steps(s: str):
    if s == "auto":
        return s
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of steps or auto, got {s!r}") from None


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def build_parser() -> Parser:
    """--config and one flag per TrainConfig key (dashes for underscores), each None unless given."""
    ap = Parser(prog="python -m train.draft", description=__doc__)
    ap.add_argument("--config", help="YAML file with the keys below (flags override it)")
    for k, v in defaults().items():
        if k == "tree":
            shown = ",".join(str(v[x]) for x in ("depth", "top_k", "total_tokens"))
            ap.add_argument("--tree", type=parse_tree, help=f"{HELP[k]} (default {shown})")
            continue
        typ = _bool if isinstance(v, bool) else _steps if k == "steps" else str if v is None else type(v)
        ap.add_argument("--" + k.replace("_", "-"), dest=k, type=typ, default=None,
                        help=HELP[k] + ("" if v is None else f" (default {v})"))
    return ap


def load_config(argv=None) -> TrainConfig:
    """The run's checked settings: the defaults, then --config's YAML, then the flags given."""
    args = build_parser().parse_args(argv)
    return read_config(args.config, {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def main(argv=None):
    cfg = load_config(argv)
    try:
        mesh = eagle2_jax.parse_mesh(cfg.mesh)
    except ValueError as e:
        sys.exit(f"error: {e}")
    examples, heldout = read_examples(cfg.data_dirs, cfg.heldout_examples)
    try:
        target = eagle2_jax.load_target(cfg.target, dtype=cfg.dtype, mesh=mesh)
    except (eagle2_jax.CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    aux = aux_layers_of(cfg, target.config)
    os.makedirs(cfg.out, exist_ok=True)
    draft, vocab = start_head(cfg, target, examples, aux)
    order = data_order_seed(cfg.seed, draft.params) if cfg.init_from else cfg.seed
    train_head(cfg, target, draft, vocab, examples, heldout, order)


if __name__ == "__main__":
    main()
