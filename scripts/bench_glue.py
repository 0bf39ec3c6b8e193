#!/usr/bin/env python
"""Forward + backward of each fused glue op (token shift + lerps, head norm + gate, squared
ReLU): the eager reference, the reference under torch.compile and the Triton op,
interleaved, each checked against float64 first; one JSON (see rwkv_clip.bench.glue).

    python scripts/bench_glue.py --device cuda                     # B/32 shapes, batch 256, bf16
    python scripts/bench_glue.py --device cpu --batch 1 --modes eager,compiled
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rwkv_clip.bench.glue import add_flags
from rwkv_clip.bench.glue import main as run
from rwkv_clip.errors import run_cli


def build_parser():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(ap)
    return ap


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="bench_glue.py"))
