"""Learning-rate schedules as pure functions of the optimizer step.

:func:`lr_at` holds no state, so a resumed run needs only the step counter and a run
whose length changed on resume continues the new schedule.
"""
from __future__ import annotations

import math

import torch

SCHEDULES = ("cosine", "linear")
DIV_FACTOR = 25.0          # OneCycleLR: initial lr = max lr / 25
FINAL_DIV_FACTOR = 1e4     # OneCycleLR: final lr = initial lr / 1e4
BASE_MOMENTUM = 0.85       # OneCycleLR: beta1 at the peak lr
MAX_MOMENTUM = 0.95        # OneCycleLR: beta1 at the start and the end


def warmup_fraction(warmup: float, total_steps: int) -> float:
    """OneCycleLR divides by (warmup x total - 1): very short runs (a handful of steps,
    e.g. tests) need at least 1.5 warmup steps; long runs are unaffected."""
    if warmup * total_steps > 1.5:
        return warmup
    return min(1.5 / total_steps, 0.99)


def _cos(start: float, end: float, pct: float) -> float:
    """Cosine from ``start`` (pct 0) to ``end`` (pct 1), written as torch's OneCycleLR
    writes it so the two agree to the last bit."""
    cos_out = math.cos(math.pi * pct) + 1
    return end + (start - end) / 2.0 * cos_out


def lr_at(step: int, *, kind: str, max_lr: float, total_steps: int,
          warmup: float = 0.1) -> tuple[float, float | None]:
    """(learning rate, beta1 or None) for the optimizer step after ``step`` done steps.

    ``beta1`` is None where the schedule leaves it alone (``linear``). Steps past the end
    stay at the final value (OneCycleLR would raise). ``cosine`` is the original's
    ``OneCycleLR(max_lr=lr, pct_start=0.1)`` with PyTorch's defaults, beta1 cycled;
    ``linear`` is its ``LinearLR(1 -> 0)``.
    """
    if total_steps < 1:
        raise ValueError(f"the schedule needs at least one optimizer step, got {total_steps}")
    step = min(max(int(step), 0), total_steps - 1) if kind == "cosine" else max(int(step), 0)
    if kind == "linear":
        return max_lr * (1.0 - min(step, total_steps) / total_steps), None
    if kind != "cosine":
        raise ValueError(f"unknown lr scheduler {kind!r}: expected one of {', '.join(SCHEDULES)}")
    initial_lr = max_lr / DIV_FACTOR
    min_lr = initial_lr / FINAL_DIV_FACTOR
    peak = float(warmup_fraction(warmup, total_steps) * total_steps) - 1
    if step <= peak:  # warmup: lr up, beta1 down
        pct = step / peak
        return (_cos(initial_lr, max_lr, pct), _cos(MAX_MOMENTUM, BASE_MOMENTUM, pct))
    pct = (step - peak) / (total_steps - 1 - peak)  # anneal: lr down, beta1 up
    return _cos(max_lr, min_lr, pct), _cos(BASE_MOMENTUM, MAX_MOMENTUM, pct)


def set_lr(optimizer: torch.optim.Optimizer, lr: float, beta1: float | None) -> None:
    """Write the step's lr (and beta1: Adam's betas[0], SGD's momentum) into every group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
        if beta1 is None:
            continue
        if "betas" in group:
            group["betas"] = (beta1, *group["betas"][1:])
        else:
            group["momentum"] = beta1
