"""Metrics for zero-shot classification and cross-modal retrieval.

Names follow LAION-AI/CLIP_benchmark; values are fractions in [0, 1]. Everything works on
float logits (the original's integer logits turned near-ties into exact ties).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

# The paper's headline metric per classification set (the original's ``mean_per_class``
# flag on caltech101, aircraft, flowers and pets; top-1 accuracy everywhere else).
MEAN_PER_CLASS_SETS = frozenset({"caltech101", "aircraft", "flowers", "pets"})


def headline_metric_name(dataset: str) -> str:
    """The metric the paper reports for ``dataset``."""
    return "mean_per_class_recall" if dataset in MEAN_PER_CLASS_SETS else "acc1"


def topk_correct(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """Bool (N,) : is the target among the k highest logits of each row."""
    if logits.dim() != 2 or targets.dim() != 1 or logits.shape[0] != targets.shape[0]:
        raise ValueError(f"logits must be (N, C) and targets (N,), got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    k = min(k, logits.shape[1])
    top = logits.topk(k, dim=1, largest=True, sorted=True).indices
    return (top == targets.view(-1, 1)).any(dim=1)


def accuracy(logits: torch.Tensor, targets: torch.Tensor, k: int = 1) -> float:
    """Fraction of rows whose target is in the top k."""
    if logits.shape[0] == 0:
        raise ValueError("accuracy of an empty set is undefined")
    return topk_correct(logits, targets, k).double().mean().item()


def per_class_recall(preds: torch.Tensor, targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(num_classes,) recall of each class; NaN for classes without samples."""
    preds = preds.long().view(-1)
    targets = targets.long().view(-1)
    support = torch.bincount(targets, minlength=num_classes).double()
    hits = torch.bincount(targets[preds == targets], minlength=num_classes).double()
    recall = torch.full((num_classes,), float("nan"), dtype=torch.float64)
    present = support > 0
    recall[present] = hits[present] / support[present]
    return recall


def mean_per_class_recall(preds: torch.Tensor, targets: torch.Tensor, num_classes: int) -> float:
    """Mean over the classes present in ``targets`` of the per-class recall (sklearn's
    ``balanced_accuracy_score``; the original's ``metric_mean_per_class_accuracy``)."""
    recall = per_class_recall(preds, targets, num_classes)
    present = ~torch.isnan(recall)
    if not present.any():
        raise ValueError("mean per-class recall of an empty set is undefined")
    return recall[present].mean().item()


def classification_metrics(logits: torch.Tensor, targets: torch.Tensor,
                           num_classes: int | None = None) -> dict[str, float | None]:
    """``acc1``, ``acc5`` (None with fewer than 5 classes, as CLIP_benchmark) and
    ``mean_per_class_recall`` from float logits (N, C) and integer targets (N,)."""
    logits = logits.float()
    targets = targets.long()
    num_classes = num_classes or logits.shape[1]
    if targets.numel() and (targets.min() < 0 or targets.max() >= num_classes):
        raise ValueError(f"targets must lie in [0, {num_classes}), got "
                         f"[{targets.min().item()}, {targets.max().item()}]")
    preds = logits.argmax(dim=1)
    return {
        "acc1": accuracy(logits, targets, 1),
        "acc5": accuracy(logits, targets, 5) if num_classes >= 5 else None,
        "mean_per_class_recall": mean_per_class_recall(preds, targets, num_classes),
    }


def positives_from_index(text_to_image: Sequence[int], num_images: int) -> torch.Tensor:
    """Bool (num_images, num_texts): True where text j describes image i."""
    index = torch.as_tensor(list(text_to_image), dtype=torch.long)
    pos = torch.zeros(num_images, index.numel(), dtype=torch.bool)
    pos[index, torch.arange(index.numel())] = True
    return pos


def recall_at_k(scores: torch.Tensor, positives: torch.Tensor, k: int,
                chunk: int = 1024) -> torch.Tensor:
    """Bool (Q,): for each query row of ``scores`` (Q, D), is any of its positive
    documents (``positives`` (Q, D) bool) among its k best-scored documents."""
    if scores.shape != positives.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and positives {tuple(positives.shape)} "
                         "must have the same shape")
    k = min(k, scores.shape[1])
    out = []
    for start in range(0, scores.shape[0], chunk):
        s = scores[start:start + chunk]
        p = positives[start:start + chunk]
        top = s.topk(k, dim=1, largest=True, sorted=True).indices
        out.append(p.gather(1, top).any(dim=1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)


def retrieval_metrics(image_features: torch.Tensor, text_features: torch.Tensor,
                      text_to_image: Sequence[int], ks: Iterable[int] = (1, 5, 10),
                      normalize: bool = True) -> dict[str, float]:
    """Image->text and text->image recall@k from features (a query counts when any of
    its positives is in its top k). ``text_to_image[j]`` is the image of caption j.
    Keys: ``image_retrieval_recall@k`` (text -> image), ``text_retrieval_recall@k``
    (image -> text)."""
    img = image_features.float()
    txt = text_features.float()
    if normalize:
        img = torch.nn.functional.normalize(img, dim=-1)
        txt = torch.nn.functional.normalize(txt, dim=-1)
    if len(text_to_image) != txt.shape[0]:
        raise ValueError(f"{txt.shape[0]} text features but {len(text_to_image)} entries in "
                         "text_to_image")
    scores = img @ txt.t()  # (num_images, num_texts)
    return retrieval_metrics_from_scores(scores, text_to_image, ks)


def retrieval_metrics_from_scores(scores: torch.Tensor, text_to_image: Sequence[int],
                                  ks: Iterable[int] = (1, 5, 10)) -> dict[str, float]:
    """As :func:`retrieval_metrics` from a (num_images, num_texts) similarity matrix."""
    positives = positives_from_index(text_to_image, scores.shape[0])
    if not positives.any(dim=1).all():
        missing = (~positives.any(dim=1)).nonzero().view(-1)[:5].tolist()
        raise ValueError(f"images without any caption (first: {missing}); every image "
                         "needs at least one caption")
    metrics: dict[str, float] = {}
    for k in ks:
        metrics[f"image_retrieval_recall@{k}"] = recall_at_k(scores.t(), positives.t(), k).double().mean().item()
        metrics[f"text_retrieval_recall@{k}"] = recall_at_k(scores, positives, k).double().mean().item()
    return metrics
