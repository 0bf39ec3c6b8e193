"""``torch.compile`` with the inductor settings the towers need: every place that compiles
the model (training, evaluation, benchmarks) goes through :func:`compile_model`.

Inductor's mix-order reduction (Triton only: one kernel for a row reduction and a column
reduction of the same tensor, as in a norm's backward) returns the column reduction
without its kept dimensions on torch releases before 2.13 (pytorch/pytorch#178080): the
gradient of a (1, 1, C) parameter (the lerp weights, ``time_decay``) comes back as (C,)
and autograd stops the step with "CompiledFunctionBackward returned an invalid gradient
... got [C] but expected shape compatible with [1, 1, C]". There it is turned off.
"""
from __future__ import annotations

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


def compile_model(fn: Any, **kwargs: Any) -> Any:
    """``torch.compile(fn, **kwargs)``; with the inductor backend (the default) and no
    ``mode``, :func:`inductor_options` are added to any ``options`` given."""
    backend = kwargs.get("backend", "inductor")
    if backend == "inductor" and kwargs.get("mode") is None:
        options = {**inductor_options(), **(kwargs.pop("options", None) or {})}
        if options:
            kwargs["options"] = options
    return torch.compile(fn, **kwargs)


__all__ = ["compile_model", "inductor_options", "torch_release", "MIX_ORDER_REDUCTION_FIXED"]
