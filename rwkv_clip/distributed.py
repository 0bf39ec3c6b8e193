"""Who am I in the job, which device do I use, and the process group: one ``DistInfo``
for training, evaluation, data loading and the memory planner.

Single process, ``torchrun`` and SLURM (:func:`init_distributed`). Nothing here runs at import.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import DistributedError


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job (single process: rank 0 of 1 on CPU)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    launcher: str = "single"  # "single", "torchrun" or "slurm"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def collective_device(self) -> torch.device:
        """Where tensors for collectives live (NCCL: this GPU; gloo: CPU)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"environment variable {name}={value!r}: expected an integer"
                               ) from None


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``gpu[03-05,07],cpu1`` -> ``gpu03``."""
    nodelist = nodelist.strip()
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not match:
        raise DistributedError(f"SLURM node list {nodelist!r}: cannot read the first host")
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def launch_environment(environ: Mapping[str, str] | None = None
                       ) -> tuple[str, int, int, int]:
    """``(launcher, rank, local_rank, world_size)`` from torchrun's or SLURM's variables.

    torchrun's variables win when both are present (``srun torchrun ...``)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    if "WORLD_SIZE" in env or "RANK" in env:
        launcher = "torchrun"
        world_size = _env_int(env, "WORLD_SIZE", 1)
        rank = _env_int(env, "RANK", 0)
        local_rank = _env_int(env, "LOCAL_RANK", 0)
    elif _env_int(env, "SLURM_NTASKS", 1) > 1 and "SLURM_PROCID" in env:
        launcher = "slurm"
        world_size = _env_int(env, "SLURM_NTASKS", 1)
        rank = _env_int(env, "SLURM_PROCID", 0)
        local_rank = _env_int(env, "SLURM_LOCALID", 0)
    else:
        return "single", 0, 0, 1
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise DistributedError(f"bad {launcher} environment: rank {rank}, local rank "
                               f"{local_rank}, world size {world_size} (expected "
                               "0 <= rank < world size)")
    return launcher, rank, local_rank, world_size


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times torchrun has restarted this job (``TORCHELASTIC_RESTART_COUNT``)."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def restarts_left(environ: Mapping[str, str] | None = None) -> int:
    """How many more times torchrun (``--max-restarts``) will restart this job."""
    env = os.environ if environ is None else environ
    try:
        total = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    except ValueError:
        return 0
    return max(0, total - restart_count(env))


def _attempt_store(timeout: timedelta):
    """torchrun's store for this attempt: the agent's store (``MASTER_ADDR:MASTER_PORT``)
    under a prefix naming the restart. The agent keeps one store across restarts, so
    without the prefix a restarted group would read the dead attempt's addresses."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           is_master=False, timeout=timeout)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return dist.PrefixStore(f"rwkv_clip/{run_id}/attempt_{restart_count()}", client)


def _slurm_rendezvous(env: MutableMapping[str, str]) -> None:
    """MASTER_ADDR / MASTER_PORT for a plain ``srun`` launch, unless already set."""
    if not env.get("MASTER_ADDR"):
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        if not nodelist:
            raise DistributedError("SLURM launch without MASTER_ADDR or SLURM_JOB_NODELIST: "
                                   "set MASTER_ADDR to the first node's host name")
        env["MASTER_ADDR"] = first_slurm_host(nodelist)
    if not env.get("MASTER_PORT"):
        job = _env_int(env, "SLURM_JOB_ID", 0)
        env["MASTER_PORT"] = str(20000 + job % 20000)
    env.setdefault("RANK", env["SLURM_PROCID"])
    env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))


def pick_device(choice: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto``: ``cuda:LOCAL_RANK`` when CUDA is available, else CPU; or ``cpu``,
    ``cuda``, ``cuda:N``."""
    if choice == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        device = torch.device(choice)
    except RuntimeError:
        raise DistributedError(f"--device {choice!r}: expected auto, cpu, cuda or cuda:N"
                               ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DistributedError(f"--device {choice}: CUDA is not available on this machine")
        if device.index is None:
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
    elif device.type != "cpu":
        raise DistributedError(f"--device {choice!r}: only cpu and cuda are supported")
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model's parameters are (CPU for a model without any): where its inputs go."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


DEFAULT_TIMEOUT_MINUTES = 10.0  # how long a collective waits for a stuck rank (--dist-timeout)
# NCCL: a failed or timed-out collective aborts the communicators and raises in Python
# ("clean up only"), so rwkv_clip.faults can name the lost rank and exit with status 3.
# torchrun's default 1 tears the process down from the watchdog without that line; any
# other value the user sets is kept.
NCCL_ASYNC_ERROR_HANDLING = "2"


def init_distributed(device: str = "auto",
                     timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> DistInfo:
    """Read the launch environment, pick the device, start the process group if the job
    has more than one process, and return this process's :class:`DistInfo`.

    Understands a single process, ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``) and
    SLURM's ``srun`` (``SLURM_PROCID``...; the master is the job's first host). NCCL on
    CUDA, gloo otherwise."""
    launcher, rank, local_rank, world_size = launch_environment()
    dev = pick_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = None
    if world_size > 1:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if launcher == "slurm":
            _slurm_rendezvous(os.environ)
        if backend == "nccl" and os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                "1") == "1":
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_ASYNC_ERROR_HANDLING
        if not dist.is_initialized():
            timeout = timedelta(minutes=timeout_minutes)
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                    timeout=timeout, store=_attempt_store(timeout),
                                    device_id=dev if dev.type == "cuda" else None)
        else:
            backend = dist.get_backend()
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=dev,
                    backend=backend, launcher=launcher)


def current(device: torch.device | str | None = None) -> DistInfo:
    """The running process group's :class:`DistInfo` (single process when none)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            local_rank = launch_environment()[2]
        except DistributedError:
            local_rank = rank
        return DistInfo(rank=rank, local_rank=local_rank, world_size=world, device=dev,
                        backend=dist.get_backend(), launcher="torchrun")
    return DistInfo(device=dev)


def barrier(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        if info.backend == "nccl":
            dist.barrier(device_ids=[info.device.index])
        else:
            dist.barrier()


def any_rank_true(flag: bool, info: DistInfo) -> bool:
    """True on every rank when any rank passes True (e.g. a non-finite loss)."""
    if not info.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=info.collective_device)
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


__all__ = ["DistInfo", "init_distributed", "pick_device", "current", "barrier",
           "any_rank_true", "cleanup_distributed", "launch_environment", "first_slurm_host",
           "restart_count", "restarts_left"]
