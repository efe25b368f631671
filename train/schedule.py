"""The learning rate of each step, and the step count `steps: auto` fits to the time limit."""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from train.config import TrainConfig


def learning_rate(cfg: TrainConfig, step: int, total) -> float:
    """The learning rate of optimizer step `step` (0-based) in a run of `total` steps: a linear
    warm-up from 0 over warmup_steps, then a cosine decay to lr * min_lr_ratio at `total` (optax's
    warmup_cosine_decay_schedule). total None (steps auto, not yet fixed): the warm-up, then lr."""
    peak, warm = float(cfg.lr), int(cfg.warmup_steps)
    if step < warm:
        return peak * step / warm
    if total is None:
        return peak
    end = peak * float(cfg.min_lr_ratio)
    span = max(total, warm + 1) - warm
    frac = min(step - warm, span) / span
    return end + (peak - end) * 0.5 * (1 + np.cos(np.pi * frac))


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


class StepTimer:
    """steps auto: times this invocation's steps after its first (which compiles) and fixes the count
    once at least 5 of them and 5% of the time limit have passed."""

    def __init__(self, path: str, deadline: float, time_limit: float):
        self.path, self.deadline, self.time_limit = path, deadline, time_limit
        self.limit_s = 60 * float(time_limit)
        self.t_first = self.first_step = self.per_step = None

    def fitted(self, step: int, params) -> int | None:
        """After step `step` (1-based count of steps done): the fitted count once fixed, else None."""
        if self.t_first is None:
            jax.block_until_ready(params)
            self.t_first, self.first_step = time.time(), step
            return None
        if step - self.first_step < 5 or time.time() - self.t_first < 0.05 * self.limit_s:
            return None
        jax.block_until_ready(params)
        self.per_step = (time.time() - self.t_first) / (step - self.first_step)
        return fit_steps(self.path, step, self.per_step, self.deadline, self.time_limit)
