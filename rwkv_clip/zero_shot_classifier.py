"""Zero-shot classification in a notebook: class names in, probabilities out.

``build_zero_shot_classifier`` is open_clip's function of that name on the evaluation's own
builder (:func:`rwkv_clip.eval.zeroshot.build_classifier`); ``classify`` adds the image
side with the paper's templates: ``rwkv_clip.classify(model, images, ["cat", "dog"])``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .distributed import model_device


@torch.no_grad()
def build_zero_shot_classifier(model: Any,
                               tokenizer: Callable[[list[str]], torch.Tensor] | None,
                               classnames: Sequence[str], templates: Sequence[str],
                               device: torch.device | str | None = None,
                               batch_size: int = 256) -> torch.Tensor:
    """(C, num_classes) float32 class embeddings, one unit column per class, as open_clip's
    ``build_zero_shot_classifier``. Templates hold ``{}`` (or ``{c}``) for the class name;
    ``tokenizer`` (e.g. ``rwkv_clip.get_tokenizer(name)``; None: CLIP's BPE at the
    model's context length) maps a list of texts to token ids."""
    from .eval.zeroshot import build_classifier, unwrap_model

    model = unwrap_model(model)
    device = torch.device(device) if device is not None else model_device(model)
    was_training = model.training
    model.eval()
    try:
        return build_classifier(model, list(classnames), list(templates), device, batch_size,
                                tokenizer=tokenizer)
    finally:
        model.train(was_training)


def _image_batch(model: Any, images: Any) -> torch.Tensor:
    """(B, 3, S, S) from a tensor batch, one (3, S, S) tensor, or PIL image(s), which get
    the evaluation transform of the model's image size."""
    if isinstance(images, torch.Tensor):
        return images.unsqueeze(0) if images.dim() == 3 else images
    from .eval.zeroshot import model_input_size
    from .transform import EvalTransform

    items = images if isinstance(images, (list, tuple)) else [images]
    preprocess = EvalTransform(model_input_size(model))
    return torch.stack([preprocess(image) for image in items])


@torch.no_grad()
def classify(model: Any, images: Any, classnames: Sequence[str],
             templates: Sequence[str] | None = None,
             tokenizer: Callable[[list[str]], torch.Tensor] | None = None,
             device: torch.device | str | None = None) -> torch.Tensor:
    """(B, len(classnames)) class probabilities of ``images`` (preprocessed tensors, or PIL
    images): softmax of 100 x the normalised image features against
    :func:`build_zero_shot_classifier` with ``templates`` (default: the paper's, CLIP's 80
    ImageNet templates). The evaluation's logits (``zero_shot.py``), softmaxed."""
    from .eval.datasets import default_templates
    from .eval.zeroshot import LOGIT_SCALE, unwrap_model

    model = unwrap_model(model)
    device = torch.device(device) if device is not None else model_device(model)
    weights = build_zero_shot_classifier(model, tokenizer, classnames,
                                         templates or default_templates("imagenet"), device)
    batch = _image_batch(model, images).to(device)
    was_training = model.training
    model.eval()
    try:
        features = F.normalize(model.encode_image(batch).float(), dim=-1)
    finally:
        model.train(was_training)
    return (LOGIT_SCALE * features @ weights).softmax(dim=-1)


__all__ = ["build_zero_shot_classifier", "classify"]
