"""Train an EAGLE draft head with Optax.

    python -m train.draft --config configs/smollm2-135m-instruct.yaml [--steps N] [--lr X] ...

Every YAML key can be overridden by the flag of the same name (dashes or underscores); `data`
takes one shard directory or several (comma-separated; held-out examples come from the first).

Batches pack whole examples (pieces of seq_len tokens for longer ones, up to `example_len`) into
sequences without attention across examples, at each example's own positions (see Batcher).
Target features: with `feature_cache: true` (the default) jitted batched forwards compute them once
per example, alone as at inference, into `<out>/features` (float16, resumable; a data set that adds
examples computes only those, see train.features), and steps read them from there; with `false`
each step runs the target forward itself over the packed batch.
`draft_vocab` (a token count, or a draft_vocab.json path) restricts the cross-entropy to the tokens
the draft will rank at inference (a V/V' cheaper LM head in every step); the list is written next
to the exported head so `load_draft` applies it. Orbax checkpoints every `ckpt_every` steps and at exit (Ctrl-C / SIGTERM
included); a restart resumes from the latest one with the same data order. At the end the head is
exported in the EAGLE format (bf16 safetensors) and in ours.

`rollout: R` (> 1) adds R-1 steps in which the head reads its own predicted features, as tree
drafting does at depth 2..R, with loss weights `rollout_decay**k` (see train.loss.draft_loss);
the log then also reports acc_k, the top-1 accuracy k steps into the draft's own rollout.
`arch: eagle3` trains an EAGLE-3 head (eagle2_jax.eagle3) instead: features from three target layers
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
ignored for it, a larger one grows it (`grow_eagle3_vocab`: the most frequent tokens it lacks, their
LM-head columns the target's, mapped as the head's trained ones are), and a draft_vocab.json with other tokens is refused. Its batch order mixes `seed` with a fingerprint of
that head's weights (`data_order_seed`): a chain of runs, each from the last one's export, would
otherwise train the same first batches in every run (a fresh optimiser and warmup each time).
`aux_layers: 2,15,29` (eagle3) picks the target layers whose entering streams `fc` fuses (default:
the `init_from` head's, else 2, L/2, L-3 as the published heads; L itself: the stream leaving the last
layer, before the final norm, which the EAGLE-2 head reads normed); from a head that reads other
layers, its weights start the run and fc's three input blocks read the new layers (the feature cache
is per set of layers). `time_limit` (minutes, 0: none) ends training after that much wall time (the feature cache not
counted) and exports the head as it is then, as if `steps` had been reached; a rerun resumes.
`steps: auto` (with a time limit) trains as many steps as fit in it: the step rate is measured over
the run's first steps (at least 5 after the first, which compiles, and 5% of the limit), the count
fixed then and kept in <out>/steps.json (a rerun resumes the same schedule), so the cosine decay
reaches its floor as the time runs out instead of stopping at a learning rate near the peak.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
import zlib

import numpy as np
import yaml

DEFAULTS = dict(target="smollm2-135m-instruct", dtype="float32", data=None, out=None, export=None,
                steps=600, batch_size=8, seq_len=384, lr=1e-3, warmup_steps=30, min_lr_ratio=0.05,
                weight_decay=0.0, clip_norm=0.5, noise=0.1, v_weight=1.0, p_weight=0.1,
                heldout_examples=32, seed=0, mesh=None, log_every=10, ckpt_every=50, eval_every=200,
                eval_tau_prompts=4, eval_tau_tokens=64, tree=dict(depth=5, top_k=10, total_tokens=60),
                init_from=None, feature_cache=True, draft_vocab=None, feature_batch=8, rollout=1,
                rollout_decay=0.8, arch="eagle2", eagle3_head_init="target", vocab_mask=False,
                time_limit=0.0, example_len=2048, aux_layers=None)


HELP = dict(
    target="target model: a named model, a Hugging Face directory or a .gguf file",
    dtype="the target's dtype: float32, bfloat16 or auto (float32 on CPU, bfloat16 on GPU/TPU)",
    data="shard directories written by python -m train.data, comma-separated; held-out examples come from the first",
    out="run directory: Orbax checkpoints, log.jsonl, config.json, the feature cache, final_orbax",
    export="directory for the trained head in the EAGLE layout (bf16 safetensors); unset: not exported",
    steps="optimizer steps in all (a rerun resumes up to it); auto, with --time-limit: as many as fit in the "
          "limit at the rate of the first steps, so the cosine decay ends with the time; "
          "0 with --init-from evaluates that head, nothing more",
    batch_size="packed sequences per step",
    seq_len="tokens per packed sequence",
    lr="peak learning rate (AdamW)",
    warmup_steps="linear warm-up steps before the cosine decay",
    min_lr_ratio="floor of the cosine decay, as a fraction of lr",
    weight_decay="AdamW weight decay",
    clip_norm="global gradient-norm clip",
    noise="EAGLE-2: uniform noise U(-noise, noise) on the input features",
    v_weight="EAGLE-2: weight of the smooth-L1 feature regression",
    p_weight="EAGLE-2: weight of the soft cross-entropy through the target's LM head",
    heldout_examples="last examples of the first data set, never trained on, used by the evaluations",
    seed="initialisation and batch-order seed",
    mesh="device mesh, e.g. data=2 (unset: one device)",
    log_every="steps between log lines (log.jsonl)",
    ckpt_every="steps between Orbax checkpoints",
    eval_every="steps between held-out evaluations",
    eval_tau_prompts="held-out prompts generated with --tree at each evaluation to report tau (0: none)",
    eval_tau_tokens="new tokens per such prompt",
    tree="depth,top_k,total_tokens of the evaluation tree (e.g. 3,4,16)",
    init_from="a head directory to continue from (same arch)",
    feature_cache="true: the target's features computed once into <out>/features, read by every step",
    draft_vocab="cross-entropy over this many most frequent assistant tokens, or a draft_vocab.json path",
    feature_batch="packed sequences per target forward while the feature cache fills",
    rollout="training-time test: steps of the head's own rollout (1: none)",
    rollout_decay="loss weight of rollout step k: rollout_decay**k",
    arch="eagle2 (an EAGLE-1/2 head) or eagle3 (an EAGLE-3 head)",
    eagle3_head_init="eagle3: the final norm and LM head start from the target's (target) or at random (random)",
    vocab_mask="eagle3: leave out of the loss the positions whose target argmax is not a draft token",
    time_limit="minutes of training after which the head is exported as it is (0: none; a rerun resumes)",
    example_len="examples are cropped to this many tokens",
    aux_layers="eagle3: the three target layers whose entering streams fc fuses, e.g. 2,15,29",
)

# (key: (type, lowest value, whether the lowest is allowed)) checked after the YAML and flags merge
RANGES = dict(steps=(int, 0, True), batch_size=(int, 1, True), seq_len=(int, 1, True), warmup_steps=(int, 0, True),
              heldout_examples=(int, 1, True), log_every=(int, 1, True), ckpt_every=(int, 1, True),
              eval_every=(int, 1, True), eval_tau_prompts=(int, 0, True), eval_tau_tokens=(int, 1, True),
              feature_batch=(int, 1, True), rollout=(int, 1, True), example_len=(int, 1, True),
              seed=(int, None, True), lr=(float, 0, True), min_lr_ratio=(float, 0, True),
              weight_decay=(float, 0, True), clip_norm=(float, 0, False), noise=(float, 0, True),
              v_weight=(float, 0, True), p_weight=(float, 0, True), rollout_decay=(float, 0, False),
              time_limit=(float, 0, True))
CHOICES = dict(arch=("eagle2", "eagle3"), eagle3_head_init=("target", "random"), dtype=("auto", "float32", "bfloat16"))


def check_config(cfg: dict):
    """One-line errors for values no run can use, before the target loads."""
    if cfg["steps"] == "auto" and not (isinstance(cfg["time_limit"], (int, float)) and cfg["time_limit"] > 0):
        sys.exit("error: steps auto fits the steps to --time-limit: give one (minutes), or a number of steps")
    for k, (typ, low, inclusive) in RANGES.items():
        v = cfg[k]
        if k == "steps" and v == "auto":
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (typ is float or isinstance(v, int))
        if not ok:
            sys.exit(f"error: {k} must be {'an integer' if typ is int else 'a number'}, got {v!r}")
        if low is not None and (v < low or (v == low and not inclusive)):
            sys.exit(f"error: {k} must be {'at least' if inclusive else 'above'} {low}, got {v!r}")
    if cfg["min_lr_ratio"] > 1:
        sys.exit(f"error: min_lr_ratio must be at most 1, got {cfg['min_lr_ratio']!r}")
    for k, allowed in CHOICES.items():
        if cfg[k] not in allowed:
            sys.exit(f"error: {k} must be {' or '.join(allowed)}, got {cfg[k]!r}")
    for k in ("feature_cache", "vocab_mask"):
        if not isinstance(cfg[k], bool):
            sys.exit(f"error: {k} must be true or false, got {cfg[k]!r}")
    from eagle2_jax import TreeConfig
    try:
        TreeConfig(**cfg["tree"])
    except (TypeError, ValueError) as e:
        sys.exit(f"error: tree {cfg['tree']!r}: {e}")
    if cfg["steps"] == 0 and not cfg["init_from"]:
        sys.exit("error: --steps 0 only evaluates an --init-from head: give one, or steps to train")
    ckpts = os.path.join(cfg["out"], "checkpoints")
    if cfg["steps"] == 0 and os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts)):
        sys.exit(f"error: --steps 0 evaluates the --init-from head, but {cfg['out']} holds a run's checkpoints, "
                 "which would be restored instead: use another --out")
    if os.path.exists(cfg["out"]) and not os.path.isdir(cfg["out"]):
        sys.exit(f"error: --out {cfg['out']} exists and is not a directory")
    if cfg["export"] and os.path.exists(cfg["export"]) and not os.path.isdir(cfg["export"]):
        sys.exit(f"error: --export {cfg['export']} exists and is not a directory")


def parse_tree(text: str) -> dict:
    parts = str(text).split(",")
    try:
        d, k, n = (int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected depth,top_k,total_tokens (e.g. 3,4,16), got {text!r}") from None
    return dict(depth=d, top_k=k, total_tokens=n)


def aux_layers_of(cfg: dict, target_config) -> tuple | None:
    """cfg["aux_layers"] ("2,15,29" or a list) as a checked tuple; None where not set."""
    raw = cfg["aux_layers"]
    if raw is None:
        return None
    if cfg["arch"] != "eagle3":
        sys.exit("error: --aux-layers is for an EAGLE-3 head (--arch eagle3)")
    from eagle2_jax.draft import check_aux_layers
    try:
        aux = tuple(int(x) for x in (raw.split(",") if isinstance(raw, str) else raw))
        check_aux_layers(aux, target_config)
    except ValueError as e:
        sys.exit(f"error: --aux-layers {raw}: {e}")
    return aux


def load_config(argv=None) -> dict:
    from infer.cli import Parser
    ap = Parser(prog="python -m train.draft", description=__doc__)
    ap.add_argument("--config", help="YAML file with the keys below (flags override it)")
    for k, v in DEFAULTS.items():
        if k == "tree":
            shown = ",".join(str(v[x]) for x in ("depth", "top_k", "total_tokens"))
            ap.add_argument("--tree", type=parse_tree, help=f"{HELP[k]} (default {shown})")
            continue
        typ = type(v) if v is not None and not isinstance(v, bool) else str
        if isinstance(v, bool):
            typ = _bool
        if k == "steps":
            typ = _steps
        ap.add_argument("--" + k.replace("_", "-"), dest=k, type=typ, default=None, help=HELP[k] + ("" if v is None else f" (default {v})"))
    args = ap.parse_args(argv)
    cfg = dict(DEFAULTS)
    if args.config:
        if not os.path.exists(args.config):
            sys.exit(f"error: config file not found: {args.config}")
        with open(args.config) as f:
            y = yaml.safe_load(f) or {}
        unknown = set(y) - set(DEFAULTS)
        if unknown:
            sys.exit(f"error: unknown key(s) in {args.config}: {', '.join(sorted(unknown))}")
        cfg.update(y)
    for k in DEFAULTS:
        v = getattr(args, k, None)
        if v is not None:
            cfg[k] = v
    for req in ("data", "out"):
        if not cfg[req]:
            sys.exit(f"error: --{req} is required (or set it in --config)")
    check_config(cfg)
    if cfg["vocab_mask"] and not cfg["draft_vocab"] and not cfg["init_from"]:  # (an EAGLE-3 head brings its own)
        sys.exit("error: --vocab-mask needs a draft vocabulary (--draft-vocab)")
    held = _export_arch(cfg["export"])
    if held and held != cfg["arch"]:  # (the shipped config exports to the packaged EAGLE-2 head)
        sys.exit(f"error: --export {cfg['export']} holds an {held} head, which this --arch {cfg['arch']} run "
                 "would overwrite: pass --export another directory")
    return cfg


def _export_arch(directory) -> str | None:
    """The arch of the head an export directory already holds (by its config.json), else None."""
    path = os.path.join(directory, "config.json") if directory else ""
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    return "eagle3" if "draft_vocab_size" in raw or raw.get("arch") == "eagle3" else "eagle2"


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


def data_order_seed(seed: int, init_params) -> int:
    """The batch order's seed for a run that starts from a trained head: `seed` mixed with a
    fingerprint of that head's weights. Chained runs (each --init-from the last one's export) then
    do not replay the batches every run began with; a resumed run starts from the same head and
    keeps its order."""
    import jax
    first = np.ascontiguousarray(np.asarray(jax.tree_util.tree_leaves(init_params)[0]))
    return (int(seed) + zlib.crc32(first.tobytes())) % 2**31


class Batcher:
    """Deterministic batches of packed sequences that never attend across examples.

    Examples (cropped to `example_len` tokens) are cut into pieces of at most seq_len tokens and
    the pieces, in a seeded order, are packed best-fit into sequences of seq_len, so few steps are
    spent on padding. Each sequence carries a segment id per token (1, 2, ... per piece, 0 on
    padding) and each token its position in its example: attention stays within a piece and RoPE
    sees the positions the example has at inference. Step s takes sequences [s*B, (s+1)*B) of the
    concatenation of per-epoch permutations, so a resumed run sees exactly the batches it would
    have seen. `pack=False` (held-out evaluation): one example per sequence, cropped to seq_len.
    """

    def __init__(self, examples, batch_size, seq_len, seed, pack: bool = True, example_len: int = 2048):
        self.B, self.T, self.seed = batch_size, seq_len, seed
        self.examples = [(np.asarray(t)[:example_len], np.asarray(m)[:example_len]) for t, m in examples]
        order = np.random.default_rng(seed).permutation(len(examples))
        if not pack:
            self.seqs = [[(int(i), 0, min(len(self.examples[i][0]), seq_len))] for i in order]
        else:
            pieces = [(int(i), s, min(s + seq_len, len(self.examples[i][0])))
                      for i in order for s in range(0, len(self.examples[i][0]), seq_len)]
            self.seqs = []
            by_room = [[] for _ in range(seq_len + 1)]  # sequences by their free tokens
            for p in pieces:
                n = p[2] - p[1]
                room = next((r for r in range(n, seq_len + 1) if by_room[r]), None)
                if room is None:
                    self.seqs.append([])
                    k, room = len(self.seqs) - 1, seq_len
                else:
                    k = by_room[room].pop()
                self.seqs[k].append(p)
                by_room[room - n].append(k)
        self._perms = {}

    def __len__(self):
        return len(self.seqs)

    def _perm(self, epoch):
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng(self.seed + 1 + epoch).permutation(len(self.seqs))
        return self._perms[epoch]

    def indices(self, step):
        n = len(self.seqs)
        return [int(self._perm(g // n)[g % n]) for g in range(step * self.B, (step + 1) * self.B)]

    def batch(self, step):
        """(ids, loss mask, segment ids, positions), each [B, T] int32."""
        ids, mask, seg, pos = (np.zeros((self.B, self.T), np.int32) for _ in range(4))
        for r, k in enumerate(self.indices(step)):
            at = 0
            for j, (i, s, e) in enumerate(self.seqs[k]):
                t, m = self.examples[i]
                ids[r, at:at + e - s], mask[r, at:at + e - s] = t[s:e], m[s:e]
                seg[r, at:at + e - s], pos[r, at:at + e - s] = j + 1, np.arange(s, e)
                at += e - s
        return ids, mask, seg, pos

    def features(self, step, cache) -> np.ndarray:
        """The step's target features [B, T, F] from a train.features.FeatureCache (zeros on padding)."""
        out = np.zeros((self.B, self.T, cache.width), np.float16)
        for r, k in enumerate(self.indices(step)):
            at = 0
            for i, s, e in self.seqs[k]:
                out[r, at:at + e - s] = cache.example(self.examples[i][0])[s:e]
                at += e - s
        return out


