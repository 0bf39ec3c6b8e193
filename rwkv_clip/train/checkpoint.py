"""Training checkpoints: atomic writes, ``epoch_latest.pt``, and resume.

A checkpoint is one ``torch.save`` dict readable with ``weights_only=True`` (its entries
are listed in docs/training.md); writes go to a temporary file that is renamed into
place, so a crash never leaves a half-written file under a real name.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ..checkpoint_files import load_torch_file, unwrap_model
from ..errors import CheckpointError, ResumeError

LATEST = "epoch_latest.pt"
CHECKPOINT_NAME = re.compile(r"(epoch|step)_\d+\.pt")
TEMP_NAME = re.compile(r"\..+\.tmp\.(\d+)")  # atomic_save's and point_latest's
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


def build_checkpoint(model, optimizer, scaler, *, step: int, epoch: int, batch_in_epoch: int,
                     args, rng: list[dict[str, Any]], total_steps: int) -> dict[str, Any]:
    """``rng``: every rank's :func:`rwkv_clip.train.rng.capture_rng`, in rank order."""
    args_dict = vars(args) if not isinstance(args, dict) else args
    return {
        "format_version": FORMAT_VERSION,
        "state_dict": {k: v.detach().cpu() for k, v in unwrap_model(model).state_dict().items()},
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
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError
        raise CheckpointError(_write_failure(path, exc)) from None
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return path


def _write_failure(path: Path, exc: BaseException) -> str:
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.0f} MiB free there"
    except OSError:
        free = "free space unknown"
    text = str(exc)
    full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
        s in text for s in ("No space left", "unexpected pos", "file write failed"))
    what = "the disk is full" if full else f"{type(exc).__name__}: {text.splitlines()[0]}"
    return (f"could not write checkpoint {path} ({what}; {free}); the partial file was removed "
            f"and the previous checkpoint ({LATEST}) is kept")


def check_writable(output: str | os.PathLike) -> None:
    """Fail before any work when OUTPUT/checkpoints cannot be created or written; remove
    the temporary files of saves whose process was killed (SIGKILL, power loss)."""
    folder = checkpoint_dir(output)
    probe = folder / f".write_test.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
        for tmp in folder.iterdir():
            match = TEMP_NAME.fullmatch(tmp.name)
            if match and not _alive(int(match.group(1))):
                tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise CheckpointError(f"output folder {output} is not writable ({exc.strerror}: "
                              f"{exc.filename}); choose another --output") from None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def prune_checkpoints(folder: Path, keep: int, newest: Path, previous: str | None) -> None:
    """``previous`` (when given) goes; then all but the ``keep`` newest epoch_/step_ files
    (0: keep all). ``epoch_latest.pt`` is a hard link of ``newest`` and always stays."""
    if previous and Path(previous) != newest and Path(previous).name != LATEST:
        Path(previous).unlink(missing_ok=True)
    if keep <= 0:
        return
    files = [p for p in folder.iterdir() if CHECKPOINT_NAME.fullmatch(p.name) and p != newest]
    files.sort(key=lambda p: p.stat().st_mtime_ns)
    for old in files[:max(0, len(files) - (keep - 1))]:
        old.unlink(missing_ok=True)


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


def save_checkpoint(checkpoint: dict[str, Any], output: str | os.PathLike, name: str,
                    keep: int = 0, previous: str | None = None) -> Path:
    """Write ``OUTPUT/checkpoints/NAME`` atomically, update ``epoch_latest.pt``, then apply
    the retention (:func:`prune_checkpoints`)."""
    path = atomic_save(checkpoint, checkpoint_dir(output) / name)
    point_latest(path)
    prune_checkpoints(path.parent, keep, path, previous)
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


