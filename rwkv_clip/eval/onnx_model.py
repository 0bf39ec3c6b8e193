"""An exported ONNX folder as a model the evaluation code takes (``zero_shot.py --onnx``).

The encoders run in onnxruntime or OpenVINO (:class:`rwkv_clip.onnx.OnnxCLIP`); the
classifiers, logits and metrics are the ones every PyTorch model gets, so an export
(float32 or INT8) is scored by the same protocol as the checkpoint it came from.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from torch import nn


class OnnxModel(nn.Module):
    """``encode_image`` / ``encode_text`` of an exported folder, tensors in and out (CPU,
    float32 features); ``image_size`` and ``context_length`` are the export's."""

    def __init__(self, folder: str | os.PathLike, runtime: str = "onnxruntime",
                 threads: int | None = None) -> None:
        super().__init__()
        from ..onnx import OnnxCLIP

        self.clip = OnnxCLIP(folder, runtime=runtime, threads=threads)
        self.image_size, self.context_length = self.clip.image_size, self.clip.context_length
        # what the evaluation code reads of a model: the text tower's context length
        self.text_model = SimpleNamespace(args=SimpleNamespace(ctx_len=self.context_length))

    def encode_image(self, image: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        features = torch.from_numpy(self.clip.encode_image(image.float().cpu().numpy()))
        return nn.functional.normalize(features, dim=-1) if normalize else features

    def encode_text(self, text: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        features = torch.from_numpy(self.clip.encode_text(text.cpu().numpy()))
        return nn.functional.normalize(features, dim=-1) if normalize else features

    def describe(self) -> str:
        quantized = self.clip.quantization
        return (f"ONNX export {self.clip.folder} ({'INT8' if quantized else 'float32'}, "
                f"{self.clip.runtime})")


__all__ = ["OnnxModel"]
