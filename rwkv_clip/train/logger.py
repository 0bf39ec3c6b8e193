"""Training logs: the original's speed line, a tqdm bar and TensorBoard scalars.

Only rank 0 writes anything. The speed line (every ``--log-every`` optimizer steps) is
the original's ``SpeedCallBack`` format::

    rank:<samples/s this rank> total:<samples/s all ranks> lr:[<lr>] step:<step>
    amp:<grad scale> required:<hours left> hours [<mean loss since last line>]
"""
from __future__ import annotations

import logging
import os
import sys
import time

LOGGER_NAME = "rwkv_clip.train"


class _ConsoleHandler(logging.StreamHandler):
    """Writes through tqdm so a log line never lands in the middle of the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def setup_logging(output: str, rank: int) -> logging.Logger:
    """Rank 0: 'Training: <time>-<message>' to stdout and OUTPUT/training.log (as the
    original). Other ranks: warnings and errors only."""
    log = logging.getLogger(LOGGER_NAME)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    formatter = logging.Formatter("Training: %(asctime)s-%(message)s")
    if rank == 0:
        os.makedirs(output, exist_ok=True)
        handlers = [logging.FileHandler(os.path.join(output, "training.log")),
                    _ConsoleHandler(sys.stdout)]
        log.setLevel(logging.INFO)
    else:
        handlers = [logging.StreamHandler(sys.stderr)]
        log.setLevel(logging.WARNING)
    for h in handlers:
        h.setFormatter(formatter)
        log.addHandler(h)
    return log


def close_logging() -> None:
    log = logging.getLogger(LOGGER_NAME)
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()


class AverageMeter:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sum = 0.0
        self.count = 0

    def update(self, value: float, n: int = 1) -> None:
        self.sum += value * n
        self.count += n

    @property
    def avg(self) -> float:
        return self.sum / self.count if self.count else float("nan")


class SpeedLogger:
    """Speed line every ``every`` optimizer steps; samples/s measured over the interval."""

    def __init__(self, every: int, total_steps: int, world_size: int, start_step: int = 0):
        self.every = every
        self.total_steps = total_steps
        self.world_size = world_size
        self.loss = AverageMeter()
        self.start_step = start_step
        self.time_start = time.time()
        self.tic = time.time()
        self.samples = 0
        self.last_speed = 0.0

    def update(self, *, step: int, loss: float, samples: int, lr: float, amp_scale: float):
        """Record one optimizer step; return the speed line when one is due, else None."""
        self.loss.update(loss)
        self.samples += samples
        if step % self.every and step != self.total_steps:
            return None
        now = time.time()
        elapsed = max(now - self.tic, 1e-9)
        speed = self.samples / elapsed
        self.last_speed = speed
        total = speed * self.world_size
        done = step - self.start_step
        hours_now = (now - self.time_start) / 3600
        hours_left = hours_now / max(done, 1) * (self.total_steps - step)
        line = (f"rank:{int(speed):d} total:{int(total):d} lr:[{lr:.8f}] step:{step:d} "
                f"amp:{int(amp_scale):d} required:{hours_left:.1f} hours "
                f"[{self.loss.avg:.3f}]")
        self.loss.reset()
        self.samples = 0
        self.tic = now
        return line


class Board:
    """TensorBoard scalars (loss, lr, logit_scale, samples/s) on rank 0; no-op elsewhere."""

    def __init__(self, output: str, enabled: bool) -> None:
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(output, "tensorboard"))

    def scalars(self, step: int, **values: float) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            if value is not None:
                self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None


def progress_bar(total: int, initial: int, enabled: bool):
    """tqdm over optimizer steps (rank 0 only; hidden when stderr is not a terminal, so
    redirected logs stay clean), or None."""
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                desc="train", file=sys.stderr, leave=False, disable=None)
