#!/usr/bin/env python
"""Images/s of each data loader per worker count, beside what a training step consumes.

Writes a small generated image-text set once (``--samples`` photo-like JPEGs of
``--image-size`` pixels, as .rec, and as parquet with the same rows), then times each
loader at the B/32 input size (224) for every ``--workers`` value: DALI CPU-only and
DALI GPU (when DALI / a GPU are present) and the PyTorch loader on the .rec, and the
parquet loader. The first batch (worker start-up, pipeline build) is not timed. Prints
ONE JSON object; ``loaders[name][workers] = {"images_per_s", "batches", "seconds"}``.

The training step's consumption comes from bench_train: ``--train-json FILE`` (its
output) or ``--bench-train`` (runs scripts/bench_train.py here with its defaults); then
``train_samples_per_s`` is set and each result says whether it keeps up
(``keeps_up``: images/s >= the step's samples/s, per process). Pick the smallest
``--workers`` that keeps up, leaving cores for the other processes on the node.

    python scripts/bench_data.py                           # quick: 256 images, workers 0,2
    python scripts/bench_data.py --workers 2,4,8,16 --samples 2048 --bench-train
"""
from __future__ import annotations

import argparse
import gc
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rwkv_clip.bench.provenance import measured
from rwkv_clip.data import build_train_loader, dali_available
from rwkv_clip.data.writers import write_rec
from rwkv_clip.errors import TrainingError, run_cli

LOADERS = ("dali_cpu", "dali_gpu", "torch", "parquet")


def photo_like(i: int, w: int, h: int) -> bytes:
    """A JPEG that costs what a photo costs to decode: smooth gradients plus noise."""
    from PIL import Image
    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([127 + 100 * np.sin(x / (13 + i % 7) + c) * np.cos(y / (17 + i % 5))
                     for c in range(3)], axis=-1)
    img = np.clip(base + rng.normal(0, 18, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make_set(folder: Path, n: int, size: tuple[int, int]) -> dict[str, str]:
    """The same n image-caption rows as ``bench.rec`` and ``bench.parquet`` (cached)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    folder.mkdir(parents=True, exist_ok=True)
    tag = f"n{n}_{size[0]}x{size[1]}"
    rec, parquet = folder / f"bench_{tag}", folder / f"bench_{tag}.parquet"
    if not (rec.with_suffix(".rec").is_file() and parquet.is_file()):
        images = [photo_like(i, *size) for i in range(n)]
        caps = [f"a photo of generated scene number {i}" for i in range(n)]
        write_rec([{"name": str(i), "image_bytes": b, "raw": c}
                   for i, (b, c) in enumerate(zip(images, caps, strict=True))], str(rec))
        tmp = parquet.with_suffix(".parquet.tmp")
        pq.write_table(pa.table({"jpg": images, "caption": caps,
                                 "status": ["success"] * n}), tmp, row_group_size=100)
        os.replace(tmp, parquet)
    return {"rec": str(rec), "parquet": str(parquet)}


def loader_args(name: str, data: dict, workers: int, batch: int, size: int) -> SimpleNamespace:
    fmt = "parquet" if name == "parquet" else "rec"
    kind = "dali" if name.startswith("dali") else "torch"
    workers = max(1, workers) if kind == "dali" else workers  # DALI: threads, at least 1
    return SimpleNamespace(train_data=data[fmt], data_format=fmt, batch_size=batch,
                           workers=workers, input_size=size, seed=0, skip_corrupt=False,
                           device="cuda" if name == "dali_gpu" else "cpu", rank=0,
                           world_size=1, loader=kind if fmt == "rec" else "auto")


def time_loader(args: SimpleNamespace, batches: int) -> dict:
    """Images/s over ``batches`` batches after one untimed batch (start-up)."""
    loader = build_train_loader(args, log=None)
    done, images = 0, 0
    try:
        it = iter(loader)
        first = next(it)
        if first[0].is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while done < batches:
            try:
                imgs, _ = next(it)
            except StopIteration:  # next epoch: the loop resets the loader the same way
                loader.reset()
                it = iter(loader)
                continue
            done += 1
            images += int(imgs.shape[0])
        if imgs.is_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    finally:
        del loader
        gc.collect()
    return {"images_per_s": images / dt, "batches": done, "seconds": dt}


def available(name: str) -> str | None:
    """None if the loader can run here, else why not."""
    if name.startswith("dali") and not dali_available():
        return "nvidia-dali is not installed"
    if name == "dali_gpu" and not torch.cuda.is_available():
        return "no CUDA device"
    return None


def train_consumption(ns) -> dict | None:
    if ns.train_json:
        return json.loads(Path(ns.train_json).read_text())
    if not ns.bench_train:
        return None
    cmd = [sys.executable, str(REPO / "scripts" / "bench_train.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise TrainingError(f"bench_train.py failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="0,2", help="comma list of worker counts")
    ap.add_argument("--loaders", default=",".join(LOADERS), help="subset of " + ", ".join(LOADERS))
    ap.add_argument("--samples", type=int, default=256, help="generated image-text rows")
    ap.add_argument("--image-size", default="400x300", help="generated image WxH")
    ap.add_argument("--input-size", type=int, default=224, help="loader output side (B/32)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--batches", type=int, default=8, help="timed batches per measurement")
    ap.add_argument("--data-dir", default=None,
                    help="where the set is written (default: a temporary folder)")
    ap.add_argument("--train-json", default=None, help="bench_train.py output to compare to")
    ap.add_argument("--bench-train", action="store_true",
                    help="run scripts/bench_train.py for the comparison")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ns = ap.parse_args(argv)
    workers = [int(w) for w in ns.workers.split(",") if w.strip()]
    names = [n.strip() for n in ns.loaders.split(",") if n.strip()]
    unknown = [n for n in names if n not in LOADERS]
    if unknown or not workers or min(workers) < 0 or ns.batches < 1:
        ap.error(f"--loaders from {', '.join(LOADERS)}; --workers non-negative integers; "
                 "--batches >= 1")
    w, h = (int(v) for v in ns.image_size.lower().split("x"))

    train = train_consumption(ns)
    train_sps = train.get("samples_per_s") if train else None
    with tempfile.TemporaryDirectory() as tmp:
        data = make_set(Path(ns.data_dir or tmp), ns.samples, (w, h))
        results: dict = {}
        for name in names:
            why = available(name)
            if why:
                results[name] = {"skipped": why}
                continue
            results[name] = {}
            for n in workers:
                r = time_loader(loader_args(name, data, n, ns.batch_size, ns.input_size),
                                ns.batches)
                if train_sps:
                    r["keeps_up"] = r["images_per_s"] >= train_sps
                results[name][str(n)] = r
    out = {
        "input_size": ns.input_size, "batch_size": ns.batch_size, "samples": ns.samples,
        "image_size": [w, h], "timed_batches": ns.batches, "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "loaders": results,
        "train_samples_per_s": train_sps,
        "train": {k: train.get(k) for k in ("config", "device", "batch_size", "precision",
                                            "samples_per_s")} if train else None,
        **measured(),
    }
    text = json.dumps(out)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="bench_data.py"))
