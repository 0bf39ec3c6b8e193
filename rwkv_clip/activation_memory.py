"""Activation memory: which results of a block's residual branch the backward keeps.

A branch (a norm and its time or channel mix) runs under ``torch.utils.checkpoint`` with
torch's selective activation checkpointing. Kept: the products of the mix's projections
that the backward reads (:data:`KEPT_PROJECTIONS`) and the WKV's result, whose
recomputation would cost a GEMM or the WKV again. Recomputed in the backward, from the
branch's input: the cheap glue (norms, token shifts, lerps, casts, the low-rank LoRA
products, tanh, silu, the squared ReLU, the gate product) and the output projection,
whose result nothing in the backward reads. The config key ``rebuild`` (train.py
``--rebuild``) says where the policy applies (:func:`rebuilds`); elsewhere the branch
runs as plain autograd.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .config import REBUILD_CHOICES
from .errors import ConfigError

# auto: branches whose input has at least this many elements (batch x tokens x channels);
# below it the saved bytes are small and the recomputation's share of the step is not.
REBUILD_MIN_ELEMENTS = 1 << 20

# The mixes' projections whose results the backward reads: r, k, v (the WKV), the gate
# (silu), the channel mix's key (squared ReLU), receptance (sigmoid) and value (the gate
# product). Their products are kept; the time mix's ``output`` is not among them.
KEPT_PROJECTIONS = ("receptance", "key", "value", "gate")


def rebuilds(numel: int, rebuild: str = "auto") -> bool:
    """Whether a branch whose input has ``numel`` elements keeps only what the policy
    names and recomputes the rest in the backward, under the config's ``rebuild``:
    ``auto`` (from :data:`REBUILD_MIN_ELEMENTS` on), ``always`` or ``never``."""
    if rebuild not in REBUILD_CHOICES:
        raise ConfigError(f"rebuild={rebuild!r}: expected one of {', '.join(REBUILD_CHOICES)}")
    return rebuild == "always" or (rebuild == "auto" and numel >= REBUILD_MIN_ELEMENTS)


def _traced() -> bool:
    return (torch.jit.is_tracing() or torch.compiler.is_compiling()
            or torch.compiler.is_exporting())


def applies(x: torch.Tensor, rebuild: str = "auto") -> bool:
    """Whether a branch with input ``x`` runs under the policy: with grad, not while
    tracing, compiling or exporting, not under someone else's saved-tensor hooks
    (whole-block checkpointing, offloading: they keep their own policy), and where
    :func:`rebuilds` says so."""
    return (torch.is_grad_enabled() and not _traced()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
            and rebuilds(x.numel(), rebuild))


def residual_branch(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                    mix: nn.Module, rebuild: str = "auto") -> torch.Tensor:
    """``fn(x)``, the residual branch whose mix is ``mix``, under the policy where it
    :func:`applies` (``rebuild``: the config key)."""
    if not applies(x, rebuild):
        return fn(x)
    return checkpoint(fn, x, use_reentrant=False,
                      context_fn=functools.partial(_contexts, mix))


def _products() -> frozenset:
    from .ops import products  # noqa: F401  registers rwkv_clip::onednn_linear
    aten = torch.ops.aten
    return frozenset((aten.mm.default, aten.addmm.default, aten.bmm.default,
                      aten.baddbmm.default, torch.ops.rwkv_clip.onednn_linear.default))


def _wkv() -> Any:
    from .ops import kernels  # noqa: F401  registers rwkv_clip::wkv6_forward
    return torch.ops.rwkv_clip.wkv6_forward.default


class _Policy:
    """The SAC policy of one branch call: MUST_SAVE for the WKV and for the products
    computed inside a kept projection (between its forward hooks), PREFER_RECOMPUTE for
    everything else. A projection whose product runs in fp32 for a lower-precision result
    (:mod:`.ops.products` on CPUs without native bf16/fp16 GEMMs) keeps the rounded copy."""

    def __init__(self, mix: nn.Module) -> None:
        self.projections = [getattr(m, "base_layer", m)  # peft's LoRA: the base product
                            for name in KEPT_PROJECTIONS
                            if isinstance(m := getattr(mix, name, None), nn.Module)]
        self.products, self.wkv = _products(), _wkv()
        self.inside = 0
        self.dtype: torch.dtype | None = None  # the projection's result dtype
        self.widened: Any = None  # a product in fp32 whose rounded copy is kept instead

    def enter(self, module: nn.Module, args: tuple) -> None:
        self.inside += 1
        x = args[0]
        on = torch.is_autocast_enabled(x.device.type)
        self.dtype = torch.get_autocast_dtype(x.device.type) if on else x.dtype

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.inside -= 1
        self.widened = None

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is self.wkv:
            return CheckpointPolicy.MUST_SAVE
        if self.inside:
            out = getattr(ctx, "op_output", None)  # torch < 2.14 decides before the op
            if op in self.products:
                if isinstance(out, torch.Tensor) and out.dtype != self.dtype:
                    self.widened = out
                    return CheckpointPolicy.PREFER_RECOMPUTE
                return CheckpointPolicy.MUST_SAVE
            if self.widened is not None and args and args[0] is self.widened:
                if isinstance(out, torch.Tensor) and out.dtype == self.dtype:
                    self.widened = None
                    return CheckpointPolicy.MUST_SAVE  # the rounded copy of the product
                self.widened = out  # a view or reshape of it: followed
        return CheckpointPolicy.PREFER_RECOMPUTE


class _Hooked:
    """A SAC context with the policy's hooks on the kept projections while it is entered
    (torch versions that ask the policy again while recomputing see the same modules)."""

    def __init__(self, mode: Any, policy: _Policy) -> None:
        self.mode, self.policy = mode, policy
        self.handles: list = []

    def __enter__(self) -> None:
        for m in self.policy.projections:
            self.handles.append(m.register_forward_pre_hook(self.policy.enter))
            self.handles.append(m.register_forward_hook(self.policy.leave))
        self.mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self.mode.__exit__(*exc)
        finally:
            for h in self.handles:
                h.remove()
            self.handles.clear()


def _contexts(mix: nn.Module) -> tuple[Any, Any]:
    policy = _Policy(mix)
    forward, recompute = create_selective_checkpoint_contexts(policy)
    return _Hooked(forward, policy), _Hooked(recompute, policy)


__all__ = ["KEPT_PROJECTIONS", "REBUILD_CHOICES", "REBUILD_MIN_ELEMENTS", "applies", "rebuilds",
           "residual_branch"]