def newest_checkpoint(output: str | os.PathLike) -> Path | None:
    """The file ``--resume latest`` would load (by its own name: the epoch_/step_ file
    ``epoch_latest.pt`` links to, when there is one), or None. Every file here is complete:
    writes are atomic."""
    latest = checkpoint_dir(output) / LATEST
    if not latest.is_file():
        return None
    for path in latest.parent.iterdir():
        if CHECKPOINT_NAME.fullmatch(path.name):
            try:
                if os.path.samefile(path, latest):
                    return path
            except OSError:
                continue
    return latest


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    ckpt = load_torch_file(path)  # one-line errors for garbage, JSON, empty, pickled code
    needed = ("state_dict", "optimizer", "step", "epoch", "batch_in_epoch", "rng")
    missing = [k for k in needed if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ResumeError(f"{path} is not a training checkpoint (missing {missing}); "
                          "to start from plain weights use --pretrained")
    return ckpt


# The settings that make a run what it is. A resume takes them from the checkpoint; a flag
# given again with another value is an error unless --resume-allow-changes.
RUN_SETTINGS = ("train_data", "data_format", "train_num_samples", "loader", "builtin_root",
                "skip_corrupt", "image_column", "caption_columns", "caption_tokens",
                "batch_size", "gradient_acc", "accum_mode", "precision", "lr", "lr_scheduler",
                "warmup", "epochs", "max_steps", "optimizer", "beta1", "beta2",
                "weight_decay", "exclude_decay", "grad_clip_norm", "local_loss",
                "gather_with_grad", "seed", "lock_image", "lock_text", "zero_shot_data",
                "zero_shot_every", "siglip", "siglip_dist_impl", "caption_weights",
                "lora_rank", "lora_alpha", "lora_dropout", "lora_targets",
                "lora_base_precision")
# ... of which these can never change: the data position is counted in their batches.
FIXED_SETTINGS = ("batch_size", "gradient_acc")
# activation checkpointing and the activation-memory policy change memory, not results
FREE_MODEL_KEYS = ("with_cp", "rebuild")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def take_run_settings(ckpt: dict[str, Any], args, path) -> dict[str, Any]:
    """Set ``args``' run settings and model config to the checkpoint's; return those that
    differ from what the command line (with its defaults) said, as {key: checkpoint value}.

    A flag given explicitly (``args.explicit``) that contradicts the checkpoint raises
    :class:`ResumeError` naming both values, unless ``args.resume_allow_changes``; batch
    size and accumulation always raise.
    """
    saved = ckpt.get("args") or {}
    saved_model = ckpt.get("model_config") or {}
    explicit = set(getattr(args, "explicit", None) or ())
    allow = bool(getattr(args, "resume_allow_changes", False))
    model = dict(args.model_config)
    taken: dict[str, Any] = {}
    conflicts: list[str] = []
    # (key, checkpoint value, command-line value, typed: its own flag / by --config, target)
    candidates = [(k, saved[k], getattr(args, k), "flag" if k in explicit else "",
                   args.__dict__)
                  for k in RUN_SETTINGS if k in saved and hasattr(args, k)]
    candidates += [(k, v, model[k], "flag" if k in explicit else
                    "config" if "config" in explicit else "", model)
                   for k, v in saved_model.items()
                   if k in model and k not in FREE_MODEL_KEYS and k not in RUN_SETTINGS]
    by_config: list[str] = []  # model keys that differ only through the typed --config
    for key, old, new, given, target in candidates:
        if old == _json_safe(new):
            continue
        if given and allow and key not in FIXED_SETTINGS:
            continue  # the change is meant
        if given == "config":
            by_config.append(f"{key} {new!r} vs {old!r}")
            continue
        if given:
            why = ("the data position is counted in its batches; resume with the same value "
                   "or start a new run in another --output" if key in FIXED_SETTINGS else
                   "add --resume-allow-changes if the change is meant")
            conflicts.append(f"{_flag(key)} {new!r} contradicts the checkpoint's {old!r} ({why})")
            continue
        target[key] = old
        taken[key] = old
    if by_config:
        conflicts.append(f"--config {args.config} gives another model than the checkpoint's "
                         f"(config vs checkpoint: {', '.join(by_config)}): leave --config out "
                         "to resume the checkpoint's model, or start a new run in another "
                         f"--output with --pretrained {path}")
    if conflicts:
        raise ResumeError(f"--resume {path}: " + "; ".join(conflicts))
    if "precision" in model:
        model["precision"] = args.precision
    args.model_config = model
    for key, value in model.items():
        setattr(args, key, value)
    return taken
