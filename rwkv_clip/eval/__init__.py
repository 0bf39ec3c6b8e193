"""Zero-shot evaluation of RWKV-CLIP: classification on the paper's 11 sets or any image
folder, image-text retrieval (MSCOCO, Flickr30k, JSONL), CLIP_benchmark-shaped results.

Training-loop use::

    from rwkv_clip.eval import evaluate_imagefolder
    metrics = evaluate_imagefolder(model, "held_out/", device="cuda", batch_size=128)
    metrics["acc1"], metrics["acc5"], metrics["mean_per_class_recall"]

Preprocessing per set, as the original: ``eval_transform(dataset, input_size)``.

Importing this package reads no data and starts no process group.
"""
from ..errors import DatasetNotFoundError, EvalError, ImageReadError
from .datasets import (
                       PAPER_DATASETS,
                       ClassificationSet,
                       build_classification_set,
                       default_classnames,
                       default_templates,
                       image_folder_set,
                       load_templates,
)
from .metrics import (
                       accuracy,
                       classification_metrics,
                       headline_metric_name,
                       mean_per_class_recall,
                       retrieval_metrics,
)
from .results import result_record, summary, write_result
from .retrieval import RetrievalSet, build_retrieval_set, evaluate_retrieval, load_retrieval_file
from .transforms import ImageNetEvalTransform, eval_transform
from .zeroshot import build_classifier, evaluate_classification, evaluate_imagefolder

__all__ = [
    "PAPER_DATASETS", "ClassificationSet", "DatasetNotFoundError", "EvalError", "ImageReadError",
    "build_classification_set", "default_classnames", "default_templates", "image_folder_set",
    "load_templates", "accuracy", "classification_metrics", "headline_metric_name",
    "mean_per_class_recall", "retrieval_metrics", "result_record", "summary", "write_result",
    "RetrievalSet", "build_retrieval_set", "evaluate_retrieval", "load_retrieval_file",
    "build_classifier", "evaluate_classification", "evaluate_imagefolder", "eval_transform",
    "ImageNetEvalTransform",
]
