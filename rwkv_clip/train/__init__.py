"""Training RWKV-CLIP: the pieces behind ``train.py``.

* :mod:`.args`          command line (every original flag + new ones), config resolution
* :mod:`.schedule`      ``lr_at(step)``: OneCycle "cosine" (as the original) and "linear"
* :mod:`.accumulation`  the losses of K micro-batches of one step (exact or mean mode)
* :mod:`.checkpoint`    atomic checkpoints, ``epoch_latest.pt``, resume
* :mod:`.logger`        speed line, tqdm, TensorBoard
* :mod:`.loop`          :func:`train`: the training loop, top to bottom

Importing this package starts nothing (no process group, no data, no kernels).
"""
from ..errors import TrainingError
from .args import build_train_parser, parse_args, resolve_args
from .loop import cli, main

__all__ = ["main", "cli", "parse_args", "build_train_parser", "resolve_args", "TrainingError"]
