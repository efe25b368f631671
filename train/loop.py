"""The training run of a draft head: resume from the latest checkpoint, step through the packed
batches on the learning-rate schedule, log, evaluate and checkpoint on the way, stop at the step
count, the time limit, Ctrl-C or SIGTERM, and export the head once it is done."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from tqdm import tqdm

from eagle2_jax import save_draft
from train.batches import Batcher
from train.config import TrainConfig
from train.evaluate import heldout_record
from train.features import FeatureCache, fingerprint
from train.loss import target_features
from train.schedule import StepTimer, learning_rate, read_fitted_steps
from train.step import build_step, make_optimizer


class Checkpoints:
    """Orbax checkpoints of the trained params and the optimiser state in <out>/checkpoints."""

    def __init__(self, out: str):
        self.dir = os.path.abspath(os.path.join(out, "checkpoints"))
        self.mngr = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

    def restore(self, params, opt_state) -> tuple:
        """(step, params, opt_state) of the latest checkpoint; (0, params, opt_state) where there is none."""
        start = self.mngr.latest_step()
        if start is None:
            return 0, params, opt_state
        restored = self.mngr.restore(start, args=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}))
        print(f"resumed from step {start} ({self.dir})")
        return start, restored["params"], restored["opt_state"]

    def save(self, step: int, params, opt_state):
        if self.mngr.latest_step() == step:  # a periodic checkpoint already saved this step
            return
        self.mngr.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}), force=True)
        self.mngr.wait_until_finished()


class Log:
    """<out>/log.jsonl, appended one flushed JSON record a line, so a killed run keeps what it logged."""

    def __init__(self, path: str):
        self.file = open(path, "a")

    def write(self, record: dict):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


class Meter:
    """The metrics of the steps since the last log line, averaged, and their tokens per second."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.hist, self.tokens = [], 0.0
        self.restart()

    def restart(self):
        """Count time from now (after a log line, or an evaluation that should not slow the rate)."""
        self.t_last = time.time()

    def add(self, metrics):
        self.hist.append(metrics)
        self.tokens += self.tokens_per_step

    def record(self, step: int, lr) -> dict:
        mm = {k: float(np.mean([float(h[k]) for h in self.hist])) for k in self.hist[0]}
        rec = dict(step=step, lr=lr, tok_s=self.tokens / (time.time() - self.t_last), time=time.time(), **mm)
        self.hist, self.tokens = [], 0.0
        self.restart()
        return rec


def fill_feature_cache(cfg: TrainConfig, target, aux: tuple, batcher: Batcher) -> FeatureCache:
    """The run's feature cache, holding the target's features of every training example."""
    fcache = FeatureCache(os.path.join(cfg.out, "features"), target.config.hidden_size * (len(aux) + 1),
                          fingerprint(str(cfg.target), cfg.dtype, aux))
    feat_fn = jax.jit(lambda p, ids: target_features(target.module, p, ids, aux))
    t0 = time.time()
    n = fcache.fill([t for t, _ in batcher.examples], lambda ids: feat_fn(target.params, ids),
                    cfg.feature_batch * cfg.seq_len)
    if n:
        print(f"target features: {n / (time.time() - t0):.0f} tokens/s, {time.time() - t0:.0f} s")
    return fcache


def export(cfg: TrainConfig, head, vocab):
    """The trained head in ours (<out>/final_orbax) and, with `export`, in the EAGLE layout (bf16),
    an EAGLE-2 head's draft vocabulary beside it."""
    save_draft(head, os.path.join(cfg.out, "final_orbax"), format="orbax")
    if not cfg.export:
        return
    save_draft(head, cfg.export, format="eagle3" if head.arch == "eagle3" else "eagle", dtype="bfloat16")
    if vocab is not None and head.arch != "eagle3":
        with open(os.path.join(cfg.export, "draft_vocab.json"), "w") as f:
            json.dump({"ids": [int(i) for i in vocab]}, f)
    print(f"exported EAGLE-format head to {cfg.export}")


