"""Serving on a CPU: our exported encoders against open_clip's ViTs exported the same way.

Both sides go through :func:`rwkv_clip.onnx_export.export_module` (``torch.export``,
dynamic batch) with random weights, are quantised the same way for INT8
(:func:`rwkv_clip.quantize.quantize_folder`'s products) and run by the same
:func:`rwkv_clip.onnx.open_encoder`; each case times both in ABBA order in one process.
"""
from __future__ import annotations

import contextlib
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError

# name -> (our config, open_clip's model, image side)
PAIRS = {
    "b32": ("RWKV_CLIP_B32", "ViT-B-32", 224),
    "b16": ("RWKV_CLIP_B16", "ViT-B-16", 224),
    "b16-448": ("RWKV_CLIP_B16", "ViT-B-16", 448),
    "b16-896": ("RWKV_CLIP_B16", "ViT-B-16", 896),
}
TOWERS = ("image", "text")
PRECISIONS = ("fp32", "int8")


@dataclass(frozen=True)
class Case:
    pair: str
    tower: str
    runtime: str
    precision: str
    batch: int


class _Tower(torch.nn.Module):
    """One encoder of a CLIP model (ours or open_clip's) as a module of one input."""

    def __init__(self, model: Any, tower: str) -> None:
        super().__init__()
        self.model, self.tower = model, tower

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(x) if self.tower == "image" else self.model.encode_text(x)


def _models(pair: str, seed: int) -> tuple[Any, Any]:
    from ..config import load_model_configs
    from ..model import create_RWKV_Model
    from .versus import build_open_clip

    config, vit, side = PAIRS[pair]
    args = load_model_configs(config)
    args = type(args).from_dict({**args.to_dict(), "input_size": side}, source=config)
    torch.manual_seed(seed)
    ours = create_RWKV_Model(args).eval()
    options = {} if side == 224 else {"force_image_size": side}
    return ours, build_open_clip(vit, seed=seed, **options).eval()


def _example(model: Any, tower: str, pair: str, batch: int) -> torch.Tensor:
    if tower == "image":
        side = PAIRS[pair][2]
        return torch.randn(batch, 3, side, side)
    ctx = getattr(model, "context_length", None) or int(model.text_model.args.ctx_len)
    return torch.randint(1, 49000, (batch, int(ctx)))


def exported(work: Path, pair: str, seed: int = 0) -> dict[str, dict[str, Path]]:
    """``{side: {tower: fp32 path, tower + "-int8": INT8 path}}`` for ``side`` in ("ours",
    "theirs"), exported into ``work`` (kept there and reused on the next call)."""
    from ..onnx_export import export_module
    from ..quantize import quantize_encoder

    folder = work / pair
    paths = {side: {t: folder / f"{side}_{t}.onnx" for t in TOWERS} for side in ("ours", "theirs")}
    missing = [p for side in paths.values() for p in side.values() if not p.is_file()]
    if missing:
        folder.mkdir(parents=True, exist_ok=True)
        models = dict(zip(("ours", "theirs"), _models(pair, seed), strict=True))
        with torch.no_grad():
            for side, model in models.items():
                for tower in TOWERS:
                    if not paths[side][tower].is_file():
                        export_module(_Tower(model, tower), _example(model, tower, pair, 2),
                                      tower, paths[side][tower])
    for files in paths.values():
        for tower in TOWERS:
            int8 = files[tower].with_name(files[tower].stem + "_int8.onnx")
            files[tower + "-int8"] = int8 if int8.is_file() else quantize_encoder(files[tower], int8)
    return paths


