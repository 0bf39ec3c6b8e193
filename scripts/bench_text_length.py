#!/usr/bin/env python
"""Time and peak memory of the text tower against caption length, beside open_clip's text
transformer with its positional embedding stretched to each length (Long-CLIP's method),
paired in one process, ABBA-interleaved; one JSON (see rwkv_clip.bench.text_length).

    python scripts/bench_text_length.py --threads 2 --output text_length.json --plot text_length.png
    python scripts/bench_text_length.py --lengths 77,248 --tasks infer
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rwkv_clip.bench.text_length import add_flags
from rwkv_clip.bench.text_length import main as run
from rwkv_clip.errors import run_cli


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(ap)
    return run(ap.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="bench_text_length.py"))
