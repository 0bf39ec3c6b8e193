"""Zero-shot evaluation of RWKV-CLIP: classification on the paper's 11 sets or any image
folder, image-text retrieval (MSCOCO, Flickr30k, JSONL), the linear probe.

In a training loop, ``evaluate_imagefolder(model, "held_out/", device="cuda")`` returns
``acc1``, ``acc5``, ``mean_per_class_recall``. Importing this reads no data, starts no group.
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
from .linear_probe import Features, evaluate_linear_probe, linear_probe
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
    "ImageNetEvalTransform", "Features", "evaluate_linear_probe", "linear_probe",
]
