#!/usr/bin/env python
"""Turn image-caption pairs into RWKV-CLIP training data (the original's data2rec).

Examples:
  python scripts/make_rec.py pairs.jsonl out/train            # out/train.rec + .idx
  python scripts/make_rec.py pairs.csv out/train --resize 256
  python scripts/make_rec.py img2dataset_out/ out/train --format wds --shard-size 5000
  python scripts/make_rec.py 'yfcc15m/data/train-*.parquet' out/yfcc15m    # parquet

Input: JSONL/CSV with ``image`` (path), ``raw`` caption, optional ``synthetic`` and
``generated`` (UTF-8, or --encoding); a folder of img2dataset output (``NNNNN.tar``
shards or the ``files`` layout ``00000/000000000.jpg`` + ``.txt``); or parquet shards (file,
glob, brace list or folder; img2dataset parquet or the Hub's YFCC15M layout, columns
overridden with --image-column / --caption-columns). See rwkv_clip/data/writers.py.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rwkv_clip.data import convert
from rwkv_clip.errors import run_cli


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (``--resize -5`` made every image 1x1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input", help="JSONL/CSV of pairs, a folder of img2dataset .tar shards, or "
                                 "parquet shards (file, glob, brace list or folder)")
    p.add_argument("output", help="output prefix (PREFIX.rec/.idx, or PREFIX-000000.tar...)")
    p.add_argument("--format", choices=["rec", "wds"], default="rec",
                   help="rec: OUTPUT.rec + OUTPUT.idx (MXNet RecordIO, what train.py and DALI "
                        "read by default); wds: WebDataset shards OUTPUT-000000.tar ... "
                        "(train.py --data-format wds). Default rec")
    p.add_argument("--resize", type=positive_int, default=None,
                   help="shrink so the shorter side is at most this many pixels")
    p.add_argument("--shard-size", type=positive_int, default=1000,
                   help="samples per wds shard")
    p.add_argument("--encoding", default="utf-8",
                   help="text encoding of a JSONL/CSV pairs file (default utf-8; e.g. latin-1)")
    p.add_argument("--image-column", default=None,
                   help="parquet image column (default: jpg, images, image or img)")
    p.add_argument("--caption-columns", default=None, metavar="RAW[,SYN[,GEN]]",
                   help="parquet caption columns (default: caption, texts or text)")
    p.add_argument("--ctx-len", type=positive_int, default=77, metavar="N",
                   help="tokens per stored caption (default 77, the original's; longer "
                        "captions are cut with end-of-text kept). Train with the same "
                        "--ctx-len to read them whole")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (for logs and scripts)")
    a = p.parse_args(argv)
    s = convert(a.input, a.output, fmt=a.format, resize=a.resize, shard_size=a.shard_size,
                progress=not a.no_progress, image_column=a.image_column,
                caption_columns=a.caption_columns, encoding=a.encoding,
                context_length=a.ctx_len)
    print(f"written: {s['written']}  skipped: {s['skipped']}")
    for reason, n in sorted(s["reasons"].items(), key=lambda x: -x[1]):
        print(f"  {n:8d}  {reason}")
    for name, reason in s["examples"][:10]:
        print(f"  e.g. {name}: {reason}")
    print("outputs: " + json.dumps(s["outputs"] if len(s["outputs"]) <= 4 else
                                   s["outputs"][:2] + ["..."] + s["outputs"][-1:]))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="make_rec.py"))
