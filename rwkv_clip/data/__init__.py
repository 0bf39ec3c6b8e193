"""Data for RWKV-CLIP: RecordIO / WebDataset writers and readers, loaders, a built-in set.

Public API:

* :func:`build_train_loader`, :func:`build_eval_loader` - one factory picking DALI
  (GPU or CPU-only) or the PyTorch fallback; loaders yield ``(images float (B,3,S,S),
  tokens int64 (B,231))`` and have ``len()``/``reset()``.
* :func:`ensure_builtin_dataset` - procedurally generated image-text set (+ zero-shot
  image folder), generated once into a cache folder.
* :func:`dali_dataloader` - the original's DALI entry point.
* :class:`DataError` - every data problem (file and record named in the message).
* Writers/readers: :class:`RecordIOWriter`, :class:`RecordIOReader`, :func:`convert`,
  :func:`write_rec`, :func:`write_wds`; tokens: :func:`encode_captions`,
  :class:`CaptionTokens` (``--caption-tokens`` arrays); parquet shards:
  :mod:`rwkv_clip.data.parquet` (``data_format='parquet'``, needs pyarrow when used).

Importing this package has no side effects (DALI, open_clip and torch data workers
are imported or started only when used).
"""

from ..errors import DataError
from .builtin import BuiltinDataset, ensure_builtin_dataset
from .dali_pipeline import dali_available, dali_dataloader
from .loader import LoaderArgs, build_eval_loader, build_train_loader
from .recordio import IRHeader, RecordIOReader, RecordIOWriter, check_rec, pack, unpack
from .tokens import (
                       CONTEXT_LENGTH,
                       NUM_LABELS,
                       CaptionTokens,
                       decode_tokens,
                       encode_captions,
                       encode_captions_batch,
                       normalize_labels,
)
from .writers import convert, write_rec, write_wds

__all__ = [
    "DataError", "IRHeader", "RecordIOReader", "RecordIOWriter", "check_rec", "pack", "unpack",
    "CONTEXT_LENGTH", "NUM_LABELS", "CaptionTokens", "decode_tokens", "encode_captions",
    "encode_captions_batch", "normalize_labels", "convert", "write_rec", "write_wds",
    "BuiltinDataset", "ensure_builtin_dataset", "LoaderArgs", "build_train_loader",
    "build_eval_loader",
    "dali_available", "dali_dataloader",
]
