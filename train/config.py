"""A draft-training run's settings: `TrainConfig`, read from the defaults, a YAML file and the flags
given, in that order, and checked before anything loads (one-line errors)."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import yaml

from eagle2_jax.config import TreeConfig


def _key(default, help: str):
    """A field with its flag's help text; a dict default (the tree) is copied for each config."""
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every key of the YAML file (and flag of train.draft); `help` in each field's metadata."""

    target: str = _key("smollm2-135m-instruct", "target model: a named model, a Hugging Face directory or a .gguf file")
    dtype: str = _key("float32", "the target's dtype: float32, bfloat16 or auto (float32 on CPU, bfloat16 on GPU/TPU)")
    data: str | list | None = _key(None, "shard directories written by python -m train.data, comma-separated; "
                                         "held-out examples come from the first")
    out: str | None = _key(None, "run directory: Orbax checkpoints, log.jsonl, config.json, the feature cache, "
                                 "final_orbax")
    export: str | None = _key(None, "directory for the trained head in the EAGLE layout (bf16 safetensors); "
                                    "unset: not exported")
    steps: int | str = _key(600, "optimizer steps in all (a rerun resumes up to it); auto, with --time-limit: as "
                                 "many as fit in the limit at the rate of the first steps, so the cosine decay ends "
                                 "with the time; 0 with --init-from evaluates that head, nothing more")
    batch_size: int = _key(8, "packed sequences per step")
    seq_len: int = _key(384, "tokens per packed sequence")
    lr: float = _key(1e-3, "peak learning rate (AdamW)")
    warmup_steps: int = _key(30, "linear warm-up steps before the cosine decay")
    min_lr_ratio: float = _key(0.05, "floor of the cosine decay, as a fraction of lr")
    weight_decay: float = _key(0.0, "AdamW weight decay")
    clip_norm: float = _key(0.5, "global gradient-norm clip")
    noise: float = _key(0.1, "EAGLE-2: uniform noise U(-noise, noise) on the input features")
    v_weight: float = _key(1.0, "EAGLE-2: weight of the smooth-L1 feature regression")
    p_weight: float = _key(0.1, "EAGLE-2: weight of the soft cross-entropy through the target's LM head")
    heldout_examples: int = _key(32, "last examples of the first data set, never trained on, used by the evaluations")
    seed: int = _key(0, "initialisation and batch-order seed")
    mesh: str | None = _key(None, "device mesh, e.g. data=2 (unset: one device)")
    log_every: int = _key(10, "steps between log lines (log.jsonl)")
    ckpt_every: int = _key(50, "steps between Orbax checkpoints")
    eval_every: int = _key(200, "steps between held-out evaluations")
    eval_tau_prompts: int = _key(4, "held-out prompts generated with --tree at each evaluation to report tau (0: none)")
    eval_tau_tokens: int = _key(64, "new tokens per such prompt")
    tree: dict = _key(dict(depth=5, top_k=10, total_tokens=60),
                      "depth,top_k,total_tokens of the evaluation tree (e.g. 3,4,16)")
    init_from: str | None = _key(None, "a head directory to continue from (same arch)")
    feature_cache: bool = _key(True, "true: the target's features computed once into <out>/features, read by every step")
    draft_vocab: int | str | None = _key(None, "cross-entropy over this many most frequent assistant tokens, "
                                               "or a draft_vocab.json path")
    feature_batch: int = _key(8, "packed sequences per target forward while the feature cache fills")
    rollout: int = _key(1, "training-time test: steps of the head's own rollout (1: none)")
    rollout_decay: float = _key(0.8, "loss weight of rollout step k: rollout_decay**k")
    arch: str = _key("eagle2", "eagle2 (an EAGLE-1/2 head) or eagle3 (an EAGLE-3 head)")
    eagle3_head_init: str = _key("target", "eagle3: the final norm and LM head start from the target's (target) "
                                           "or at random (random)")
    vocab_mask: bool = _key(False, "eagle3: leave out of the loss the positions whose target argmax is not a draft token")
    time_limit: float = _key(0.0, "minutes of training after which the head is exported as it is "
                                  "(0: none; a rerun resumes)")
    example_len: int = _key(2048, "examples are cropped to this many tokens")
    aux_layers: str | list | None = _key(None, "eagle3: the three target layers whose entering streams fc fuses, "
                                               "e.g. 2,15,29")

    @property
    def data_dirs(self) -> list:
        return self.data if isinstance(self.data, list) else str(self.data).split(",")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def defaults() -> dict:
    """Each key's default value."""
    return TrainConfig().as_dict()


