"""Pieces shared by classification and retrieval: autocast, sharded image loading with
readable errors, batched text encoding."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ..errors import ImageReadError
from ..precision import get_precision
from .distributed import DistInfo, current, fail_together, gather_rows, shard_range


def progress(iterable, desc: str, total: int | None = None, info: DistInfo | None = None):
    """tqdm over evaluation batches on the main rank, hidden when stderr is not a terminal
    (as the training bar), so redirected logs stay clean."""
    from tqdm import tqdm

    show = (info or current()).is_master
    return tqdm(iterable, desc=desc, total=total, unit="batch", leave=False, file=sys.stderr,
                dynamic_ncols=True, disable=None if show else True)


class ProgressLines:
    """Log lines for a long encoding, for logs and terminals alike: after the first batch,
    the estimate for the whole set at this machine's rate; then every ``step`` percent of
    it. Sets estimated under ``min_seconds`` stay quiet."""

    def __init__(self, log: Callable[[str], None] | None, what: str, total: int,
                 step: int = 10, min_seconds: float = 20.0) -> None:
        self.log, self.what, self.total = log, what, total
        self.step, self.min_seconds = step, min_seconds
        self.start = time.perf_counter()
        self.active, self.next_percent = False, step

    def update(self, done: int, first: bool = False) -> None:
        if self.log is None or done <= 0 or self.total <= 0:
            return
        elapsed = time.perf_counter() - self.start
        left = elapsed / done * (self.total - done)
        if first:
            self.active = elapsed + left >= self.min_seconds
            if self.active:
                self.log(f"{self.what}: {self.total} images, about {_duration(elapsed + left)} "
                         f"on this machine ({done / elapsed:.0f} images/s on the first batch)")
            return
        percent = 100 * done // self.total
        if self.active and percent >= self.next_percent and done < self.total:
            self.log(f"{self.what}: {done}/{self.total} images ({percent}%), about "
                     f"{_duration(left)} left")
            self.next_percent = (percent // self.step + 1) * self.step


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """Autocast context for ``precision`` on ``device`` (fp32 and tf32: none)."""
    return get_precision(precision, device).autocast()


class _Guarded(Dataset):
    """Rows ``indices`` of ``base``; a failing read is returned as an error string, so
    the main process can raise one clear error (also with worker processes)."""

    def __init__(self, base: Dataset, indices: Sequence[int], describe: Callable[[int], str]):
        self.base, self.indices, self.describe = base, list(indices), describe

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        idx = self.indices[i]
        try:
            image, target = self.base[idx]
        except Exception as exc:
            return None, -1, idx, f"{self.describe(idx)}: {type(exc).__name__}: {exc}"
        return image, int(target), idx, ""


def _collate(batch):
    errors = [b[3] for b in batch if b[3]]
    if errors:
        return {"errors": errors}
    images = torch.stack([b[0] for b in batch])
    targets = torch.tensor([b[1] for b in batch], dtype=torch.long)
    indices = torch.tensor([b[2] for b in batch], dtype=torch.long)
    return {"images": images, "targets": targets, "indices": indices}


@torch.no_grad()
def encode_image_shard(model, dataset: Any, device: torch.device, batch_size: int,
                       workers: int = 0, precision: str = "fp32",
                       describe: Callable[[int], str] | None = None,
                       fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       info: DistInfo | None = None,
                       log: Callable[[str], None] | None = None) -> tuple[torch.Tensor, ...]:
    """Encode this rank's shard of ``dataset`` (items ``(image tensor, label)``); returns
    ``(indices, targets, outputs)`` with ``outputs = fn(L2-normalised float32 image
    features)`` (identity when ``fn`` is None). No sample is padded or repeated. ``log``
    (the main rank's): the estimate and progress lines of a long encoding
    (:class:`ProgressLines`)."""
    info = info or current()
    shard = shard_range(len(dataset), info.rank, info.world_size)
    loader = DataLoader(_Guarded(dataset, shard, describe or (lambda i: f"sample {i}")),
                        batch_size=batch_size, shuffle=False, num_workers=workers,
                        collate_fn=_collate, drop_last=False)
    lines = ProgressLines(log if info.is_master else None, "encoding", len(shard))
    all_idx, all_tgt, all_out = [], [], []
    for batch in progress(loader, "encoding images", info=info):
        if "errors" in batch:
            raise ImageReadError(f"cannot read image {batch['errors'][0]}"
                                 + (f" (and {len(batch['errors']) - 1} more in this batch)"
                                    if len(batch["errors"]) > 1 else ""))
        with autocast(device, precision):
            feats = model.encode_image(batch["images"].to(device, non_blocking=True))
        feats = F.normalize(feats.float(), dim=-1)
        out = fn(feats) if fn is not None else feats
        all_idx.append(batch["indices"])
        all_tgt.append(batch["targets"])
        all_out.append(out.float().cpu())
        lines.update(sum(len(i) for i in all_idx), first=len(all_idx) == 1)
    if not all_out:  # an empty shard (more ranks than samples): shapes still line up
        width = fn(torch.zeros(0, _feature_width(model), device=device)).shape[1] if fn else _feature_width(model)
        return (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                torch.zeros(0, width))
    return torch.cat(all_idx), torch.cat(all_tgt), torch.cat(all_out)


def _feature_width(model) -> int:
    return int(model.image_model.embed_dims)


@torch.no_grad()
def encode_images_gathered(model, dataset: Any, device: torch.device, batch_size: int,
                           workers: int = 0, precision: str = "fp32",
                           describe: Callable[[int], str] | None = None,
                           fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                           info: DistInfo | None = None,
                           log: Callable[[str], None] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank encodes its shard; returns ``(targets, outputs)`` for the whole set in
    sample order on every rank (``log``: :func:`encode_image_shard`'s)."""
    info = info or current()
    with fail_together(info):
        idx, tgt, out = encode_image_shard(model, dataset, device, batch_size, workers,
                                           precision, describe, fn, info, log)
    targets, outputs = gather_rows(idx, tgt, out, info=info)
    if targets.shape[0] != len(dataset):
        raise RuntimeError(f"gathered {targets.shape[0]} rows for {len(dataset)} samples")
    return targets, outputs


@torch.no_grad()
def encode_texts(model, texts: Sequence[str], device: torch.device, batch_size: int,
                 precision: str = "fp32",
                 tokenizer: Callable[[list[str]], torch.Tensor] | None = None) -> torch.Tensor:
    """(len(texts), C) L2-normalised float32 text features; ``tokenizer`` defaults to CLIP's
    BPE at the model's context length."""
    if tokenizer is None:
        import functools

        from ..tokenizer import tokenize

        ctx_len = getattr(getattr(model.text_model, "args", None), "ctx_len", 77)
        tokenizer = functools.partial(tokenize, context_length=ctx_len)
    feats = []
    starts = range(0, len(texts), batch_size)
    for start in progress(starts, "encoding texts", total=len(starts)):
        tokens = tokenizer(list(texts[start:start + batch_size]))
        with autocast(device, precision):
            f = model.encode_text(tokens.to(device))
        feats.append(F.normalize(f.float(), dim=-1).cpu())
    if not feats:
        raise ValueError("no texts to encode")
    return torch.cat(feats)
