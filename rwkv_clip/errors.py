"""One error type for everything a user can act on, and the one place that turns it into
a command-line message.

Every error meant for users derives from :class:`RWKVCLIPError`; command-line tools wrap
their ``main`` in :func:`run_cli`.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable
from typing import NoReturn

EXIT_USER_ERROR = 2


class RWKVCLIPError(Exception):
    """Base class of every error meant for the user; the message says what to fix.

    The message names the culprit (file, flag, config key, record) and what was expected.
    The concrete classes also derive from the builtin a caller would naturally catch
    (``ValueError`` for bad values, ``RuntimeError`` for failures while running), so code
    written against those keeps working.
    """


class ConfigError(RWKVCLIPError, ValueError):
    """A model config that cannot build a model; the message names the key."""


class DispatchError(ConfigError):
    """An unknown op name in the dispatch table (rwkv_clip.ops.dispatch), its override or
    its pins."""


class CheckpointError(RWKVCLIPError, RuntimeError):
    """A checkpoint that cannot be loaded into the model; the message says why."""


class WKVError(RWKVCLIPError, RuntimeError):
    """A WKV call that cannot run: bad shapes, unsupported sizes, missing compiler."""


class KernelBuildError(WKVError):
    """Building a native WKV kernel failed; the message ends with the compiler's last lines."""


class KernelLockTimeoutError(KernelBuildError):
    """Another process held a kernel's build lock past the timeout: nothing was compiled."""


class DataError(RWKVCLIPError, RuntimeError):
    """A data file is missing, truncated, corrupt or has an unexpected layout.

    The message always names the file and, where there is one, the record.
    """

    def __init__(self, message: str, path: str | None = None, record=None):
        self.message = message
        self.path = path
        self.record = record
        first, _, details = message.partition("\n")  # file and record stay on the first line
        parts = [first]
        if path is not None:
            parts.append(f"file: {path}")
        if record is not None:
            parts.append(f"record: {record}")
        super().__init__(" | ".join(parts) + (f"\n{details}" if details else ""))

    def __reduce__(self):  # pickled (data-loader workers) with its parts, not the joined text
        return type(self), (self.message, self.path, self.record)


class DistributedError(RWKVCLIPError, RuntimeError):
    """A launch environment or device choice that cannot work."""


class TrainArgsError(RWKVCLIPError, ValueError):
    """Inconsistent training options; the message names the flags."""


class TrainingError(RWKVCLIPError, RuntimeError):
    """Training stopped for a reason the user can act on; the message says what to do."""


class NonFiniteLossError(TrainingError, FloatingPointError):
    """The loss became NaN or Inf; raised before the optimizer step."""


class ResumeError(RWKVCLIPError, RuntimeError):
    """A checkpoint that cannot be resumed from; the message says why."""


class EvalError(RWKVCLIPError, RuntimeError):
    """An evaluation problem the user can fix (missing data, unreadable file, bad folder)."""


class DatasetNotFoundError(EvalError):
    """An evaluation data set is not where it was looked for."""


class ImageReadError(EvalError):
    """An evaluation image cannot be read or decoded."""


class PeerRankError(EvalError):
    """Another rank failed; its own error message says why."""


class MeasurementError(RWKVCLIPError, RuntimeError):
    """A measuring run failed (out of memory, bad backend, ...); the message ends with the
    worker's last lines of stderr."""


class PrecisionError(RWKVCLIPError, ValueError):
    """An unknown precision name, or one the device cannot run."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose own errors (unknown flag, bad value, invalid choice) are one line and
    exit status 2, not the usage block, with a "did you mean" for a mistyped flag or choice.

    Every command-line parser of the package is one, so this is the one place such errors
    are formatted."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {self.one_line(message)}\n")

    def one_line(self, message: str) -> str:
        """argparse's ``message`` with its suggestions and the pointer to ``--help``."""
        hint = self.suggestion(message)
        return f"{message}{hint} ({self.prog} --help lists every flag)"

    def suggestion(self, message: str) -> str:
        """``; did you mean --X?`` for an unknown flag or an invalid choice close to a
        valid one, else ``""``."""
        pairs: list[tuple[str, str]] = []  # (what was given, the close valid one)
        if message.startswith("unrecognized arguments:"):
            flags = [name for name in self._option_string_actions if name.startswith("--")]
            for word in message.split(":", 1)[1].split():
                given = word.split("=", 1)[0]
                close = difflib.get_close_matches(given, flags, n=1) \
                    if given.startswith("--") else []
                pairs += [(given, close[0])] if close else []
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            options = re.findall(r"'([^']*)'", choice.group(2))
            close = difflib.get_close_matches(choice.group(1), options, n=1, cutoff=0.5)
            pairs += [(choice.group(1), close[0])] if close else []
        if len(pairs) == 1:
            return f"; did you mean {pairs[0][1]}?"
        if pairs:
            return "; did you mean " + ", ".join(f"{b} for {a}" for a, b in pairs) + "?"
        return ""


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` folded onto one line."""
    parts = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return "; ".join(parts) or type(exc).__name__


def report(exc: BaseException, prog: str | None = None) -> None:
    """Print ``PROG: error: MESSAGE`` on stderr: the message's first line (the essential)
    on the error line, its further lines (details) indented below it."""
    prefix = f"{prog}: " if prog else ""
    lines = [line.rstrip() for line in str(exc).splitlines() if line.strip()]
    first = lines[0].strip() if lines else type(exc).__name__
    details = "".join(f"\n  {line.strip()}" for line in lines[1:])
    print(f"{prefix}error: {first}{details}", file=sys.stderr, flush=True)


def run_cli(main: Callable[[], int | None], prog: str | None = None) -> int:
    """Run a command-line ``main``; user errors become one line and exit status 2.

    The line is ``error: <message>``: its first line says what is wrong and names the
    culprit; details, if any, follow indented. Anything else is a bug and keeps its
    traceback.

    Ctrl-C is reported the same way (one line, status 2) instead of a traceback; a tool
    that can say more (such as how to resume) catches ``KeyboardInterrupt`` itself.
    """
    try:
        return int(main() or 0)
    except RWKVCLIPError as exc:
        report(exc, prog)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"{prog + ': ' if prog else ''}error: interrupted (Ctrl-C)", file=sys.stderr,
              flush=True)
        return EXIT_USER_ERROR


__all__ = ["RWKVCLIPError", "ConfigError", "DispatchError", "CheckpointError", "WKVError", "KernelBuildError",
           "KernelLockTimeoutError", "DataError", "DistributedError", "TrainArgsError",
           "TrainingError", "NonFiniteLossError", "ResumeError", "EvalError",
           "DatasetNotFoundError", "ImageReadError", "PeerRankError", "MeasurementError",
           "PrecisionError", "OneLineArgumentParser", "run_cli", "report", "one_line", "EXIT_USER_ERROR"]
