"""Serve an exported RWKV-CLIP with onnxruntime or OpenVINO and numpy only (no torch).

:class:`OnnxCLIP` reads a folder written by ``python -m rwkv_clip.export ... --format onnx``
(or ``python -m rwkv_clip.quantize``) and takes the model's inputs
(:meth:`OnnxCLIP.preprocess` makes an image array); usage is in docs/export.md.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ONNX_CONFIG_FILE = "onnx_config.json"
PREPROCESS_CONFIG_FILE = "preprocess_config.json"


def _onnx_error(message: str) -> Exception:
    from .errors import CheckpointError  # torch-free

    return CheckpointError(message)


RUNTIMES = ("onnxruntime", "openvino")


def _import_runtime(runtime: str) -> Any:
    if runtime not in RUNTIMES:
        raise _onnx_error(f"runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    try:
        return __import__(runtime)
    except ImportError:
        raise _onnx_error(f"running ONNX encoders with {runtime} needs it installed: pip "
                          f"install {runtime} (or pip install 'rwkv-clip[onnx]')") from None


def open_encoder(path: str | os.PathLike, runtime: str = "onnxruntime",
                 threads: int | None = None, spin: bool = True,
                 providers: list[str] | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """One ``.onnx`` file of one input and one output as a function of numpy arrays, run by
    ``runtime`` on the CPU with ``threads`` threads (default: the runtime's). OpenVINO
    computes in float32 (its CPU plugin would otherwise pick bf16 where the CPU has it).
    ``spin=False`` stops onnxruntime's idle threads from spinning between calls (for
    timing two sessions in turn: a spinning idle pool takes cores from the other).
    ``providers``: onnxruntime's execution providers (default: the CPU's)."""
    module = _import_runtime(runtime)
    if not Path(path).is_file():
        raise _onnx_error(f"{path} does not exist")
    if runtime == "onnxruntime":
        options = module.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        if not spin:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = module.InferenceSession(str(path), options,
                                          providers=providers or ["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda x: session.run(None, {name: x})[0]
    config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = threads
    compiled = module.Core().compile_model(str(path), "CPU", config)
    request, output = compiled.create_infer_request(), compiled.output(0)
    # a copy: the request reuses its output buffer on the next call
    return lambda x: np.array(request.infer({0: x})[output], copy=True)


def _read_json(path: Path) -> dict[str, Any]:
    from .json_files import read_json_object

    return read_json_object(path, missing_hint="expected a folder written by python -m "
                            "rwkv_clip.export CHECKPOINT --format onnx --output DIR")


class OnnxCLIP:
    """The two exported encoders of a folder, with the model's ``encode_image`` /
    ``encode_text`` inputs and outputs as numpy arrays (float32 features of shape
    (B, C); L2-normalised if the export was made with ``--normalize``), run by
    ``runtime``: ``"onnxruntime"`` or ``"openvino"`` (``threads``, ``spin``, ``providers``:
    as :func:`open_encoder`)."""

    def __init__(self, folder: str | os.PathLike, runtime: str = "onnxruntime",
                 threads: int | None = None, spin: bool = True,
                 providers: list[str] | None = None) -> None:
        _import_runtime(runtime)
        self.runtime = runtime
        self.folder = Path(folder)
        self.config = _read_json(self.folder / ONNX_CONFIG_FILE)
        self.preprocess_config = _read_json(self.folder / PREPROCESS_CONFIG_FILE)
        self.normalize = bool(self.config.get("normalize", False))
        # the scoring head: logit_scale (a log) and, for a SigLIP model, logit_bias
        self.logit_scale: float | None = self.config.get("logit_scale")
        self.logit_bias: float | None = self.config.get("logit_bias")
        self.image_size = int(self.config["image_input"]["shape"][2])
        self.context_length = int(self.config["text_input"]["shape"][1])
        self.quantization: str | None = self.config.get("quantization")

        def encoder(name: str) -> Callable[[np.ndarray], np.ndarray]:
            path = self.folder / self.config[name]
            if not path.is_file():
                raise _onnx_error(f"{path} does not exist (named in {ONNX_CONFIG_FILE})")
            return open_encoder(path, runtime, threads, spin, providers)

        self._image = encoder("image_encoder")
        self._text = encoder("text_encoder")

    def encode_image(self, image: np.ndarray) -> np.ndarray:
        """(B, 3, S, S) preprocessed images -> (B, C) float32 features."""
        image = np.asarray(image)
        size = self.image_size
        if image.ndim != 4 or image.shape[1:] != (3, size, size):
            raise _onnx_error(f"encode_image: expected images of shape (B, 3, {size}, {size}), "
                              f"got {image.shape}")
        return self._image(np.ascontiguousarray(image, dtype=np.float32))

    def encode_text(self, text: np.ndarray) -> np.ndarray:
        """(B, ctx_len) token ids -> (B, C) float32 features."""
        text = np.asarray(text)
        if text.ndim != 2 or text.shape[1] != self.context_length:
            raise _onnx_error(f"encode_text: expected token ids of shape (B, "
                              f"{self.context_length}), got {text.shape} (tokenize with "
                              f"context_length={self.context_length})")
        if not np.issubdtype(text.dtype, np.integer):
            raise _onnx_error(f"encode_text: expected integer token ids, got {text.dtype}")
        return self._text(np.ascontiguousarray(text, dtype=np.int64))

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


__all__ = ["OnnxCLIP", "RUNTIMES", "open_encoder"]
