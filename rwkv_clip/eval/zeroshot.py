"""Zero-shot classification: the original's classifier (:func:`build_classifier`) and logits,
kept in float32 where the original wrote them into an integer tensor. No sample is padded
or counted twice, in one process or sharded over torchrun ranks.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..checkpoint_files import unwrap_model
from .common import encode_images_gathered, encode_texts
from .datasets import ClassificationSet, fill_template, image_folder_set
from .distributed import DistInfo, current
from .metrics import classification_metrics, headline_metric_name

LOGIT_SCALE = 100.0


@torch.no_grad()
def build_classifier(model, classnames: Sequence[str], templates: Sequence[str],
                     device: torch.device | str, batch_size: int = 256,
                     precision: str = "fp32", tokenizer=None) -> torch.Tensor:
    """(C, num_classes) float32 zero-shot weights, one unit column per class (``tokenizer``:
    texts -> token ids, default CLIP's BPE at the model's context length).

    As the original's ``zero_shot_classifier``: for each class, encode every template
    filled with the class name, L2-normalise each text feature, average them and normalise
    the mean. Logits are then 100 x (L2-normalised image features) @ classifier, in float32.
    """
    device = torch.device(device)
    if not classnames:
        raise ValueError("no class names")
    if not templates:
        raise ValueError("no templates")
    texts = [fill_template(t, c) for c in classnames for t in templates]
    feats = encode_texts(model, texts, device, batch_size, precision, tokenizer)  # unit rows
    per_class = feats.view(len(classnames), len(templates), -1).mean(dim=1)
    weights = F.normalize(per_class, dim=-1)
    return weights.t().contiguous().to(device)


@torch.no_grad()
def classification_logits(model, eval_set: ClassificationSet, classifier: torch.Tensor,
                          device: torch.device | str, batch_size: int = 64, workers: int = 0,
                          precision: str = "fp32", info: DistInfo | None = None,
                          log: Callable[[str], None] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (N, num_classes) float32, targets (N,)) for the whole set on every rank
    (``log``: the estimate and progress lines of a long encoding)."""
    device = torch.device(device)
    classifier = classifier.float().to(device)
    targets, logits = encode_images_gathered(
        model, eval_set.dataset, device, batch_size, workers, precision,
        describe=eval_set.describe, fn=lambda f: LOGIT_SCALE * f @ classifier, info=info,
        log=log)
    return logits, targets


def class_probabilities(model, logits: torch.Tensor) -> torch.Tensor:
    """Class probabilities from :func:`classification_logits` (LOGIT_SCALE x cosine): a
    softmax over the classes for a CLIP model; for a SigLIP model (one with
    ``logit_bias``) each class's own ``sigmoid(exp(logit_scale) x cosine + logit_bias)``,
    the pair probability it was trained for. Accuracy is the same either way (both are
    increasing in the cosine)."""
    model = unwrap_model(model)
    logits = logits.float()
    bias = getattr(model, "logit_bias", None)
    if bias is None:
        return logits.softmax(dim=-1)
    scale = model.logit_scale.detach().float().exp().to(logits.device)
    return torch.sigmoid(scale * logits / LOGIT_SCALE + bias.detach().float().to(logits.device))


def evaluate_classification(model, eval_set: ClassificationSet, device: torch.device | str,
                            batch_size: int = 64, workers: int = 0, precision: str = "fp32",
                            text_batch_size: int = 256, info: DistInfo | None = None,
                            log: Callable[[str], None] | None = None) -> dict:
    """Metrics of ``model`` on ``eval_set``: ``acc1``, ``acc5``, ``mean_per_class_recall``
    plus ``headline`` (the paper's metric for this set), ``headline_metric`` and
    ``num_samples``. Runs sharded when a process group is up; every rank returns the
    same result. ``log``: the estimate and progress lines of a long encoding."""
    info = info or current()
    model = unwrap_model(model)
    was_training = model.training
    model.eval()
    try:
        classifier = build_classifier(model, eval_set.classnames, eval_set.templates, device,
                                      text_batch_size, precision)
        logits, targets = classification_logits(model, eval_set, classifier, device,
                                                 batch_size, workers, precision, info, log)
    finally:
        model.train(was_training)
    metrics: dict[str, Any] = dict(classification_metrics(logits, targets, eval_set.num_classes))
    name = headline_metric_name(eval_set.name)
    metrics.update(headline_metric=name, headline=metrics[name], num_samples=int(targets.numel()))
    return metrics


def model_input_size(model) -> int:
    """The image size the model was built for (patch grid x patch size)."""
    tower: Any = unwrap_model(model).image_model
    return int(tower.patch_resolution[0] * tower.patch_embed.projection.kernel_size[0])


def evaluate_imagefolder(model, folder: str | os.PathLike, device: torch.device | str = "cpu",
                         batch_size: int = 64, input_size: int | None = None,
                         templates: Sequence[str] | None = None,
                         classnames: Sequence[str] | None = None, workers: int = 0,
                         precision: str = "fp32", name: str = "imagefolder",
                         single_process: bool = False) -> dict:
    """Zero-shot metrics on an image folder (one sub-folder per class), e.g. the built-in
    held-out split during training. Class names and templates default to the folder's
    ``classnames.json``/``templates.json``, else folder names and CLIP's 80 templates.
    ``input_size`` defaults to the model's image size. DDP / torch.compile wrappers are
    unwrapped; train/eval mode is restored afterwards. Returns a dict with ``acc1``,
    ``acc5`` and ``mean_per_class_recall`` (fractions in [0, 1]).

    With a process group up, call it on every rank (each encodes a shard, all get the
    same metrics), or pass ``single_process=True`` to evaluate everything on this rank
    alone (e.g. only on rank 0)."""
    from ..transform import EvalTransform

    if input_size is None:
        input_size = model_input_size(model)
    eval_set = image_folder_set(folder, EvalTransform(input_size), name=name,
                                classnames=classnames, templates=templates)
    return evaluate_classification(model, eval_set, device, batch_size, workers, precision,
                                   info=DistInfo() if single_process else None)
