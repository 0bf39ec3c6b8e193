#!/usr/bin/env python
"""Train RWKV-CLIP. ``python train.py`` (no arguments) trains the small config on the
built-in dataset and prints its zero-shot accuracy; ``python train.py --help`` lists
every flag; ``torchrun --nproc_per_node N train.py ...`` trains on N processes.
The original's launch scripts (shell/*.sh) run unchanged."""
import sys

from rwkv_clip.train import cli

if __name__ == "__main__":
    sys.exit(cli())
