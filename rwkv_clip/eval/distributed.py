"""Sharding and gathering for evaluation under torchrun (NCCL on GPU, gloo on CPU).

Each rank evaluates one contiguous shard; results come back in sample order on every rank.
Nothing here starts a process group (the CLI does, with
:func:`rwkv_clip.distributed.init_distributed`).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..distributed import DistInfo, current
from ..errors import PeerRankError


def shard_range(n: int, rank: int, world_size: int) -> range:
    """Contiguous shard of ``range(n)`` for ``rank``; shards cover every index once (the
    original's split: the first ``n % world_size`` ranks take one extra sample)."""
    base, extra = divmod(n, world_size)
    start = base * rank + min(rank, extra)
    return range(start, start + base + int(rank < extra))


def gather_rows(indices: torch.Tensor, *tensors: torch.Tensor, info: DistInfo | None = None
                ) -> tuple[torch.Tensor, ...]:
    """Gather per-rank rows (``indices`` (n,), tensors with n rows) from every rank and
    return the tensors ordered by index, as CPU tensors on every rank, so the metrics
    equal a single-process run. With one process it only sorts."""
    info = info or current()
    payload = [indices.cpu()] + [t.cpu() for t in tensors]
    if info.world_size > 1:
        gathered: list = [None] * info.world_size
        dist.all_gather_object(gathered, payload)
        parts = list(zip(*gathered, strict=False))
        payload = [torch.cat(list(p), dim=0) for p in parts]
    order = torch.argsort(payload[0])
    return tuple(t[order] for t in payload[1:])


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
