"""Data for RWKV-CLIP: writers and readers (RecordIO, WebDataset, parquet), loaders, a
built-in set.

:func:`build_train_loader` / :func:`build_eval_loader` (:mod:`.loader`) pick DALI or the
PyTorch fallback. Importing this package imports no DALI or open_clip and starts no workers.
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