def make_optimizer(cfg):
    """Gradient clipping and AdamW at learning rate 1: the train step scales the update by the
    step's learning rate (`learning_rate`), a traced value, so the schedule can be fixed after the
    run has started (steps auto) without a recompile."""
    import optax
    return optax.chain(optax.clip_by_global_norm(cfg["clip_norm"]),
                       optax.adamw(1.0, b1=0.9, b2=0.95, weight_decay=cfg["weight_decay"]))


def learning_rate(cfg, step: int, total) -> float:
    """The learning rate of optimizer step `step` (0-based) in a run of `total` steps: a linear
    warm-up from 0 over warmup_steps, then a cosine decay to lr * min_lr_ratio at `total` (optax's
    warmup_cosine_decay_schedule). total None (steps auto, not yet fixed): the warm-up, then lr."""
    peak, warm = float(cfg["lr"]), int(cfg["warmup_steps"])
    if step < warm:
        return peak * step / warm
    if total is None:
        return peak
    end = peak * float(cfg["min_lr_ratio"])
    span = max(total, warm + 1) - warm
    frac = min(step - warm, span) / span
    return end + (peak - end) * 0.5 * (1 + np.cos(np.pi * frac))


def target_lm_head(target):
    """The target's LM head as [D, V] (the embedding's transpose when tied)."""
    tp = target.params
    return target.ops.weight(tp["embed"]).T if target.config.tie_word_embeddings else target.ops.weight(tp["lm_head"])


