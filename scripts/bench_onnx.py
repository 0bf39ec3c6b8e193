#!/usr/bin/env python
"""Latency of the exported ONNX encoders under onnxruntime beside PyTorch eager, one JSON.

Both on the CPU in fp32, the same weights and inputs, the same thread count (onnxruntime's
idle threads not spinning, so they leave the cores to torch's calls); each repeat
times one PyTorch call and one onnxruntime call per encoder, alternating which goes first;
the JSON gives the medians (ms), the paired ratio (torch / onnxruntime) with its min-max
over repeats, and the max difference of the features relative to their largest magnitude.

    python scripts/bench_onnx.py --config RWKV_CLIP_B32                   # random weights
    python scripts/bench_onnx.py runs/default/checkpoints/epoch_latest.pt --onnx-dir exported/
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rwkv_clip.errors import CheckpointError, run_cli


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", nargs="?", default=None,
                    help="weights to export and time (default: random weights of --config)")
    ap.add_argument("--config", default="RWKV_CLIP_B32", help="model config (name or JSON)")
    ap.add_argument("--onnx-dir", default=None,
                    help="folder of an export of these weights (written there if empty)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for both runtimes (default: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    if ns.batch_size < 1 or ns.repeats < 1 or ns.warmup < 0:
        raise CheckpointError("--batch-size and --repeats must be >= 1, --warmup >= 0")

    import torch

    from rwkv_clip.bench.versus import paired_ratios
    from rwkv_clip.config import folder_config, load_model_configs, read_config_json
    from rwkv_clip.export import export_state_dict
    from rwkv_clip.model import create_RWKV_Model
    from rwkv_clip.onnx import OnnxCLIP
    from rwkv_clip.onnx_export import (
        IMAGE_FILE,
        example_inputs,
        export_onnx,
        max_relative_difference,
        model_from_state,
    )

    if ns.threads:
        torch.set_num_threads(ns.threads)
    threads = torch.get_num_threads()
    if ns.checkpoint:
        exported = export_state_dict(ns.checkpoint, None)
        config = exported.config
        model = model_from_state(exported.state, exported.args)
        folder_cfg = folder_config(exported.args, config)
    else:
        config = ns.config
        torch.manual_seed(ns.seed)
        model = create_RWKV_Model(load_model_configs(config)).eval()
        folder_cfg = read_config_json(config)[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(ns.onnx_dir or tmp)
        if not (folder / IMAGE_FILE).is_file():
            export_onnx(model, folder, folder_cfg)
        session = OnnxCLIP(folder, threads=threads, spin=False)  # idle threads would slow torch
        image, text = example_inputs(model, ns.batch_size, seed=ns.seed)
        cases = {"image": (lambda: model.encode_image(image),
                           lambda: session.encode_image(image.numpy())),
                 "text": (lambda: model.encode_text(text),
                          lambda: session.encode_text(text.numpy()))}
        result = {"config": Path(config).name, "checkpoint": ns.checkpoint,
                  "batch_size": ns.batch_size, "threads": threads, "repeats": ns.repeats,
                  "device": "cpu", "precision": "fp32"}
        with torch.no_grad():
            for name, (eager, ort) in cases.items():
                for _ in range(ns.warmup):
                    eager(), ort()
                times: dict[str, list[float]] = {"torch": [], "onnxruntime": []}
                for i in range(ns.repeats):
                    order = [("torch", eager), ("onnxruntime", ort)]
                    for label, fn in order if i % 2 == 0 else order[::-1]:
                        times[label].append(_timed(fn))
                torch_ms = 1e3 * statistics.median(times["torch"])
                ort_ms = 1e3 * statistics.median(times["onnxruntime"])
                # the project's one speed statistic: median and min-max of the paired
                # ratios (torch time / onnxruntime time) over the repeats
                paired = paired_ratios(times["onnxruntime"], times["torch"])
                result[name] = {"torch_eager_ms": round(torch_ms, 3),
                                "onnxruntime_ms": round(ort_ms, 3),
                                "onnxruntime_speedup": round(paired["ratio"], 3),
                                "onnxruntime_speedup_range": [round(v, 3) for v in
                                                              paired["ratio_range"]],
                                "faster": {"ours": "onnxruntime", "theirs": "torch"}.get(
                                    paired["gain"]),  # None: the range includes 1.0
                                "max_rel_diff": max_relative_difference(ort().astype("float32"),
                                                                        eager().numpy())}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
