"""Training logs: a progress line, a tqdm bar and TensorBoard scalars, from rank 0 only.

``--log-format plain`` (default) writes ``12:04:31 epoch 3/7 step 255/441 loss 1.81 lr
4.5e-4 102 pairs/s eta 3:10``; ``--log-format original`` writes the original's
``SpeedCallBack`` line. :mod:`rwkv_clip.report` reads both back from ``training.log``.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time

LOGGER_NAME = "rwkv_clip.train"
LOG_FORMATS = ("plain", "original")


class _ConsoleHandler(logging.StreamHandler):
    """Writes through tqdm so a log line never lands in the middle of the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # logging must never raise
            self.handleError(record)


def setup_logging(output: str, rank: int, fmt: str = "plain") -> logging.Logger:
    """Rank 0: to stdout and OUTPUT/training.log, each line behind its time ('plain':
    ``HH:MM:SS`` on the console, the date too in the file) or the original's
    'Training: <date time>-' prefix ('original'). Other ranks: warnings and errors only."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {LOG_FORMATS}")
    log = logging.getLogger(LOGGER_NAME)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    if fmt == "original":
        file_fmt = console_fmt = logging.Formatter("Training: %(asctime)s-%(message)s")
    else:
        file_fmt = logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S")
        console_fmt = logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
    if rank == 0:
        os.makedirs(output, exist_ok=True)
        handlers = [(logging.FileHandler(os.path.join(output, "training.log")), file_fmt),
                    (_ConsoleHandler(sys.stdout), console_fmt)]
        log.setLevel(logging.INFO)
    else:
        handlers = [(logging.StreamHandler(sys.stderr), console_fmt)]
        log.setLevel(logging.WARNING)
    for h, formatter in handlers:
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


def format_lr(lr: float) -> str:
    """Two significant digits, short exponent: 4.5e-4, 1e-3, 0."""
    if lr == 0:
        return "0"
    mantissa, exponent = f"{lr:.1e}".split("e")
    if mantissa.endswith(".0"):
        mantissa = mantissa[:-2]
    return f"{mantissa}e{int(exponent)}"


def format_duration(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour on."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class SpeedLogger:
    """Progress line every ``every`` optimizer steps (and at the last step); pairs/s
    measured over the interval, eta from the run's mean step time so far.

    ``fmt``: 'plain' (default) or 'original' (see the module docstring);
    ``steps_per_epoch`` lets the plain line name the epoch."""

    def __init__(self, every: int, total_steps: int, world_size: int, start_step: int = 0,
                 fmt: str = "plain", steps_per_epoch: int | None = None):
        if fmt not in LOG_FORMATS:
            raise ValueError(f"log format {fmt!r}: expected one of {LOG_FORMATS}")
        self.every = every
        self.total_steps = total_steps
        self.world_size = world_size
        self.fmt = fmt
        self.steps_per_epoch = steps_per_epoch
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
        seconds_left = (now - self.time_start) / max(done, 1) * (self.total_steps - step)
        if self.fmt == "original":
            line = (f"rank:{int(speed):d} total:{int(total):d} lr:[{lr:.8f}] step:{step:d} "
                    f"amp:{int(amp_scale):d} required:{seconds_left / 3600:.1f} hours "
                    f"[{self.loss.avg:.3f}]")
        else:
            line = self.plain_line(step, self.loss.avg, lr, total, seconds_left)
        self.loss.reset()
        self.samples = 0
        self.tic = now
        return line

    def plain_line(self, step: int, loss: float, lr: float, pairs_per_second: float,
                   seconds_left: float) -> str:
        epoch = ""
        if self.steps_per_epoch:
            epochs = math.ceil(self.total_steps / self.steps_per_epoch)
            epoch = f"epoch {min(epochs, (step - 1) // self.steps_per_epoch + 1)}/{epochs} "
        return (f"{epoch}step {step}/{self.total_steps} loss {loss:.2f} lr {format_lr(lr)} "
                f"{pairs_per_second:.0f} pairs/s eta {format_duration(seconds_left)}")


class Board:
    """TensorBoard scalars (loss, lr, logit_scale, samples/s) on rank 0; no-op elsewhere."""

    def __init__(self, output: str, enabled: bool) -> None:
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(os.path.join(output, "tensorboard"))

    def scalars(self, step: int, **values: float | None) -> None:
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