def eagle3_head_from_target(target, vocab, params) -> dict:
    """An EAGLE-3 head's final norm and LM head [D, Vd] copied from the target's (final norm, LM head
    columns of the draft vocabulary, ascending ids): the head starts out ranking tokens the way the
    target would from a feature like its own last one, instead of from random rows."""
    import jax.numpy as jnp
    tp = target.params
    lm = jnp.take(jnp.asarray(target_lm_head(target)), jnp.asarray(vocab), axis=1).astype(params["lm_head"].dtype)
    # a copy: training donates the head's params, which must not free the target's buffer
    scale = jnp.array(target.ops.weight(tp["norm"]["scale"]), params["norm"]["scale"].dtype, copy=True)
    return {"lm_head": lm, "norm": {"scale": scale}}


def build_step(tmodule, dmodule, opt, cfg, fixed=None):
    """Jitted (train step, eval). Both take a Batcher batch (ids, mask, segment ids, positions); the
    train step also features [B, T, F] (from the cache) or None (computed inside by the target over
    the packed batch: a piece of an example past its first sees none of the example's earlier
    tokens, where the cache computed the whole example), and the draft-vocabulary ids or None. `fixed`: params
    that are not trained (an EAGLE-3 head's integer d2t map), joined to the trained ones in the loss."""
    import jax
    import optax
    from train.loss import draft_loss, target_features, vocab_head

    aux = tuple(dmodule.aux_layers)

    fixed = fixed or {}
    loss_fn = lambda dparams, *a: draft_loss({**dparams, **fixed}, *a)  # noqa: E731

    def step(dparams, opt_state, lr, tparams, ids, mask, seg, pos, feats, vocab_ids, key):
        if feats is None:
            feats = target_features(tmodule, tparams, ids, aux, seg, pos)
        head = None if vocab_ids is None else vocab_head(tmodule, tparams, vocab_ids)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(dparams, dmodule, tmodule, tparams, ids, mask, feats, key, cfg["noise"],
                                      cfg["v_weight"], cfg["p_weight"], head, cfg["rollout"], cfg["rollout_decay"],
                                      vocab_ids if cfg["vocab_mask"] else None, seg, pos)
        updates, opt_state = opt.update(grads, opt_state, dparams)
        updates = jax.tree_util.tree_map(lambda u: (lr * u).astype(u.dtype), updates)
        return optax.apply_updates(dparams, updates), opt_state, metrics

    def evaluate(dparams, tparams, ids, mask, seg, pos, vocab_ids):
        feats = target_features(tmodule, tparams, ids, aux, seg, pos)
        head = None if vocab_ids is None else vocab_head(tmodule, tparams, vocab_ids)
        _, metrics = loss_fn(dparams, dmodule, tmodule, tparams, ids, mask, feats, None, 0.0,
                             cfg["v_weight"], cfg["p_weight"], head, cfg["rollout"], cfg["rollout_decay"],
                             vocab_ids if cfg["vocab_mask"] else None, seg, pos)
        return metrics

    return jax.jit(step, donate_argnums=(0, 1)), jax.jit(evaluate)


