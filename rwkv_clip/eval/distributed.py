"""Sharding and gathering for evaluation under torchrun (NCCL on GPU, gloo on CPU).

Each rank evaluates one contiguous shard of the samples (the original's split: the first
``n % world`` ranks take one extra sample); results are gathered to every rank as CPU
tensors and put back in sample order, so the metrics equal a single-process run.
Nothing here starts a process group by itself except :func:`init_from_env`, which the
CLI calls.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .datasets import EvalError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current() -> DistInfo:
    """Rank/world of the running process group (single process when none)."""
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(),
                        int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return DistInfo()


def init_from_env(device_type: str) -> DistInfo:
    """Start the process group when launched by torchrun (WORLD_SIZE > 1): NCCL for CUDA
    devices, gloo otherwise. A single process starts nothing."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or not dist.is_available():
        return current()
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    return current()


def shard_range(n: int, rank: int, world_size: int) -> range:
    """Contiguous shard of ``range(n)`` for ``rank``; shards cover every index once."""
    base, extra = divmod(n, world_size)
    start = base * rank + min(rank, extra)
    return range(start, start + base + int(rank < extra))


def gather_rows(indices: torch.Tensor, *tensors: torch.Tensor, info: DistInfo | None = None
                ) -> tuple[torch.Tensor, ...]:
    """Gather per-rank rows (``indices`` (n,), tensors with n rows) from every rank and
    return the tensors ordered by index. With one process it only sorts."""
    info = info or current()
    payload = [indices.cpu()] + [t.cpu() for t in tensors]
    if info.world_size > 1:
        gathered: list = [None] * info.world_size
        dist.all_gather_object(gathered, payload)
        parts = list(zip(*gathered))
        payload = [torch.cat(list(p), dim=0) for p in parts]
    order = torch.argsort(payload[0])
    return tuple(t[order] for t in payload[1:])


def barrier(info: DistInfo | None = None) -> None:
    info = info or current()
    if info.world_size > 1:
        dist.barrier()


class PeerRankError(EvalError):
    """Another rank failed; its own error message says why."""


def _count_failures(failed: bool) -> int:
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(failed)], device=device)
    dist.all_reduce(flag)
    return int(flag.item())


@contextmanager
def fail_together(info: DistInfo | None = None):
    """Run one rank's share of the work so that a failure on any rank stops every rank.

    Without this, a rank that raises (say, on an unreadable image) never reaches the next
    collective and the others wait there forever. Every rank reports success or failure
    in one all-reduce: the failing rank re-raises its own error, the others raise
    :class:`PeerRankError`.
    """
    info = info or current()
    if info.world_size <= 1:
        yield
        return
    try:
        yield
    except BaseException:
        _count_failures(True)
        raise
    failures = _count_failures(False)
    if failures:
        raise PeerRankError(f"evaluation failed on {failures} other rank(s); "
                            "see that rank's error message")
