#!/usr/bin/env python
"""Time and peak memory against image size: RWKV-CLIP beside open_clip's ViT, one JSON.

At each image side (default 224,448,896,1792) both models are built for that side
(random weights; open_clip with force_image_size, nothing downloaded) and run side by
side in this process, ABBA-interleaved: inference (encode_image, the image tower, batch
1) and a training step (both towers, ClipLoss, backward, AdamW, batch 2). Fitted log-log
slopes of time and memory against tokens in the JSON, and in the plot's legend. See
rwkv_clip.bench.resolution.

    python scripts/bench_resolution.py --plot resolution.png    # B/16 vs ViT-B-16, fp32
    python scripts/bench_resolution.py --model B32 --precisions fp32,bf16
    python scripts/bench_resolution.py --sides 224,448,896 --tasks infer --versus none

On the CPU the training step stops at 896 px (--train-sides), and a case predicted to end
past --max-seconds (default 1800) is skipped and listed under "skipped".
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rwkv_clip.bench.resolution import add_flags
from rwkv_clip.bench.resolution import main as run
from rwkv_clip.errors import run_cli


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(run_cli(main))
