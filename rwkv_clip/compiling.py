"""``torch.compile`` with the inductor settings the towers need: every place that compiles
the model (training, evaluation, benchmarks) goes through :func:`compile_model`.

Inductor's mix-order reduction (Triton only: one kernel for a row reduction and a column
reduction of the same tensor, as in a norm's backward) returns the column reduction
without its kept dimensions on torch releases before 2.13 (pytorch/pytorch#178080): the
gradient of a (1, 1, C) parameter (the lerp weights, ``time_decay``) comes back as (C,)
and autograd stops the step with "CompiledFunctionBackward returned an invalid gradient
... got [C] but expected shape compatible with [1, 1, C]". There it is turned off.

Inductor's on-disk cache is not keyed by the CPU vector width its C++ kernels were written
for: a graph cached by a process at one level (``ATEN_CPU_CAPABILITY=avx2``, or another
machine sharing the temporary folder) and loaded at another compiles AVX2-width loops with
AVX-512 vectors, giving wrong numbers or an abort. :func:`isolate_inductor_cache` gives
each level a folder of its own.
"""
from __future__ import annotations

import os
from typing import Any

import torch

# the first release whose inductor restores a mix-order reduction's shape
MIX_ORDER_REDUCTION_FIXED = (2, 13)


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the running torch's)."""
    text = version or torch.__version__
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def inductor_options(version: str | None = None) -> dict[str, Any]:
    """The inductor options :func:`compile_model` passes for torch ``version`` (default:
    the running one): mix-order reduction off where its keepdim shapes are wrong."""
    if torch_release(version) < MIX_ORDER_REDUCTION_FIXED:
        return {"triton.mix_order_reduction": False}
    return {}


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def inductor_cache_dir(capability: str | None = None) -> str:
    """Inductor's default cache folder with the CPU level its kernels are written for
    appended: ``capability`` (an ``ATEN_CPU_CAPABILITY`` value; default: torch's own), and
    ``amx`` where inductor adds AMX tiles."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    level = (capability or torch.backends.cpu.get_cpu_capability()).lower()
    if level.startswith("avx512") and torch.cpu._is_amx_tile_supported():
        level += "_amx"
    return f"{default_cache_dir()}_{level}"


def isolate_inductor_cache() -> str:
    """Point inductor at :func:`inductor_cache_dir` unless ``TORCHINDUCTOR_CACHE_DIR`` is
    set already (by the user, or by inductor once it has compiled in this process); the
    folder in use."""
    if INDUCTOR_CACHE_ENV not in os.environ:
        # computed first: importing inductor can set the variable to its default folder
        folder = inductor_cache_dir()
        os.environ[INDUCTOR_CACHE_ENV] = folder
    return os.environ[INDUCTOR_CACHE_ENV]


def compile_model(fn: Any, **kwargs: Any) -> Any:
    """``torch.compile(fn, **kwargs)`` with a cache folder of the CPU level's own
    (:func:`isolate_inductor_cache`); with the inductor backend (the default) and no
    ``mode``, :func:`inductor_options` are added to any ``options`` given."""
    isolate_inductor_cache()
    backend = kwargs.get("backend", "inductor")
    if backend == "inductor" and kwargs.get("mode") is None:
        options = {**inductor_options(), **(kwargs.pop("options", None) or {})}
        if options:
            kwargs["options"] = options
    return torch.compile(fn, **kwargs)


__all__ = ["compile_model", "inductor_options", "torch_release", "MIX_ORDER_REDUCTION_FIXED",
           "inductor_cache_dir", "isolate_inductor_cache", "INDUCTOR_CACHE_ENV"]
