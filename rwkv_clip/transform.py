"""Image transforms: open_clip's ``image_transform`` with the CLIP mean/std defaults, and
:class:`EvalTransform`, its evaluation variant computed on PIL alone (importing open_clip
or torchvision costs seconds, which every evaluation would pay before its first image)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

OPENAI_DATASET_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_DATASET_STD = (0.26862954, 0.26130258, 0.27577711)


class EvalTransform:
    """PIL image -> (3, S, S) float32: open_clip's ``image_transform(S, is_train=False)``
    step by step (shorter side to S with PIL's bicubic, centre crop S, RGB, /255, mean/std),
    equal to it in every value. Other inputs (tensors) go through open_clip's own."""

    def __init__(self, size: int, mean=OPENAI_DATASET_MEAN, std=OPENAI_DATASET_STD):
        self.size = int(size)
        self.mean_std = (tuple(mean), tuple(std))
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self._open_clip: Callable[[Any], torch.Tensor] | None = None

    def __call__(self, image) -> torch.Tensor:
        if not isinstance(image, Image.Image):
            if self._open_clip is None:
                self._open_clip = image_transform(self.size, False, *self.mean_std)
            return self._open_clip(image)
        s, (w, h) = self.size, image.size
        # torchvision's shorter-side size: the longer side scaled and truncated
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(s * long / short)
        new_w, new_h = (s, new_long) if w <= h else (new_long, s)
        if (new_w, new_h) != (w, h):
            image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
        top, left = int(round((new_h - s) / 2.0)), int(round((new_w - s) / 2.0))
        image = image.crop((left, top, left + s, top + s)).convert("RGB")
        x = torch.from_numpy(np.array(image, np.uint8, copy=True)).permute(2, 0, 1)
        return x.contiguous().to(torch.float32).div(255).sub_(self.mean).div_(self.std)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, mean={self.mean_std[0]}, std={self.mean_std[1]})"


def image_transform(image_size, is_train: bool, mean=None, std=None, **kwargs):
    """PIL image -> normalised tensor: resize + center crop (eval) or random resized crop
    (train): open_clip's own transform (a torchvision ``Compose``), mean/std defaulting to
    CLIP's. The evaluation code uses :class:`EvalTransform`, the same values without
    importing open_clip."""
    from open_clip.transform import image_transform as open_clip_image_transform
    return open_clip_image_transform(image_size, is_train=is_train,
                                     mean=mean or OPENAI_DATASET_MEAN,
                                     std=std or OPENAI_DATASET_STD, **kwargs)
