"""Saved activations that the backward recomputes instead of keeping.

A block's cheap elementwise results (the token-shift mixes, the squared ReLU) are saved by
the products they feed, each as large as the block's input or several times it. Inside
:class:`RecomputedSaves`, a tensor that autograd saves and that shares storage with a
registered result is not kept: the backward rebuilds it by the same op on the same inputs,
which other nodes save anyway, so the values are bit-identical and only the storage goes.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class _Rebuild:
    """A registered result (a contiguous tensor owning its whole storage): how to rebuild
    it, and the rebuild while other saved views of it are still to be unpacked."""

    def __init__(self, recompute: Callable[[], torch.Tensor]) -> None:
        self.recompute = recompute
        self.views = 0  # saved views not yet unpacked
        self.cached: torch.Tensor | None = None


class _SavedView:
    def __init__(self, rebuild: _Rebuild, t: torch.Tensor) -> None:
        self.rebuild = rebuild
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        rebuild.views += 1

    def unpack(self) -> torch.Tensor:
        r = self.rebuild
        if r.cached is None:
            r.cached = r.recompute().contiguous()
        out = r.cached.as_strided(self.size, self.stride, self.offset)
        r.views -= 1
        if r.views <= 0:  # every saved view has its copy: the cache may go
            r.cached = None
        return out


class RecomputedSaves:
    """``with RecomputedSaves() as saves: ...; saves.add(result, recompute)``: tensors
    saved inside the block that view ``result``'s storage are rebuilt by ``recompute()``
    in the backward. ``recompute`` must give ``result`` bit for bit from tensors the graph
    keeps anyway (it is held until the backward).

    Inactive (everything saved as usual) without grad, while tracing or compiling, and
    under someone else's saved-tensor hooks (activation checkpointing, offloading), which
    keep their own policy."""

    def __init__(self) -> None:
        self._by_storage: dict[int, _Rebuild] = {}
        self._dtypes: dict[int, torch.dtype] = {}
        self._alive: list[torch.Tensor] = []  # no storage is freed and reused meanwhile
        self._hooks: Any = None

    @property
    def active(self) -> bool:
        return self._hooks is not None

    def add(self, result: torch.Tensor, recompute: Callable[[], torch.Tensor]) -> None:
        """Register ``result``, a contiguous tensor that owns its whole storage (else it
        is saved as usual); ``recompute()`` gives it again, same shape."""
        storage = result.untyped_storage()
        owns = (result.is_contiguous() and result.storage_offset() == 0
                and result.numel() * result.element_size() == storage.nbytes())
        if self.active and owns:
            self._by_storage[storage.data_ptr()] = _Rebuild(recompute)
            self._dtypes[storage.data_ptr()] = result.dtype
            self._alive.append(result)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.layout != torch.strided:
            return t
        ptr = t.untyped_storage().data_ptr()
        rebuild = self._by_storage.get(ptr)
        if rebuild is None or t.dtype != self._dtypes[ptr]:
            return t
        return _SavedView(rebuild, t)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.unpack() if isinstance(saved, _SavedView) else saved

    def __enter__(self) -> RecomputedSaves:
        if (torch.is_grad_enabled() and not torch.jit.is_tracing()
                and not torch.compiler.is_compiling()
                and torch._C._autograd._top_saved_tensors_default_hooks(False) is None):
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        self._by_storage.clear()
        self._dtypes.clear()
        self._alive.clear()
