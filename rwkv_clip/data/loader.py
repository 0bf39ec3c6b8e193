"""One factory for training / evaluation loaders: DALI (GPU or CPU-only) or PyTorch, chosen
by :class:`LoaderArgs`. Every loader yields ``(images float32 (B, 3, S, S), tokens int64
(B, 3 x ctx_len))`` (231 at the original's 77 tokens), applies the same record checks and raises the same one-line
:class:`~rwkv_clip.errors.DataError` naming file and record.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ..errors import DataError, TrainArgsError
from .dali_pipeline import build_dali_loader, dali_available, dist_info
from .recordio import check_rec
from .tokens import CONTEXT_LENGTH, CaptionTokens
from .torch_loader import RecSource, TokenArraySource, TorchLoader, WdsSource


@dataclass
class LoaderArgs:
    """What :func:`build_train_loader` and :func:`build_eval_loader` read. Any namespace with
    some of these attributes works too; a missing or None one takes the default here.

    ``loader='auto'`` picks DALI when it is importable (GPU pipeline when ``device`` is CUDA
    and a GPU exists, else DALI's CPU-only mode) and the torch ``DataLoader`` otherwise;
    with ``skip_corrupt`` and WebDataset shards holding single bad samples (which DALI
    cannot drop) it falls back to torch.

    A returned loader has ``len()`` (batches per epoch, equal on all ranks for training),
    ``reset()`` (after each epoch), ``set_epoch(E)`` (the start of epoch E: its order and
    augmentation are a function of seed, rank and E, so a resumed run reproduces any
    position), ``skipped`` and ``num_samples`` (usable pairs over all ranks).
    """

    # rec prefix (X for X.rec / X.idx), wds shard spec (folder, glob, brace pattern or a
    # '::' list), parquet files (file, folder, glob or brace list), or for builtin an
    # optional cache root
    train_data: str | None = None
    val_data: str | None = None  # build_eval_loader's data (default: train_data)
    data_format: str = "rec"  # 'rec', 'wds', 'parquet' (torch loader only) or 'builtin'
    builtin_seed: int = 0  # which built-in set (rwkv_clip.data.builtin)
    # parquet columns (default: img2dataset's jpg/caption or YFCC15M's images/texts)
    image_column: str | None = None
    caption_columns: str | None = None  # e.g. 'raw,synthetic,generated'
    parquet_shuffle_rows: bool | None = None
    # a .npy of shape (N, L x k), L = ctx_len or 77, row i = record / sample i, whose
    # captions replace the first k variants (any format; rec and wds then use the torch
    # loader)
    caption_tokens: str | None = None
    # tokens per caption in the batches (the model's ctx_len): captions are tokenised at
    # it, stored 77-token captions fitted to it (padded, or cut with end-of-text kept)
    ctx_len: int = 77
    batch_size: int = 64
    workers: int = 2
    input_size: int = 224
    seed: int = 0
    skip_corrupt: bool = False  # skip and count bad records instead of raising DataError
    device: str | None = None  # 'cuda' / 'cpu' (default: cuda when available)
    rank: int | None = None  # default: the torchrun environment, else 0
    world_size: int | None = None  # default: the torchrun environment, else 1
    local_rank: int | None = None  # default: LOCAL_RANK, else 0
    loader: str = "auto"  # 'auto', 'dali' or 'torch'
    # how much of a .rec is checked in Python before reading: 'full' (every record),
    # 'quick' (about 1000 records) or 'auto' (default: full up to 1M records for DALI,
    # quick for torch, which checks every record as it reads it)
    check_level: str | None = None


def _get(args, name, default=None):
    v = getattr(args, name, None)
    return default if v is None else v


def _resolve_data(args) -> tuple[str, str]:
    fmt = _get(args, "data_format", "rec")
    data = _get(args, "train_data", None)
    if fmt == "builtin":
        from .builtin import ensure_builtin_dataset
        ds = ensure_builtin_dataset(root=data or None, seed=int(_get(args, "builtin_seed", 0)))
        return ds.train_prefix, "rec"
    if fmt not in ("rec", "wds", "parquet"):
        raise ValueError(f"unknown data_format {fmt!r} (rec, wds, parquet or builtin)")
    if not data:
        raise DataError("no training data given (--train-data)")
    return data, fmt


def _choose(args) -> tuple[str, bool]:
    """-> (backend 'dali'|'torch', dali_cpu_mode)."""
    choice = _get(args, "loader", "auto")
    device = str(_get(args, "device", "cuda" if torch.cuda.is_available() else "cpu"))
    cpu_mode = not (device.startswith("cuda") and torch.cuda.is_available())
    if choice == "torch":
        return "torch", cpu_mode
    if choice == "dali":
        if not dali_available():
            raise RuntimeError("loader='dali' but nvidia-dali is not installed "
                               "(pip install '.[dali]')")
        return "dali", cpu_mode
    if choice != "auto":
        raise ValueError(f"unknown loader {choice!r} (auto, dali or torch)")
    return ("dali" if dali_available() else "torch"), cpu_mode


def _build(args, train: bool, data=None, fmt=None, log=print):
    if data is None:
        data, fmt = _resolve_data(args)
    shard = dist_info(args)
    rank, local, world = shard.rank, shard.local_rank, shard.world_size
    bs = int(_get(args, "batch_size", 64))
    size = int(_get(args, "input_size", 224))
    workers = int(_get(args, "workers", 2))
    seed = int(_get(args, "seed", 0))
    skip = bool(_get(args, "skip_corrupt", False))
    tokens_path = _get(args, "caption_tokens", None)
    ctx_len = int(_get(args, "ctx_len", CONTEXT_LENGTH))
    if ctx_len < 1:
        raise TrainArgsError(f"--ctx-len must be >= 1, got {ctx_len}")
    if ctx_len != CONTEXT_LENGTH and _get(args, "loader", "auto") == "dali":
        raise TrainArgsError(f"--loader dali reads 3 x {CONTEXT_LENGTH} caption tokens only; "
                             f"use --loader auto or torch for --ctx-len {ctx_len}")
    if fmt == "parquet" or tokens_path:
        # DALI reads neither parquet nor a separate token array: the torch DataLoader does
        if _get(args, "loader", "auto") == "dali":
            what = "parquet" if fmt == "parquet" else "--caption-tokens"
            raise TrainArgsError(f"--loader dali cannot read {what}; use --loader auto or torch")
        backend, cpu_mode = "torch", True
    elif ctx_len != CONTEXT_LENGTH:  # DALI's label pipeline is fixed at 3 x 77
        backend, cpu_mode = "torch", True
    else:
        backend, cpu_mode = _choose(args)
    tokens = CaptionTokens(tokens_path, ctx_len) if tokens_path else None
    if fmt == "parquet":
        from .parquet import build_parquet_loader
        return build_parquet_loader(
            data, batch_size=bs, input_size=size, workers=workers, train=train, seed=seed,
            rank=rank, world_size=world, skip_corrupt=skip,
            image_column=_get(args, "image_column", None),
            caption_columns=_get(args, "caption_columns", None), caption_tokens=tokens,
            shuffle_rows=_get(args, "parquet_shuffle_rows", None), log=log, ctx_len=ctx_len)
    if backend == "dali":
        try:
            return build_dali_loader(
                data, batch_size=bs, input_size=size, workers=workers, data_format=fmt,
                train=train, cpu=cpu_mode, rank=rank, local_rank=local, world_size=world,
                seed=seed, skip_corrupt=skip, check_level=_get(args, "check_level", None),
                log=log)
        except DataError as e:
            if not (skip and fmt == "wds" and "DALI cannot skip" in str(e)
                    and _get(args, "loader", "auto") == "auto"):
                raise
            if log:
                log("[data] falling back to the torch loader to skip bad wds samples")
    if fmt == "rec":
        level = _get(args, "check_level", None) or "quick"
        chk = check_rec(data, level=level, ctx_len=ctx_len)
        if chk.bad and not skip:
            key, reason = chk.bad[0]
            raise DataError(reason, chk.rec_path, key)
        if chk.bad and log:
            log(f"[data] skipping {len(chk.bad)} corrupt record(s) in {chk.rec_path}")
        source: RecSource | TokenArraySource | WdsSource = RecSource(data, chk.good, ctx_len)
        pre_skipped = len(chk.bad)
        if tokens is not None:
            keys = [k for k, _ in chk.good]
            tokens.check(chk.num_records, chk.rec_path, max_id=max(keys))
            source = TokenArraySource(source, tokens, keys)
    else:
        from .wds import check_wds
        index = check_wds(data, skip_corrupt=skip, ctx_len=ctx_len)
        if index.bad and log:
            log(f"[data] skipping {len(index.bad)} problem(s) in the shards; first: "
                f"{index.bad[0]}")
        source = WdsSource(index, ctx_len)
        pre_skipped = len(index.bad)
        if tokens is not None:
            if any(reason.startswith("unreadable") for _, _, reason in index.bad):
                raise DataError("cannot line up caption-token rows with the samples: a shard "
                                "is unreadable", index.bad[0][0])
            tokens.check(index.num_keys, f"the shards ({len(index.shards)})")
            source = TokenArraySource(source, tokens, [s.ordinal for s in index.samples])
    loader = TorchLoader(source, bs, size, workers=workers, train=train, seed=seed, rank=rank,
                         world_size=world, skip_corrupt=skip, log=log)
    loader.skipped = pre_skipped
    return loader


def build_train_loader(args, log=print):
    """Training loader (shuffled, augmented, full batches). See the module docstring."""
    return _build(args, True, log=log)


def build_eval_loader(args=None, data=None, data_format=None, log=print, **overrides):
    """Evaluation loader (resize + centre crop, in order, partial last batch).

    ``data``/``data_format`` default to ``args.val_data`` (or ``train_data``) and
    ``args.data_format``; keyword overrides (e.g. ``batch_size=``) replace args fields.
    For ``data_format='builtin'`` the built-in held-out ``val`` split is used.
    """
    ns = SimpleNamespace(**(vars(args) if args is not None else {}))
    for k, v in overrides.items():
        setattr(ns, k, v)
    fmt = data_format or _get(ns, "data_format", "rec")
    if fmt == "builtin":
        from .builtin import ensure_builtin_dataset
        ds = ensure_builtin_dataset(root=data or None, seed=int(_get(ns, "builtin_seed", 0)))
        data, fmt = ds.val_prefix, "rec"
    elif data is None:
        data = _get(ns, "val_data", None) or _get(ns, "train_data", None)
        if not data:
            raise DataError("no evaluation data given")
    return _build(ns, False, data=data, fmt=fmt, log=log)


__all__ = ["build_train_loader", "build_eval_loader"]
