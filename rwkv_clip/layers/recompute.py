"""Saved activations that the backward recomputes instead of keeping.

A block's cheap elementwise results (the token-shift mixes, the squared ReLU) are saved by
the products they feed, each as large as the block's input or several times it. Inside
:class:`RecomputedSaves`, a tensor that autograd saves and that shares storage with a
registered result is not kept: the backward rebuilds it by the same op on the same inputs,
which other nodes save anyway, so the values are bit-identical and only the storage goes.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..cpu_gemm import env_choice
from ..errors import ConfigError

REBUILD_ENV = "RWKV_CLIP_REBUILD"
REBUILD_CHOICES = ("auto", "always", "never")
# auto: blocks whose input has at least this many elements (batch x tokens x channels)
# rebuild; below it the saved bytes are small and the recomputation's share of the step is
# not (the small default model trains about 10% slower rebuilding).
REBUILD_MIN_ELEMENTS = 1 << 20


def rebuilds(numel: int) -> bool:
    """Whether a block whose input has ``numel`` elements rebuilds its cheap results in the
    backward: ``RWKV_CLIP_REBUILD`` = ``auto`` (default: from :data:`REBUILD_MIN_ELEMENTS`
    on), ``always`` or ``never``."""
    choice = env_choice(REBUILD_ENV, REBUILD_CHOICES, ConfigError)
    return choice == "always" or (choice == "auto" and numel >= REBUILD_MIN_ELEMENTS)


def _traced() -> bool:
    return (torch.jit.is_tracing() or torch.compiler.is_compiling()
            or torch.compiler.is_exporting())


def _address(t: torch.Tensor) -> int | None:
    """The address of t's storage; None for tensors without data (fake, functional)."""
    if isinstance(t, FakeTensor):  # its storage reports address 0 for every tensor
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _under_current_autocast(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` run under the autocast the forward had (the backward runs outside it)."""
    on = [(dev, torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda")
          if torch.is_autocast_enabled(dev)]
    if not on:
        return fn

    def again() -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            for dev, dtype in on:
                stack.enter_context(torch.autocast(dev, dtype=dtype))
            return fn()
    return again


class _Rebuild:
    """A registered result (a contiguous tensor owning its whole storage): how to rebuild
    it, and the rebuild while saved views of it are still to be unpacked."""

    def __init__(self, recompute: Callable[[], torch.Tensor]) -> None:
        self.recompute = recompute
        self.views = 0  # saved views not yet unpacked
        self.cached: torch.Tensor | None = None

    def full(self) -> torch.Tensor:
        """The result again; kept for the saved views still to come."""
        if self.cached is not None:
            return self.cached
        fresh = self.recompute().contiguous()
        if self.views > 0:
            self.cached = fresh
        return fresh


class _SavedView:
    def __init__(self, rebuild: _Rebuild, t: torch.Tensor) -> None:
        self.rebuild = rebuild
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        rebuild.views += 1

    def unpack(self) -> torch.Tensor:
        r = self.rebuild
        out = r.full().as_strided(self.size, self.stride, self.offset)
        r.views -= 1
        if r.views <= 0:  # every saved view has its copy: the cache may go
            r.cached = None
        return out


class RecomputedSaves:
    """``with RecomputedSaves(x) as saves: ...; saves.add(result, recompute)``: tensors
    saved inside the block that view ``result``'s storage are rebuilt by ``recompute()``
    in the backward. ``recompute`` must give ``result`` bit for bit from tensors the graph
    keeps anyway (it is held until the backward).

    Inactive (everything saved as usual) where :func:`rebuilds` says no for the block's
    input ``x``, without grad, while tracing, compiling or exporting, and under someone
    else's saved-tensor hooks (activation checkpointing, offloading), which keep their own
    policy."""

    def __init__(self, x: torch.Tensor) -> None:
        # decided before x's size is read: traced sizes may be symbolic (a dynamic batch)
        self._wanted = not _traced() and rebuilds(x.numel())
        # by storage address: the registered tensor (while it lives, no other storage can
        # take its address), its dtype and rebuild
        self._by_storage: dict[int | None, tuple[weakref.ref, torch.dtype, _Rebuild]] = {}
        self._hooks: Any = None

    @property
    def active(self) -> bool:
        return self._hooks is not None

    def add(self, result: torch.Tensor,
            recompute: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor] | None:
        """Register ``result``, a contiguous tensor that owns its whole storage (else it
        is saved as usual); ``recompute()`` gives it again, same shape. Returns a function
        giving the result in the backward (for other rebuilds made from it: one rebuild
        serves all), or None where nothing was registered."""
        if not self.active:
            return None
        address = _address(result)
        owns = (address is not None and result.is_contiguous() and result.storage_offset() == 0
                and result.numel() * result.element_size() == result.untyped_storage().nbytes())
        if owns:
            rebuild = _Rebuild(_under_current_autocast(recompute))
            self._by_storage[address] = (weakref.ref(result), result.dtype, rebuild)
            return rebuild.full
        return None

    def rebuilt(self, t: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        """The function :meth:`add` returned for ``t``'s storage, if registered."""
        if not self.active:
            return None
        entry = self._by_storage.get(_address(t))
        return entry[2].full if entry is not None and entry[0]() is not None else None

    def source(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``t`` as a rebuild may read it in the backward: its own rebuild where ``t`` is
        registered (a closure holding ``t`` itself would keep what the registry drops),
        else ``t``."""
        again = self.rebuilt(t)
        return again if again is not None else lambda: t

    def _pack(self, t: torch.Tensor) -> Any:
        if t.layout != torch.strided:
            return t
        entry = self._by_storage.get(_address(t))
        if entry is None or entry[0]() is None or t.dtype != entry[1]:
            return t
        return _SavedView(entry[2], t)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.unpack() if isinstance(saved, _SavedView) else saved

    def __enter__(self) -> RecomputedSaves:
        if (self._wanted and torch.is_grad_enabled() and not _traced()
                and torch._C._autograd._top_saved_tensors_default_hooks(False) is None):
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        self._by_storage.clear()
