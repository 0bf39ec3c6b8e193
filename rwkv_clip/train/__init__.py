"""Training RWKV-CLIP: the pieces behind ``train.py``: :mod:`.args` (the command line),
:mod:`.schedule`, :mod:`.accumulation`, :mod:`.checkpoint` (atomic checkpoints, resume),
:mod:`.logger`, and :mod:`.loop` (:func:`train`, the training loop, top to bottom).

Importing this package starts nothing (no process group, no data, no kernels).
"""
from ..errors import TrainingError
from .args import build_train_parser, parse_args, resolve_args
from .loop import cli, main

__all__ = ["main", "cli", "parse_args", "build_train_parser", "resolve_args", "TrainingError"]
