"""Learning-rate schedules, stepped once per optimizer step (not per micro-batch).

* ``cosine``: the original's ``OneCycleLR`` (PyTorch defaults: start at lr/25, cosine
  warmup to lr over the first ``warmup`` fraction, cosine anneal to lr/25/1e4, and
  beta1/momentum cycled 0.95 -> 0.85 -> 0.95). The original passed
  ``steps_per_epoch``/``epochs``; we pass the same product as ``total_steps``.
* ``linear``: the original's ``LinearLR`` from lr down to 0 over all steps, no warmup.
"""
from __future__ import annotations

import torch
from torch.optim import lr_scheduler


def build_scheduler(optimizer: torch.optim.Optimizer, kind: str, total_steps: int,
                    warmup: float = 0.1):
    """One scheduler for ``total_steps`` optimizer steps."""
    if total_steps < 1:
        raise ValueError(f"the schedule needs at least one optimizer step, got {total_steps}")
    if kind == "cosine":
        max_lr = [group["lr"] for group in optimizer.param_groups]
        return lr_scheduler.OneCycleLR(optimizer, max_lr=max_lr, total_steps=total_steps,
                                       pct_start=warmup_fraction(warmup, total_steps),
                                       anneal_strategy="cos", cycle_momentum=True)
    if kind == "linear":
        return lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.0,
                                     total_iters=total_steps)
    raise ValueError(f"unknown lr scheduler {kind!r}: expected cosine or linear")


def warmup_fraction(warmup: float, total_steps: int) -> float:
    """OneCycleLR divides by (warmup x total - 1): very short runs (a handful of steps,
    e.g. tests) need at least 1.5 warmup steps; long runs are unaffected."""
    if warmup * total_steps > 1.5:
        return warmup
    return min(1.5 / total_steps, 0.99)


def step_scheduler(scheduler, step: int, total_steps: int) -> None:
    """Advance after optimizer step number ``step`` (1-based); OneCycleLR raises when
    stepped past its end, so the last step leaves it at its final value."""
    if step < total_steps:
        scheduler.step()


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])
