"""Shared helpers of the tests/test_train_*.py files: tiny generated data and argv."""
from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = str(REPO / "model_config" / "RWKV_CLIP_tiny.json")
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220),
           "yellow": (230, 220, 30)}


def tiny_model(**overrides):
    """RWKV_CLIP_tiny built with seed 0, config fields overridden by keyword."""
    import torch

    from rwkv_clip import create_RWKV_Model, load_model_configs
    args = load_model_configs(TINY_CONFIG)
    for key, value in overrides.items():
        setattr(args, key, value)
    torch.manual_seed(0)
    return create_RWKV_Model(args)


def record_step_grads(model, optimizer) -> dict:
    """The gradients ``optimizer`` steps with, by parameter name, filled at each step
    (``train_step`` clears the gradients after the step)."""
    grads: dict = {}

    def hook(opt, args, kwargs):
        grads.update({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
    optimizer.register_step_pre_hook(hook)
    return grads


def make_tiny_rec(folder: str | os.PathLike, n: int = 48, seed: int = 0, size: int = 24) -> str:
    """Write ``n`` coloured-square images with three caption styles to a .rec; return
    its prefix."""
    from rwkv_clip.data import write_rec

    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    samples = []
    for i in range(n):
        colour = names[i % len(names)]
        img = np.full((size, size, 3), 128, np.uint8)
        x, y = rng.integers(0, size // 2, 2)
        img[y:y + size // 2, x:x + size // 2] = COLOURS[colour]
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        samples.append({"name": str(i), "image_bytes": buf.getvalue(),
                        "raw": f"a {colour} square", "synthetic": f"a photo of a {colour} box",
                        "generated": f"an image showing a {colour} square on gray"})
    prefix = str(Path(folder) / "tiny")
    write_rec(samples, prefix)
    return prefix


def tiny_argv(output: str | os.PathLike, train_data: str, *extra: str) -> list[str]:
    """Command line for a tiny, fast CPU run (no tqdm, no final zero-shot)."""
    return ["--config", TINY_CONFIG, "--train-data", train_data, "--output", str(output),
            "--device", "cpu", "--loader", "torch", "--workers", "0", "--batch-size", "8",
            "--epochs", "1", "--precision", "fp32", "--progress", "False",
            "--final-zero-shot", "False", "--tensorboard", "False", "--log-every", "1",
            *extra]
