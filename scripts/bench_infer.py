#!/usr/bin/env python
"""Inference throughput of RWKV-CLIP beside open_clip's ViT-B-32, interleaved, one JSON.

encode_image + encode_text (the models' forward) without grad on one synthetic batch,
fp32 and bf16 autocast, eager and torch.compile'd; both models randomly initialised
(open_clip with pretrained=None, nothing downloaded). See rwkv_clip.bench.versus for the
timing protocol (ABBA interleaving, median paired ratio).

    python scripts/bench_infer.py                     # quick: B/32 vs ViT-B-32, batch 16
    python scripts/bench_infer.py --repeats 10 --modes eager
    python scripts/bench_infer.py --versus none       # ours only
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rwkv_clip.bench.versus import add_versus_flags, run_versus
from rwkv_clip.errors import run_cli
from rwkv_clip.host_memory import add_host_malloc_flag


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_versus_flags(ap, default_batches="16", default_config=str(
        REPO / "model_config" / "RWKV_CLIP_B32.json"))
    add_host_malloc_flag(ap)
    ns = ap.parse_args(argv)
    return run_versus(ns, tasks=("infer",))


if __name__ == "__main__":
    sys.exit(run_cli(main))
