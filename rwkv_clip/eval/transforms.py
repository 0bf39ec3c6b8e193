"""The image preprocessing of each evaluation set, as the original computes it.

ImageNet follows the original's DALI pipeline (:class:`ImageNetEvalTransform`); every
other set and retrieval use open_clip's ``image_transform(S, is_train=False)`` (computed by
:class:`rwkv_clip.transform.EvalTransform`, equal in every value), as the
original's ``zero_shot.py`` / ``text_image_retrieval.py`` do.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

from ..transform import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD, EvalTransform

# The original's ImageNet resize: shorter side int(256 / 224 * S) before the S crop.
IMAGENET_RESIZE_RATIO = 256 / 224

PROTOCOL = {
    "imagenet": "RGB, shorter side -> int(256/224*S) (antialiased bilinear, aspect kept), "
                "centre crop S, CLIP mean/std (the original's DALI val pipeline)",
    "default": "RGB, shorter side -> S (bicubic), centre crop S, CLIP mean/std "
               "(open_clip image_transform(S, is_train=False), as the original)",
}


def _round_half_up(x: float) -> int:
    return int(np.floor(x + 0.5))


class ImageNetEvalTransform:
    """PIL image -> (3, S, S) float32 tensor by the original's ImageNet protocol.

    The original's DALI pipeline: resize the shorter side to ``int(256 / 224 * S)``
    (``not_smaller``, antialiased linear), centre crop, CLIP mean/std. PIL's antialiased
    bilinear filter with DALI's rounding of the resized size (nearest) and of the crop
    offset (half up) matches DALI's CPU operators in sizes and offsets, pixels within
    3/255 (PIL rounds to 8 bits, DALI interpolates in float)."""

    def __init__(self, input_size: int, mean=OPENAI_DATASET_MEAN, std=OPENAI_DATASET_STD):
        self.input_size = int(input_size)
        self.resize_to = int(IMAGENET_RESIZE_RATIO * self.input_size)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the shorter-side resize (DALI rounds to nearest)."""
        scale = self.resize_to / min(width, height)
        new_w = self.resize_to if width <= height else _round_half_up(width * scale)
        new_h = self.resize_to if height <= width else _round_half_up(height * scale)
        return new_w, new_h

    def __call__(self, image: Image.Image) -> torch.Tensor:
        image = image.convert("RGB")
        new_w, new_h = self.resized_size(*image.size)
        image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)  # PIL: antialiased triangle
        s = self.input_size
        # DALI's crop_mirror_normalize centres with crop_pos 0.5 and rounds half up.
        left, top = (new_w - s + 1) // 2, (new_h - s + 1) // 2
        image = image.crop((left, top, left + s, top + s))
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)
        return (pixels.permute(2, 0, 1) - self.mean) / self.std

    def __repr__(self) -> str:
        return (f"ImageNetEvalTransform(input_size={self.input_size}, "
                f"shorter_side={self.resize_to}, filter=antialiased bilinear)")


def eval_transform(dataset: str, input_size: int) -> Callable[[Image.Image], torch.Tensor]:
    """The original's preprocessing for ``dataset`` at image size ``input_size``: a
    callable PIL.Image -> (3, S, S) float tensor (see the module docstring)."""
    from .datasets import canonical_name

    if canonical_name(dataset) == "imagenet":
        return ImageNetEvalTransform(input_size)
    return EvalTransform(input_size)


def protocol(dataset: str) -> str:
    """One line describing the preprocessing of ``dataset`` (for logs and README)."""
    from .datasets import canonical_name

    return PROTOCOL["imagenet" if canonical_name(dataset) == "imagenet" else "default"]
