"""``python -m rwkv_clip.memory``: see :mod:`rwkv_clip.memory.cli`."""
import sys

from .cli import run

sys.exit(run())