@functools.cache
def _context_length(path: Path) -> int:
    """A text encoder's token count, from its input shape (the file is parsed once)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return int(graph.input[0].type.tensor_type.shape.dim[1].dim_value)


def _input(path: Path, tower: str, pair: str, batch: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if tower == "image":
        side = PAIRS[pair][2]
        return rng.standard_normal((batch, 3, side, side), dtype=np.float32)
    return rng.integers(1, 49000, (batch, _context_length(path)), dtype=np.int64)


def run_case(case: Case, paths: dict[str, dict[str, Path]], threads: int, warmup: int,
             repeats: int, seed: int = 0) -> dict[str, Any]:
    """Time ours (``rwkv_clip``) and theirs (``open_clip``) for one case, ABBA: each side's
    step times and median, and the paired ratio (their time / ours: > 1 ours is faster)
    with its min-max (:func:`rwkv_clip.bench.versus.paired_ratios`)."""
    from ..onnx import open_encoder
    from .versus import paired_ratios

    key = case.tower if case.precision == "fp32" else case.tower + "-int8"
    runners = {}
    for side in ("ours", "theirs"):
        path = paths[side][key]
        x = _input(path, case.tower, case.pair, case.batch, seed)
        runners[side] = (open_encoder(path, case.runtime, threads, spin=False), x)
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for _ in range(warmup):
        for fn, x in runners.values():
            fn(x)
    for r in range(repeats):
        for side in (("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")):
            fn, x = runners[side]
            start = time.perf_counter()
            out = fn(x)
            times[side].append(time.perf_counter() - start)
            if not np.isfinite(out).all():
                raise ConfigError(f"{side} {case}: non-finite features")
    paired = paired_ratios(times["ours"], times["theirs"])
    return {"pair": case.pair, "tower": case.tower, "runtime": case.runtime,
            "precision": case.precision, "batch": case.batch,
            "rwkv_clip": {"median_ms": 1e3 * statistics.median(times["ours"]),
                          "step_s": times["ours"]},
            "open_clip": {"median_ms": 1e3 * statistics.median(times["theirs"]),
                          "step_s": times["theirs"]},
            **paired}


def format_row(row: dict[str, Any]) -> str:
    low, high = row["ratio_range"]
    return (f"{row['pair']:8s} {row['tower']:5s} {row['runtime']:11s} {row['precision']:4s} "
            f"b{row['batch']:<3d} ours {row['rwkv_clip']['median_ms']:9.1f} ms  theirs "
            f"{row['open_clip']['median_ms']:9.1f} ms  {row['ratio']:.2f}x ({low:.2f}-{high:.2f})")




def accuracy(checkpoint: str, work: Path, runtimes: list[str]) -> dict[str, Any]:
    """Zero-shot top-1 of ``checkpoint`` on the built-in held-out and shifted splits, by
    the evaluation protocol, for its float32 export and the INT8 copy in each runtime
    (and PyTorch's for reference): what INT8 costs."""
    from ..eval.onnx_model import OnnxModel
    from ..eval.runner import builtin_folder
    from ..eval.zeroshot import evaluate_imagefolder
    from ..export import export_state_dict
    from ..onnx_export import export_onnx_folder, model_from_state
    from ..quantize import QUANTIZATION, quantize_folder

    exported_weights = export_state_dict(checkpoint)
    fp32_dir, int8_dir = work / "accuracy" / "onnx", work / "accuracy" / "onnx-int8"
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the benchmark's JSON alone
        export_onnx_folder(exported_weights.state, exported_weights.args,
                           exported_weights.config, fp32_dir)
        quantize_folder(fp32_dir, int8_dir)
    splits = {"held_out": builtin_folder(False), "shifted": builtin_folder(True)}
    size = exported_weights.args.input_size

    def top1(model: Any) -> dict[str, float]:
        return {name: round(100 * evaluate_imagefolder(model, folder, input_size=size,
                                                       single_process=True)["acc1"], 2)
                for name, folder in splits.items()}

    result: dict[str, Any] = {"checkpoint": checkpoint, "quantization": QUANTIZATION,
                              "pytorch_fp32": top1(model_from_state(exported_weights.state,
                                                                    exported_weights.args))}
    for runtime in runtimes:
        for label, folder in (("fp32", fp32_dir), ("int8", int8_dir)):
            result[f"{runtime}_{label}"] = top1(OnnxModel(folder, runtime=runtime))
        result[f"{runtime}_int8_cost"] = {
            k: round(result[f"{runtime}_fp32"][k] - result[f"{runtime}_int8"][k], 2)
            for k in splits}
    return result


__all__ = ["PAIRS", "TOWERS", "PRECISIONS", "Case", "exported", "run_case", "format_row",
           "accuracy"]
