#!/usr/bin/env python
"""CLIP's loss against SigLIP's on the built-in set: the same ``train.py`` run with and
without ``--siglip``, one JSON (the final zero-shot top-1/top-5 and the last loss of each).

    python scripts/compare_losses.py --max-steps 80 --out docs/results/losses_builtin.json

Each run is ``train.py --max-steps N`` (the small config, the default seed and batch) with
its output in a temporary folder; docs/losses.md quotes the JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rwkv_clip.bench.provenance import measured
from rwkv_clip.errors import TrainArgsError, run_cli


def run(argv: list[str]) -> dict:
    """One training run, in this process: the figures docs/losses.md quotes."""
    from rwkv_clip.config import DEFAULT_CONFIG
    from rwkv_clip.train import main, parse_args

    with tempfile.TemporaryDirectory() as tmp:
        args = parse_args([*argv, "--output", str(Path(tmp) / "run")])
        result = main(args)
    final = result["zero_shot"] or {}
    return {"argv": argv, "batch_size": args.batch_size, "config": str(args.config or DEFAULT_CONFIG),
            "seed": args.seed, "steps": result["steps"],
            "zero_shot_top1": final.get("acc1"), "zero_shot_top5": final.get("acc5"),
            "num_classes": final.get("num_classes"), "last_loss": result["last_loss"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-steps", type=int, default=80)
    ap.add_argument("--out", default=None, help="JSON file (default: stdout only)")
    ns = ap.parse_args(argv)
    if ns.max_steps < 1:
        raise TrainArgsError("--max-steps must be >= 1")
    steps = ["--max-steps", str(ns.max_steps)]
    record = {**measured(), "clip": run(steps), "siglip": run(["--siglip", *steps])}
    text = json.dumps(record, indent=1)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="compare_losses.py"))
