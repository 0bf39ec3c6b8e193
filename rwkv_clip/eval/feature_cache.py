"""Frozen image features cached on disk, once per model, dataset, split and transform.

The key hashes everything that changes the features (:func:`cached_features`), so a
stale file is never read.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from .common import encode_images_gathered
from .datasets import ClassificationSet
from .distributed import DistInfo, current


def default_feature_dir() -> Path:
    """``$RWKV_CLIP_CACHE/features`` (default ``~/.cache/rwkv_clip/features``)."""
    from ..data.builtin import default_cache_root

    return Path(default_cache_root()) / "features"


@torch.no_grad()
def weights_fingerprint(model) -> str:
    """SHA-256 over the state dict: every key, shape, dtype and the tensor bytes."""
    h = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{key}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def describe_transform(transform) -> str:
    """``repr(transform)`` without memory addresses (a lambda's or function's ``at 0x...``),
    so the same transform gives the same key in every process."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(transform))


def cache_key(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:24]


def cached_features(model, eval_set: ClassificationSet, split: str, cache_dir: str | os.PathLike,
                    fingerprint: str, root: str, transform, device: torch.device,
                    batch_size: int, workers: int = 0, precision: str = "fp32",
                    info: DistInfo | None = None, log=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, targets) of ``eval_set``: read from the cache, else encoded (sharded
    over the ranks, gathered on all) and written by rank 0.

    A cache file is ``<cache dir>/<key>.pt`` holding ``features`` (N, C) float32 (L2
    normalised), ``targets`` (N,) and the ``meta`` the key was made from: the weights'
    fingerprint, the dataset's name, root, split and size, the transform's ``repr`` and
    the compute precision."""
    info = info or current()
    meta = {"weights": fingerprint, "dataset": eval_set.name, "root": root, "split": split,
            "num_samples": len(eval_set), "transform": describe_transform(transform),
            "precision": precision}
    path = Path(cache_dir) / f"{eval_set.name}_{split}_{cache_key(meta)}.pt"
    if path.is_file():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("meta") == meta:
            if log is not None:
                log(f"{eval_set.name} {split}: {len(eval_set)} cached features from {path}")
            return saved["features"], saved["targets"]
    if log is not None:
        log(f"{eval_set.name} {split}: encoding {len(eval_set)} images")
    targets, features = encode_images_gathered(model, eval_set.dataset, device, batch_size,
                                               workers, precision, describe=eval_set.describe,
                                               info=info, log=log)
    if info.is_master:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        torch.save({"features": features, "targets": targets, "meta": meta}, tmp)
        os.replace(tmp, path)
    return features, targets
