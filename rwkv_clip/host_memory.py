"""Keep freed host memory inside the process on CPU runs (glibc's malloc settings).

glibc's defaults give the few GB a CPU step frees back to the kernel, which faults them in
again next step; :func:`configure_host_malloc` raises the thresholds so the process reuses
them. Only the command-line programs call it, with their flag ``--host-malloc``
(:func:`add_host_malloc_flag`; docs/training.md, memory on the CPU).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

import torch

from .errors import ConfigError

HOST_MALLOC_FLAG = "--host-malloc"
HOST_MALLOC_CHOICES = ("auto", "retain", "system")
MMAP_THRESHOLD = 1 << 30        # blocks below this come from the heap and are reused
TRIM_THRESHOLD = 2**31 - 1      # free memory kept at the top of a heap (~2 GiB; an int)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

_applied: str | None = None


def add_host_malloc_flag(parser) -> None:
    """The command-line programs' ``--host-malloc auto|retain|system``."""
    parser.add_argument(HOST_MALLOC_FLAG, choices=HOST_MALLOC_CHOICES, default="auto",
                        help="glibc malloc on the CPU: retain keeps freed memory in the "
                             "process for reuse, system leaves glibc's defaults; auto: "
                             "retain on CPU runs unless MALLOC_*_ / GLIBC_TUNABLES set "
                             "malloc (docs/training.md). Default: auto")


def _glibc_settings_given() -> bool:
    return (any(name in os.environ for name in _GLIBC_ENV)
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""))


def configure_host_malloc(device: torch.device | str, choice: str = "auto") -> str:
    """Apply ``choice`` (``--host-malloc``: auto, retain, system) for a process computing
    on ``device``; returns what was done: ``"retain"``, or ``"system"`` with the reason in
    parentheses. Once per process (a second call returns the first answer)."""
    global _applied
    if choice not in HOST_MALLOC_CHOICES:
        raise ConfigError(f"{HOST_MALLOC_FLAG} {choice!r}: expected one of "
                          f"{', '.join(HOST_MALLOC_CHOICES)}")
    if _applied is not None:
        return _applied
    on_cpu = torch.device(device).type == "cpu"
    if choice == "system":
        result = f"system ({HOST_MALLOC_FLAG} system)"
    elif choice == "auto" and not on_cpu:
        result = "system (a GPU run)"
    elif choice == "auto" and _glibc_settings_given():
        result = "system (glibc's malloc settings from the environment)"
    elif platform.libc_ver()[0] != "glibc":
        result = "system (not glibc)"
    else:
        result = _retain()
    _applied = result
    return result


def _retain() -> str:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "system (mallopt not found)"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
          and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    return "retain" if ok else "system (mallopt refused the thresholds)"


def applied() -> str | None:
    """What :func:`configure_host_malloc` did in this process (None: not called)."""
    return _applied


def describe(result: str) -> str:
    """A log line for ``result``."""
    if result == "retain":
        return (f"host malloc: freed memory kept for reuse (glibc mmap threshold "
                f"{MMAP_THRESHOLD >> 30} GiB, trim threshold {(TRIM_THRESHOLD + 1) >> 30} GiB; "
                f"{HOST_MALLOC_FLAG} system leaves malloc alone)")
    return f"host malloc: {result}"
