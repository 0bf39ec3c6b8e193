"""Training checkpoints: atomic writes, ``epoch_latest.pt``, and resume.

A checkpoint is one ``torch.save`` dict, readable with ``weights_only=True``:

* ``state_dict``: the unwrapped model's state dict (no ``module.``), which
  ``create_RWKV_Model(args, model_weight_path=...)`` loads directly;
* ``optimizer`` and ``scaler`` (or None) state dicts;
* ``step`` (optimizer steps done), ``epoch`` (current epoch), ``batch_in_epoch``
  (micro-batches of that epoch already consumed: the data position), ``total_steps``
  (the schedule's length);
* ``rng``: per rank, torch CPU (and CUDA) generator states, numpy's and Python's ``random``;
* ``args``: the training arguments (JSON-safe values), ``model_config``.

Format 1 (before the learning rate became a function of the step) also holds a
``scheduler`` state dict; it loads and resumes the same, the entry is ignored.

Writes go to a temporary file in the same folder, are flushed to disk, then renamed
over the target, so a crash never leaves a half-written checkpoint under a real name.
``epoch_latest.pt`` is updated last (hard link of the new file, renamed into place).
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ResumeError

LATEST = "epoch_latest.pt"
FORMAT_VERSION = 2


def checkpoint_dir(output: str | os.PathLike) -> Path:
    return Path(output) / "checkpoints"


def _json_safe(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return str(value)


def rng_states(device: torch.device | None = None) -> dict[str, Any]:
    np_state = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                  "cached_gaussian": float(np_state[4])},
        "python": _json_safe(random.getstate()),
        "cuda": None,
    }
    if device is not None and device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng_states(states: dict[str, Any], device: torch.device | None = None) -> None:
    torch.set_rng_state(states["torch"].cpu())
    n = states["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if states.get("cuda") is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


def unwrap_module(model):
    """The plain model under torch.compile's and DDP's wrappers, in any order, so that
    checkpoint keys never carry ``_orig_mod.`` or ``module.``."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def build_checkpoint(model, optimizer, scaler, *, step: int, epoch: int, batch_in_epoch: int,
                     args, rng: list[dict[str, Any]], total_steps: int) -> dict[str, Any]:
    """``rng``: every rank's :func:`rng_states`, in rank order."""
    args_dict = vars(args) if not isinstance(args, dict) else args
    return {
        "format_version": FORMAT_VERSION,
        "state_dict": {k: v.detach().cpu() for k, v in unwrap_module(model).state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "step": int(step),
        "epoch": int(epoch),
        "batch_in_epoch": int(batch_in_epoch),
        "total_steps": int(total_steps),
        "rng": rng,
        "args": _json_safe(args_dict),
        "model_config": _json_safe(args_dict.get("model_config")),
    }


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """torch.save to ``path`` via a temporary file + fsync + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def point_latest(target: Path) -> Path:
    """Make ``epoch_latest.pt`` (next to ``target``) a copy of ``target``, atomically."""
    latest = target.parent / LATEST
    tmp = target.parent / f".{LATEST}.tmp.{os.getpid()}"
    if tmp.exists():
        tmp.unlink()
    try:
        os.link(target, tmp)  # no second write of a large file
    except OSError:
        import shutil
        shutil.copyfile(target, tmp)
    os.replace(tmp, latest)
    _fsync_dir(target.parent)
    return latest


def save_checkpoint(checkpoint: dict[str, Any], output: str | os.PathLike, name: str) -> Path:
    """Write ``OUTPUT/checkpoints/NAME`` atomically, then update ``epoch_latest.pt``."""
    path = atomic_save(checkpoint, checkpoint_dir(output) / name)
    point_latest(path)
    return path


def resolve_resume(resume: str | None, output: str | os.PathLike) -> Path | None:
    """``latest`` -> OUTPUT/checkpoints/epoch_latest.pt if it exists (else None: fresh
    start); a path -> that path, which must exist."""
    if resume is None:
        return None
    if resume == "latest":
        latest = checkpoint_dir(output) / LATEST
        return latest if latest.is_file() else None
    path = Path(resume)
    if not path.is_file():
        raise ResumeError(f"--resume {resume}: no such checkpoint file")
    return path


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ResumeError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from None
    needed = ("state_dict", "optimizer", "step", "epoch", "batch_in_epoch", "rng")
    missing = [k for k in needed if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ResumeError(f"{path} is not a training checkpoint (missing {missing}); "
                          "to start from plain weights use --pretrained")
    return ckpt


def check_compatible(ckpt: dict[str, Any], args, path) -> None:
    """Refuse to resume with a different model or a different step layout."""
    saved = ckpt.get("args") or {}
    saved_model = ckpt.get("model_config") or {}
    current_model = args.model_config
    free = ("with_cp", "precision", "dropout", "drop_path_rate")  # may change on resume
    diffs = [k for k in current_model
             if k in saved_model and k not in free
             and saved_model[k] != _json_safe(current_model[k])]
    if diffs:
        raise ResumeError(f"checkpoint {path} was trained with different model settings: " +
                          ", ".join(f"{k}={saved_model[k]!r} (now {current_model[k]!r})"
                                    for k in diffs))
    for key in ("batch_size", "gradient_acc"):
        if key in saved and saved[key] != getattr(args, key):
            raise ResumeError(f"checkpoint {path} used --{key.replace('_', '-')} "
                              f"{saved[key]}, now {getattr(args, key)}: the data position "
                              "and schedule would not line up")
