"""Serve an exported RWKV-CLIP with onnxruntime and numpy only (no torch).

:class:`OnnxCLIP` reads a folder written by ``python -m rwkv_clip.export ... --format onnx``
and takes the model's inputs (:meth:`OnnxCLIP.preprocess` makes an image array); usage is
in docs/export.md.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

ONNX_CONFIG_FILE = "onnx_config.json"
PREPROCESS_CONFIG_FILE = "preprocess_config.json"


def _onnx_error(message: str) -> Exception:
    from .errors import CheckpointError  # torch-free

    return CheckpointError(message)


def _load_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise _onnx_error("running ONNX encoders needs onnxruntime: pip install onnxruntime "
                          "(or pip install 'rwkv-clip[onnx]')") from None
    return onnxruntime


def _read_json(path: Path) -> dict[str, Any]:
    from .json_files import read_json_object

    return read_json_object(path, missing_hint="expected a folder written by python -m "
                            "rwkv_clip.export CHECKPOINT --format onnx --output DIR")


class OnnxCLIP:
    """The two exported encoders of a folder, with the model's ``encode_image`` /
    ``encode_text`` inputs and outputs as numpy arrays (float32 features of shape
    (B, C); L2-normalised if the export was made with ``--normalize``)."""

    def __init__(self, folder: str | os.PathLike, providers: list[str] | None = None,
                 threads: int | None = None) -> None:
        ort = _load_onnxruntime()
        self.folder = Path(folder)
        self.config = _read_json(self.folder / ONNX_CONFIG_FILE)
        self.preprocess_config = _read_json(self.folder / PREPROCESS_CONFIG_FILE)
        self.normalize = bool(self.config.get("normalize", False))
        # the scoring head: logit_scale (a log) and, for a SigLIP model, logit_bias
        self.logit_scale: float | None = self.config.get("logit_scale")
        self.logit_bias: float | None = self.config.get("logit_bias")
        self.image_size = int(self.config["image_input"]["shape"][2])
        self.context_length = int(self.config["text_input"]["shape"][1])
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        providers = providers or ["CPUExecutionProvider"]

        def session(name: str) -> Any:
            path = self.folder / self.config[name]
            if not path.is_file():
                raise _onnx_error(f"{path} does not exist (named in {ONNX_CONFIG_FILE})")
            return ort.InferenceSession(str(path), options, providers=providers)

        self.image_session = session("image_encoder")
        self.text_session = session("text_encoder")

    def encode_image(self, image: np.ndarray) -> np.ndarray:
        """(B, 3, S, S) preprocessed images -> (B, C) float32 features."""
        image = np.asarray(image)
        size = self.image_size
        if image.ndim != 4 or image.shape[1:] != (3, size, size):
            raise _onnx_error(f"encode_image: expected images of shape (B, 3, {size}, {size}), "
                              f"got {image.shape}")
        feed = {self.config["image_input"]["name"]: image.astype(np.float32, copy=False)}
        return self.image_session.run(None, feed)[0]

    def encode_text(self, text: np.ndarray) -> np.ndarray:
        """(B, ctx_len) token ids -> (B, C) float32 features."""
        text = np.asarray(text)
        if text.ndim != 2 or text.shape[1] != self.context_length:
            raise _onnx_error(f"encode_text: expected token ids of shape (B, "
                              f"{self.context_length}), got {text.shape} (tokenize with "
                              f"context_length={self.context_length})")
        if not np.issubdtype(text.dtype, np.integer):
            raise _onnx_error(f"encode_text: expected integer token ids, got {text.dtype}")
        feed = {self.config["text_input"]["name"]: text.astype(np.int64, copy=False)}
        return self.text_session.run(None, feed)[0]

    def preprocess(self, image: Any) -> np.ndarray:
        """A PIL image -> (3, S, S) float32: bicubic resize of the shorter side to S, centre
        crop, CLIP mean/std (the evaluation transform of ``create_model_and_transforms``)."""
        from PIL import Image

        cfg = self.preprocess_config
        size = int(cfg["size"])
        image = image.convert("RGB")
        w, h = image.size  # shorter side to size, the longer one truncated (torchvision's)
        new_w, new_h = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
        image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
        left, top = int(round((new_w - size) / 2.0)), int(round((new_h - size) / 2.0))
        image = image.crop((left, top, left + size, top + size))
        array = np.asarray(image, dtype=np.float32) / 255.0
        mean = np.asarray(cfg["mean"], dtype=np.float32)
        std = np.asarray(cfg["std"], dtype=np.float32)
        return ((array - mean) / std).transpose(2, 0, 1).copy()


__all__ = ["OnnxCLIP"]