def train_head(cfg: TrainConfig, target, draft, vocab, examples: list, heldout: list, order_seed: int):
    """Train `draft` on `examples` (batch order from `order_seed`) with its loss over the draft
    vocabulary `vocab` (ids or None), resuming from the latest checkpoint in cfg.out and evaluating
    on `heldout`; export it once it reaches the step count or the time limit."""
    fixed = {k: v for k, v in draft.params.items() if k == "d2t"}  # not trained: EAGLE-3's vocabulary map
    params = {k: v for k, v in draft.params.items() if k not in fixed}

    def whole(params):
        return dataclasses.replace(draft, params={**params, **fixed})

    opt = make_optimizer(cfg)
    opt_state = opt.init(params)
    step_fn, eval_fn = build_step(target.module, draft.module, opt, cfg, fixed)
    batcher = Batcher(examples, cfg.batch_size, cfg.seq_len, order_seed, example_len=cfg.example_len)
    held = Batcher(heldout, min(cfg.batch_size, len(heldout)), cfg.seq_len, cfg.seed, pack=False)
    print(f"{len(batcher)} packed sequences of {cfg.seq_len} tokens per epoch")
    vocab_dev = None if vocab is None else jnp.asarray(vocab, jnp.int32)
    if vocab is not None:
        print(f"cross-entropy over a draft vocabulary of {len(vocab)} tokens")
    fcache = fill_feature_cache(cfg, target, tuple(draft.aux_layers), batcher) if cfg.feature_cache else None
    ckpts = Checkpoints(cfg.out)
    start, params, opt_state = ckpts.restore(params, opt_state)
    with open(os.path.join(cfg.out, "config.json"), "w") as f:
        json.dump(cfg.as_dict(), f, indent=2)
    log = Log(os.path.join(cfg.out, "log.jsonl"))

    def evaluate(step, params):
        rec = heldout_record(step, eval_fn, params, whole(params), target, heldout, held, cfg, vocab, vocab_dev)
        log.write(rec)
        tqdm.write(f"step {step}: held-out top-1 acc {rec['eval_acc']:.3f}, tau {rec['eval_tau']}")

    if cfg.init_from and start == 0:
        evaluate(0, params)  # the head it starts from, on the same held-out examples: the baseline

    stop = {"flag": False, "timed_out": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.update(flag=True))
    deadline = time.time() + 60 * float(cfg.time_limit) if cfg.time_limit else None
    steps_file = os.path.join(cfg.out, "steps.json")
    total = cfg.steps if cfg.steps != "auto" else read_fitted_steps(steps_file)
    timer = StepTimer(steps_file, deadline, cfg.time_limit)
    step = start
    key = jax.random.PRNGKey(cfg.seed)
    bar = tqdm(total=total, initial=start, unit="step", desc="train draft", dynamic_ncols=True)
    meter = Meter(cfg.batch_size * cfg.seq_len)
    try:
        while (total is None or step < total) and not stop["flag"]:
            ids, mask, seg, pos = batcher.batch(step)
            feats = None if fcache is None else batcher.features(step, fcache)
            lr = learning_rate(cfg, step, total)
            params, opt_state, m = step_fn(params, opt_state, np.float32(lr), target.params, ids, mask, seg, pos,
                                           feats, vocab_dev, jax.random.fold_in(key, step))
            step += 1
            meter.add(m)
            bar.update(1)
            if total is None:  # steps auto: time the steps after the first, then fix the count
                total = timer.fitted(step, params)
                if total is not None:
                    bar.total = total
                    bar.refresh()
                    tqdm.write(f"steps auto: {timer.per_step:.3f} s a step, {total} steps fit in the time limit")
            if step % cfg.log_every == 0 or step == total:
                rec = meter.record(step, lr)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['acc']:.3f}", tok_s=f"{rec['tok_s']:.0f}")
                log.write(rec)
            if step % cfg.ckpt_every == 0:
                ckpts.save(step, params, opt_state)
            if deadline is not None and time.time() > deadline and (total is None or step < total):
                stop.update(flag=True, timed_out=True)
                tqdm.write(f"time limit of {cfg.time_limit} min reached at step {step}: exporting the head as it is")
            if step % cfg.eval_every == 0 or step == total or stop["timed_out"]:
                evaluate(step, params)
                meter.restart()
    except KeyboardInterrupt:
        print("interrupted: saving a checkpoint")
    finally:
        if step > start:
            ckpts.save(step, params, opt_state)
        bar.close()
    if cfg.steps == 0:
        print("--steps 0: the --init-from head was evaluated; nothing trained, nothing exported")
    elif (total is not None and step >= total) or stop["timed_out"]:
        export(cfg, whole(params), vocab)