def fit_steps(path, step, per_step, deadline, time_limit) -> int:
    """steps auto: the step count that fits before `deadline` at `per_step` seconds a step, with 5%
    to spare (evaluations, the export), written to `path` (steps.json) for a rerun to resume."""
    total = max(step + 1, step + int(0.95 * (deadline - time.time()) / per_step))
    with open(path + ".tmp", "w") as f:
        json.dump(dict(steps=total, fixed_at_step=step, s_per_step=per_step, time_limit_min=time_limit), f)
    os.replace(path + ".tmp", path)
    return total


def read_fitted_steps(path):
    """The step count a steps-auto run fixed (its steps.json), or None before it has."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return int(json.load(f)["steps"])


def resolve_vocab(spec, train, out_dir):
    """None, a token count (the most frequent assistant tokens of `train`) or a json path -> ids."""
    if spec is None or spec == "" or spec == 0:
        return None
    if isinstance(spec, int) or str(spec).isdigit():
        from train.vocab import frequent_tokens
        ids = frequent_tokens(train, int(spec), always=(0, 1, 2))
        with open(os.path.join(out_dir, "draft_vocab.json"), "w") as f:
            json.dump({"ids": ids.tolist(), "size": int(spec)}, f)
        return ids
    if not os.path.exists(str(spec)):
        sys.exit(f"error: draft_vocab file not found: {spec}")
    with open(spec) as f:
        return np.asarray(json.load(f)["ids"], np.int64)


def eagle3_own_vocab(init, cfg, train):
    """The draft vocabulary of an EAGLE-3 head to continue from: its LM head's row i ranks token
    i + d2t[i], and the loss must rank the same tokens in that order. A `draft_vocab` count (which
    would build another vocabulary from the data) is ignored; a draft_vocab.json must hold its tokens."""
    own = np.asarray(init.params["d2t"]) + np.arange(len(init.params["d2t"]))
    spec = cfg["draft_vocab"]
    if spec and not isinstance(spec, int) and not str(spec).isdigit():
        given = resolve_vocab(spec, train, cfg["out"])
        if not np.array_equal(np.unique(given), np.unique(own)):
            sys.exit(f"error: --init-from {cfg['init_from']} ranks {len(own)} draft tokens that differ from "
                     f"{spec} ({len(given)} tokens): leave --draft-vocab out to keep the head's own")
    return own


def grow_eagle3_vocab(init, target, train, size: int):
    """(head, vocabulary): an EAGLE-3 head to continue from with its draft vocabulary grown to `size`
    tokens, its own plus the most frequent assistant tokens of `train` it lacks (ascending ids, d2t
    rebuilt). A kept token keeps its trained LM-head column. A new one gets the target's LM-head
    column for it mapped by the linear map, fitted by least squares over the kept tokens, that takes
    the target's columns to the head's (training moved the head's output space: the target's columns
    as they are, even rescaled, outscore the trained ones and the head proposes only new tokens,
    tau 1.0 on SmolLM2; zero columns, 1.55; mapped, 2.53 against 2.58 before growing, untrained).
    The rest of the head is unchanged."""
    import jax.numpy as jnp
    from train.vocab import ranked_tokens
    d2t = np.asarray(init.params["d2t"])
    own = d2t + np.arange(len(d2t))
    have = set(own.tolist())
    new = np.asarray([t for t in ranked_tokens(train).tolist() if t not in have][:size - len(own)], np.int64)
    vocab = np.sort(np.concatenate([own, new]))
    w = np.asarray(target_lm_head(target), np.float32)  # [D, V]
    head = np.asarray(init.params["lm_head"], np.float32)  # [D, Vd], column i ranks own[i]
    m_DD = np.linalg.lstsq(w[:, own].T, head.T, rcond=None)[0]  # head.T ~ w[:, own].T @ m_DD
    column = {int(t): i for i, t in enumerate(own)}
    lm = np.stack([head[:, column[t]] if t in column else m_DD.T @ w[:, t] for t in vocab.tolist()], axis=1)
    params = {**init.params, "lm_head": jnp.asarray(lm, init.params["lm_head"].dtype),
              "d2t": jnp.asarray(vocab - np.arange(len(vocab)), jnp.int32)}
    return dataclasses.replace(init, params=params, draft_vocab_size=len(vocab)), vocab


def eval_tau(target, draft, examples, cfg, vocab=None):
    from eagle2_jax import TreeConfig, generate
    if vocab is not None and draft.arch != "eagle3":  # an EAGLE-3 head carries its vocabulary (d2t)
        from eagle2_jax.draft import with_draft_vocab
        draft = with_draft_vocab(draft, target, vocab)
    prompts = [t[:int(np.argmax(m))].tolist() for t, m in examples[:cfg["eval_tau_prompts"]] if m.any()]
    if not prompts:
        return None
    out = generate(target, draft, prompts, max_new_tokens=cfg["eval_tau_tokens"], tree=TreeConfig(**cfg["tree"]),
                   eos_token_id=target.config.eos_token_id)
    return out.tau


def main(argv=None):
    cfg = load_config(argv)
    import jax
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from eagle2_jax import CheckpointError, init_draft, load_target, parse_mesh, save_draft
    from train.data import read_shards

    try:
        mesh = parse_mesh(cfg["mesh"])
    except ValueError as e:
        sys.exit(f"error: {e}")
    dirs = cfg["data"] if isinstance(cfg["data"], list) else str(cfg["data"]).split(",")
    try:
        sets = [read_shards(d) for d in dirs]
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    if len(sets[0]) <= cfg["heldout_examples"]:
        sys.exit(f"error: {len(sets[0])} examples in {dirs[0]}: need more than heldout_examples")
    heldout = sets[0][-cfg["heldout_examples"]:]  # held out from the first (self-distilled) set
    train = sets[0][:-cfg["heldout_examples"]] + [e for s in sets[1:] for e in s]
    print(f"{len(train)} training examples from {', '.join(dirs)}; {len(heldout)} held out")
    try:
        target = load_target(cfg["target"], dtype=cfg["dtype"], mesh=mesh)
    except (CheckpointError, ValueError) as e:
        sys.exit(f"error: {e}")
    aux = aux_layers_of(cfg, target.config)
    os.makedirs(cfg["out"], exist_ok=True)
    init = None
    if cfg["init_from"]:
        from eagle2_jax import load_draft
        try:
            init = load_draft(cfg["init_from"], target, draft_vocab=False)  # (an EAGLE-2 head's subset: draft_vocab)
        except (CheckpointError, ValueError) as e:
            sys.exit(f"error: --init-from {cfg['init_from']}: {e}")
        if init.arch != cfg["arch"]:
            sys.exit(f"error: --init-from {cfg['init_from']} is an {init.arch} head, not {cfg['arch']}")
        if aux is not None and tuple(init.aux_layers) != aux:
            print(f"the head read target layers {tuple(init.aux_layers)}; it now reads {aux}")
            init = dataclasses.replace(init, aux_layers=aux)
    if init is not None and init.arch == "eagle3":
        vocab = eagle3_own_vocab(init, cfg, train)
        n = cfg["draft_vocab"]
        if (isinstance(n, int) or str(n).isdigit()) and int(n) > len(vocab):
            before = len(vocab)
            init, vocab = grow_eagle3_vocab(init, target, train, int(n))
            print(f"draft vocabulary grown from {before} to {len(vocab)} tokens (new LM-head columns: the target's, mapped)")
    else:
        vocab = resolve_vocab(cfg["draft_vocab"], train, cfg["out"])
        if cfg["arch"] == "eagle3":  # the head's LM head rows in ascending token order; d2t maps to them
            vocab = np.sort(vocab) if vocab is not None else np.arange(target.config.vocab_size)
    if cfg["vocab_mask"] and vocab is None:
        sys.exit("error: --vocab-mask needs a draft vocabulary (--draft-vocab)")
    if init is not None:
        draft = init
    elif cfg["arch"] == "eagle3":
        draft = init_draft(target, cfg["seed"], arch="eagle3", draft_vocab_size=len(vocab), aux_layers=aux)
        draft.params = {**draft.params, "d2t": jax.numpy.asarray(vocab - np.arange(len(vocab)), jax.numpy.int32)}
        if cfg["eagle3_head_init"] == "target":  # start from the target's own head over the draft vocabulary
            draft.params = {**draft.params, **eagle3_head_from_target(target, vocab, draft.params)}
    else:
        draft = init_draft(target, cfg["seed"])
    fixed = {k: v for k, v in draft.params.items() if k == "d2t"}  # not trained: EAGLE-3's vocabulary map
    draft.params = {k: v for k, v in draft.params.items() if k not in fixed}
    whole = lambda: dataclasses.replace(draft, params={**draft.params, **fixed})  # noqa: E731
    opt = make_optimizer(cfg)
    opt_state = opt.init(draft.params)
    step_fn, eval_fn = build_step(target.module, draft.module, opt, cfg, fixed)
    order = cfg["seed"] if init is None else data_order_seed(cfg["seed"], init.params)
    batcher = Batcher(train, cfg["batch_size"], cfg["seq_len"], order, example_len=cfg["example_len"])
    held = Batcher(heldout, min(cfg["batch_size"], len(heldout)), cfg["seq_len"], cfg["seed"], pack=False)
    print(f"{len(batcher)} packed sequences of {cfg['seq_len']} tokens per epoch")

    vocab_dev = None if vocab is None else jax.numpy.asarray(vocab, jax.numpy.int32)
    if vocab is not None:
        print(f"cross-entropy over a draft vocabulary of {len(vocab)} tokens")
    fcache = None
    if cfg["feature_cache"]:
        from train.features import FeatureCache, fingerprint
        from train.loss import target_features
        aux = tuple(draft.aux_layers)
        fcache = FeatureCache(os.path.join(cfg["out"], "features"),
                              target.config.hidden_size * (len(aux) + 1),
                              fingerprint(str(cfg["target"]), cfg["dtype"], aux))
        feat_fn = jax.jit(lambda p, ids: target_features(target.module, p, ids, aux))
        t0 = time.time()
        n = fcache.fill([t for t, _ in batcher.examples], lambda ids: feat_fn(target.params, ids),
                        cfg["feature_batch"] * cfg["seq_len"])
        if n:
            print(f"target features: {n / (time.time() - t0):.0f} tokens/s, {time.time() - t0:.0f} s")
    ckpt_dir = os.path.abspath(os.path.join(cfg["out"], "checkpoints"))
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        restored = mngr.restore(start, args=ocp.args.StandardRestore({"params": draft.params, "opt_state": opt_state}))
        draft.params, opt_state = restored["params"], restored["opt_state"]
        print(f"resumed from step {start} ({ckpt_dir})")
    with open(os.path.join(cfg["out"], "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    log = open(os.path.join(cfg["out"], "log.jsonl"), "a")

    def save(step):
        if mngr.latest_step() == step:
            return
        mngr.save(step, args=ocp.args.StandardSave({"params": draft.params, "opt_state": opt_state}), force=True)
        mngr.wait_until_finished()

    def evaluate(step):
        em = [eval_fn(draft.params, target.params, *held.batch(i), vocab_dev)
              for i in range(max(1, len(heldout) // held.B))]
        acc = float(np.mean([float(e["acc"]) for e in em]))
        deeper = {f"eval_{k}": float(np.mean([float(e[k]) for e in em])) for k in em[0] if k.startswith("acc_")}
        tau = eval_tau(target, whole(), heldout, cfg, vocab)
        rec = dict(step=step, eval_acc=acc, **deeper, eval_tau=tau, time=time.time())
        log.write(json.dumps(rec) + "\n")
        log.flush()
        tqdm.write(f"step {step}: held-out top-1 acc {acc:.3f}, tau {tau}")

    if cfg["init_from"] and start == 0:
        evaluate(0)  # the head it starts from, on the same held-out examples: the baseline

    stop = {"flag": False, "timed_out": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.update(flag=True))
    limit_s = 60 * float(cfg["time_limit"])
    deadline = time.time() + limit_s if cfg["time_limit"] else None
    steps_file = os.path.join(cfg["out"], "steps.json")
    total = cfg["steps"] if cfg["steps"] != "auto" else read_fitted_steps(steps_file)
    step = start
    key = jax.random.PRNGKey(cfg["seed"])
    bar = tqdm(total=total, initial=start, unit="step", desc="train draft", dynamic_ncols=True)
    t_last, tok_acc, hist = time.time(), 0.0, []
    t_first = None  # steps auto: when this invocation's first step (with its compile) had finished
    try:
        while (total is None or step < total) and not stop["flag"]:
            ids, mask, seg, pos = batcher.batch(step)
            feats = None if fcache is None else batcher.features(step, fcache)
            lr = learning_rate(cfg, step, total)
            draft.params, opt_state, m = step_fn(draft.params, opt_state, np.float32(lr), target.params, ids, mask,
                                                 seg, pos, feats, vocab_dev, jax.random.fold_in(key, step))
            step += 1
            hist.append(m)
            tok_acc += cfg["batch_size"] * cfg["seq_len"]
            bar.update(1)
            if total is None:  # steps auto: time the steps after the first, then fix the count
                if t_first is None:
                    jax.block_until_ready(draft.params)
                    t_first, first_step = time.time(), step
                elif step - first_step >= 5 and time.time() - t_first >= 0.05 * limit_s:
                    jax.block_until_ready(draft.params)
                    per_step = (time.time() - t_first) / (step - first_step)
                    total = fit_steps(steps_file, step, per_step, deadline, cfg["time_limit"])
                    bar.total = total
                    bar.refresh()
                    tqdm.write(f"steps auto: {per_step:.3f} s a step, {total} steps fit in the time limit")
            if step % cfg["log_every"] == 0 or step == total:
                mm = {k: float(np.mean([float(h[k]) for h in hist])) for k in hist[0]}
                dt = time.time() - t_last
                rec = dict(step=step, lr=lr, tok_s=tok_acc / dt, time=time.time(), **mm)
                bar.set_postfix(loss=f"{mm['loss']:.3f}", acc=f"{mm['acc']:.3f}", tok_s=f"{rec['tok_s']:.0f}")
                log.write(json.dumps(rec) + "\n")
                log.flush()
                hist, tok_acc, t_last = [], 0.0, time.time()
            if step % cfg["ckpt_every"] == 0:
                save(step)
            if deadline is not None and time.time() > deadline and (total is None or step < total):
                stop.update(flag=True, timed_out=True)
                tqdm.write(f"time limit of {cfg['time_limit']} min reached at step {step}: exporting the head as it is")
            if step % cfg["eval_every"] == 0 or step == total or stop["timed_out"]:
                evaluate(step)
                t_last = time.time()
    except KeyboardInterrupt:
        print("interrupted: saving a checkpoint")
    finally:
        if step > start:
            save(step)
        bar.close()
    if cfg["steps"] == 0:
        print("--steps 0: the --init-from head was evaluated; nothing trained, nothing exported")
    elif (total is not None and step >= total) or stop["timed_out"]:
        save_draft(whole(), os.path.join(cfg["out"], "final_orbax"), format="orbax")
        if cfg["export"]:
            save_draft(whole(), cfg["export"], format="eagle3" if draft.arch == "eagle3" else "eagle", dtype="bfloat16")
            if vocab is not None and draft.arch != "eagle3":
                with open(os.path.join(cfg["export"], "draft_vocab.json"), "w") as f:
                    json.dump({"ids": [int(i) for i in vocab]}, f)
            print(f"exported EAGLE-format head to {cfg['export']}")


if __name__ == "__main__":
    main()
