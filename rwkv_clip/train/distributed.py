"""Process group setup from the torchrun environment, and a clean shutdown.

Single process (no ``WORLD_SIZE`` > 1 in the environment): no process group at all.
Under torchrun: NCCL when training on CUDA, gloo on CPU. The device is chosen from
``--device`` (``auto``: ``cuda:LOCAL_RANK`` when CUDA is available, else CPU).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from ..errors import DistributedError


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"environment variable {name}={value!r} is not an integer") from None


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        device = torch.device(choice)
    except RuntimeError:
        raise DistributedError(f"--device {choice!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DistributedError(f"--device {choice}: CUDA is not available on this machine")
        if device.index is None:
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
    elif device.type != "cpu":
        raise DistributedError(f"--device {choice!r}: only cpu and cuda are supported")
    return device


def init_distributed(device_choice: str = "auto", timeout_minutes: float = 30.0) -> DistInfo:
    """Read RANK/LOCAL_RANK/WORLD_SIZE (torchrun) and start the process group if needed."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise DistributedError(f"bad torchrun environment: RANK={rank}, WORLD_SIZE={world_size}")
    device = pick_device(device_choice, local_rank)
    info = DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        info.backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend=info.backend,
                                    timeout=timedelta(minutes=timeout_minutes), **kwargs)
    return info


def barrier(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        if info.backend == "nccl":
            dist.barrier(device_ids=[info.device.index])
        else:
            dist.barrier()


def all_reduce_mean(value: float, info: DistInfo) -> float:
    """Average a Python float over ranks (used for logging only)."""
    if not info.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64,
                     device=info.device if info.backend == "nccl" else "cpu")
    dist.all_reduce(t)
    return float(t.item()) / info.world_size


def any_rank_true(flag: bool, info: DistInfo) -> bool:
    """True on every rank when any rank passes True (e.g. a non-finite loss)."""
    if not info.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0],
                     device=info.device if info.backend == "nccl" else "cpu")
    dist.all_reduce(t)
    return bool(t.item() > 0)


def cleanup_distributed(info: DistInfo, synchronize: bool = True) -> None:
    """Destroy the process group. Delete DDP models before calling this (gloo aborts at
    exit when a DDP reducer outlives its group). ``synchronize=False`` after an error
    on this rank: no barrier, which the other ranks might never reach."""
    if info.distributed and dist.is_initialized():
        try:
            if synchronize:
                barrier(info)
        finally:
            dist.destroy_process_group()
