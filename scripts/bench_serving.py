#!/usr/bin/env python
"""Serving on a CPU: our exported encoders against open_clip's ViTs, one JSON.

Both exported the same way (torch.export -> ONNX, random weights), INT8 by the same
dynamic quantisation, run by the same runtime (onnxruntime, OpenVINO) at the same thread
count; each case is timed ABBA in one process; ratio = median of paired (their time / our
time), > 1: ours is faster. Exports are kept in --work and reused.

    python scripts/bench_serving.py --pairs b32 --out docs/results/serving_b32.json
    python scripts/bench_serving.py --pairs b16-896 --towers image --batch-sizes 1 --precisions fp32
    python scripts/bench_serving.py --pairs b32 --accuracy runs/default/checkpoints/epoch_latest.pt
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rwkv_clip.bench.provenance import measured
from rwkv_clip.errors import ConfigError, run_cli


def main(argv=None) -> int:
    from rwkv_clip.bench.serving import PAIRS, PRECISIONS, TOWERS
    from rwkv_clip.bench.versus import parse_list
    from rwkv_clip.onnx import RUNTIMES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", default="b32", help=f"comma-separated: {', '.join(PAIRS)}")
    ap.add_argument("--towers", default="image,text", help="image, text")
    ap.add_argument("--runtimes", default="onnxruntime,openvino", help=", ".join(RUNTIMES))
    ap.add_argument("--precisions", default="fp32,int8", help=", ".join(PRECISIONS))
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--threads", type=int, default=2, help="threads of both runtimes")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--work", default="runs/bench_serving", help="where the exports are kept")
    ap.add_argument("--accuracy", metavar="CHECKPOINT",
                    help="also export CHECKPOINT, quantise it and record zero-shot top-1 on "
                         "the built-in held-out and shifted splits, float32 against INT8")
    ap.add_argument("--out", help="also write the JSON to this file")
    ns = ap.parse_args(argv)
    pairs = parse_list(ns.pairs, str, list(PAIRS), "--pairs")
    towers = parse_list(ns.towers, str, TOWERS, "--towers")
    runtimes = parse_list(ns.runtimes, str, RUNTIMES, "--runtimes")
    precisions = parse_list(ns.precisions, str, PRECISIONS, "--precisions")
    batches = parse_list(ns.batch_sizes, int, None, "--batch-sizes")
    if ns.repeats < 1 or ns.warmup < 0 or ns.threads < 1 or min(batches) < 1:
        raise ConfigError("--repeats, --threads and batch sizes must be >= 1, --warmup >= 0")

    import torch

    from rwkv_clip.bench.serving import Case, accuracy, exported, format_row, run_case
    from rwkv_clip.bench.versus import machine

    versions = {}
    for name in ("onnxruntime", "openvino", "open_clip"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    result = {"benchmark": "serving", "machine": machine(torch.device("cpu")),
              "threads": ns.threads, "versions": versions, "torch": torch.__version__,
              "weights": "random (seed 0)", "repeats": ns.repeats, "warmup": ns.warmup,
              "pairs": {p: dict(zip(("ours", "theirs", "image_size"), PAIRS[p], strict=True))
                        for p in pairs},
              "export": "rwkv_clip.onnx_export.export_module (torch.export, dynamic batch) "
                        "for both; INT8: rwkv_clip.quantize.quantize_encoder for both",
              "onnxruntime_spinning": "off for both (session.intra_op.allow_spinning 0: "
                                      "an idle spinning pool would slow the other session)",
              "ratio": "median over repeats of paired (their time / our time), ABBA; > 1: "
                       "ours is faster", "cases": []}
    for pair in pairs:
        paths = exported(Path(ns.work), pair)
        for tower in towers:
            if tower == "text" and PAIRS[pair][2] != 224:
                continue  # the text towers do not depend on the image size
            for runtime in runtimes:
                for precision in precisions:
                    for batch in batches:
                        row = run_case(Case(pair, tower, runtime, precision, batch), paths,
                                       ns.threads, ns.warmup, ns.repeats)
                        print(format_row(row), file=sys.stderr, flush=True)
                        result["cases"].append(row)
    if ns.accuracy:
        result["accuracy"] = accuracy(ns.accuracy, Path(ns.work), runtimes)
        print(json.dumps(result["accuracy"]), file=sys.stderr, flush=True)
    result.update(measured())
    text = json.dumps(result)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