HELP = {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)}

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


def read_config(path: str | None, flags: dict) -> TrainConfig:
    """The defaults, overridden by the YAML file at `path` (if any), overridden by `flags` (None: not
    given), checked: a value no run can use exits with one line."""
    values = defaults()
    if path:
        if not os.path.exists(path):
            sys.exit(f"error: config file not found: {path}")
        with open(path) as f:
            y = yaml.safe_load(f) or {}
        unknown = set(y) - set(values)
        if unknown:
            sys.exit(f"error: unknown key(s) in {path}: {', '.join(sorted(unknown))}")
        values.update(y)
    values.update({k: v for k, v in flags.items() if v is not None})
    for req in ("data", "out"):
        if not values[req]:
            sys.exit(f"error: --{req} is required (or set it in --config)")
    cfg = TrainConfig(**values)
    check_config(cfg)
    return cfg


def check_config(cfg: TrainConfig):
    """One-line errors for values no run can use, before the target loads."""
    if cfg.steps == "auto" and not (isinstance(cfg.time_limit, (int, float)) and cfg.time_limit > 0):
        sys.exit("error: steps auto fits the steps to --time-limit: give one (minutes), or a number of steps")
    for k, (typ, low, inclusive) in RANGES.items():
        v = getattr(cfg, k)
        if k == "steps" and v == "auto":
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (typ is float or isinstance(v, int))
        if not ok:
            sys.exit(f"error: {k} must be {'an integer' if typ is int else 'a number'}, got {v!r}")
        if low is not None and (v < low or (v == low and not inclusive)):
            sys.exit(f"error: {k} must be {'at least' if inclusive else 'above'} {low}, got {v!r}")
    if cfg.min_lr_ratio > 1:
        sys.exit(f"error: min_lr_ratio must be at most 1, got {cfg.min_lr_ratio!r}")
    for k, allowed in CHOICES.items():
        if getattr(cfg, k) not in allowed:
            sys.exit(f"error: {k} must be {' or '.join(allowed)}, got {getattr(cfg, k)!r}")
    for k in ("feature_cache", "vocab_mask"):
        if not isinstance(getattr(cfg, k), bool):
            sys.exit(f"error: {k} must be true or false, got {getattr(cfg, k)!r}")
    _check_tree(cfg.tree)
    _check_paths(cfg)
    if cfg.vocab_mask and not cfg.draft_vocab and not cfg.init_from:  # (an EAGLE-3 head brings its own)
        sys.exit("error: --vocab-mask needs a draft vocabulary (--draft-vocab)")
    held = export_arch(cfg.export)
    if held and held != cfg.arch:  # (the shipped config exports to the packaged EAGLE-2 head)
        sys.exit(f"error: --export {cfg.export} holds an {held} head, which this --arch {cfg.arch} run "
                 "would overwrite: pass --export another directory")


def _check_tree(tree):
    try:
        TreeConfig(**tree)
    except (TypeError, ValueError) as e:
        sys.exit(f"error: tree {tree!r}: {e}")


def _check_paths(cfg: TrainConfig):
    if cfg.steps == 0 and not cfg.init_from:
        sys.exit("error: --steps 0 only evaluates an --init-from head: give one, or steps to train")
    ckpts = os.path.join(cfg.out, "checkpoints")
    if cfg.steps == 0 and os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts)):
        sys.exit(f"error: --steps 0 evaluates the --init-from head, but {cfg.out} holds a run's checkpoints, "
                 "which would be restored instead: use another --out")
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        sys.exit(f"error: --out {cfg.out} exists and is not a directory")
    if cfg.export and os.path.exists(cfg.export) and not os.path.isdir(cfg.export):
        sys.exit(f"error: --export {cfg.export} exists and is not a directory")


def export_arch(directory) -> str | None:
    """The arch of the head an export directory already holds (by its config.json), else None."""
    path = os.path.join(directory, "config.json") if directory else ""
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    return "eagle3" if "draft_vocab_size" in raw or raw.get("arch") == "eagle3" else "eagle2"
