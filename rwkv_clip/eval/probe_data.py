"""Train and test splits of the classification sets, for the linear probe.

The test side is the zero-shot evaluation set (:func:`.datasets.build_classification_set`);
the train side is the set's own training split, read with the same eval transform (the
table per set is in docs/linear-probe-and-validation.md).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import ConcatDataset, Dataset

from ..errors import EvalError
from .datasets import (
    ORIGINAL_SEED,
    PAPER_DATASETS,
    SUN397_SEED,
    Caltech101Images,
    ClassificationSet,
    RecordImageSet,
    SUN397Images,
    _missing,
    _require,
    _Subset,
    _tv,
    build_classification_set,
    canonical_name,
    image_folder_set,
    random_split_indices,
)

TRAIN_LAYOUTS = {
    "cifar10": "{root}/cifar-10-batches-py/data_batch_1..5",
    "cifar100": "{root}/cifar-100-python/train",
    "food101": "{root}/food-101/meta/train.json",
    "pets": "{root}/oxford-iiit-pet/annotations/trainval.txt",
    "flowers": "{root}/flowers-102/setid.mat (train and val ids)",
    "stanford_car": "{root}/stanford_cars/{{devkit/cars_train_annos.mat, cars_train/}}",
    "dtd": "{root}/dtd/dtd/labels/{{train1.txt, val1.txt}}",
    "aircraft": "{root}/fgvc-aircraft-2013b/data/images_variant_trainval.txt",
    "caltech101": "{root}/caltech101/101_ObjectCategories (the 3000-image part of the "
                  "original's split)",
    "sun397": "{root}/SUN397 (the 19850-image train part of the split)",
    "imagenet": "{root}/imagenet/train/<wnid>/*.JPEG (or {root}/train/, or train.rec + train.idx)",
}


class BuiltinTrainImages(Dataset):
    """The built-in training images (``train.rec``) with the class their raw caption
    ("a red circle") names, indexed like the zero-shot folder's sorted class names."""

    def __init__(self, prefix: str, classnames: list[str], transform=None):
        from ..data.recordio import RecordIOReader

        self.reader = RecordIOReader(prefix + ".rec")
        to_class = {name: i for i, name in enumerate(classnames)}
        self.labels: dict[int, int] = {}
        with open(prefix + ".captions.jsonl", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                words = row["raw"].split(" ", 1)[1]  # drop the article
                self.labels[int(row["key"])] = to_class[words]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.reader)

    def describe(self, index: int) -> str:
        return f"{self.reader.rec_path} record {self.reader.keys[index]}"

    def __getitem__(self, index: int):
        import io

        from PIL import Image

        key, _, _, data = self.reader.read_item(index)
        with Image.open(io.BytesIO(data)) as raw:
            img = raw.convert("RGB")
        return (self.transform(img) if self.transform else img), self.labels[int(key)]


def dataset_targets(dataset: Any) -> torch.Tensor | None:
    """The class of every sample, read without decoding an image (the built-in images,
    image lists, torchvision's sets); None when the dataset does not say."""
    if isinstance(dataset, BuiltinTrainImages):
        return torch.tensor([dataset.labels[int(k)] for k in dataset.reader.keys])
    if isinstance(dataset, ConcatDataset):
        parts = [dataset_targets(part) for part in dataset.datasets]
        return None if any(p is None for p in parts) else torch.cat(parts)  # type: ignore[arg-type]
    samples = getattr(dataset, "samples", None)
    if isinstance(samples, list) and samples and isinstance(samples[0], tuple):
        return torch.tensor([int(s[1]) for s in samples])
    for attr in ("targets", "_labels", "labels", "y"):
        values = getattr(dataset, attr, None)
        if values is not None and len(values) == len(dataset):
            return torch.as_tensor([int(v) for v in values])
    return None


def builtin_splits(transform, builtin=None) -> tuple[ClassificationSet, ClassificationSet]:
    """``builtin``: a :class:`~rwkv_clip.data.builtin.BuiltinDataset` (default: the
    default one, generated on first use)."""
    from ..data.builtin import ensure_builtin_dataset

    ds = builtin or ensure_builtin_dataset()
    test = image_folder_set(ds.zeroshot_dir, transform, name="builtin")
    train_ds = BuiltinTrainImages(ds.train_prefix, test.classnames, transform)
    train = ClassificationSet("builtin", train_ds, test.classnames, test.templates,
                              describe=train_ds.describe)
    return train, test


def imagefolder_splits(root: str | os.PathLike | None, transform
                       ) -> tuple[ClassificationSet, ClassificationSet]:
    if root is None:
        raise EvalError("--task linear_probe --dataset imagefolder needs --data-root DIR "
                        "holding DIR/train/<class>/ and DIR/test/<class>/")
    root = Path(root)
    if not (root / "train").is_dir() or not (root / "test").is_dir():
        raise EvalError(f"linear probe on image folder {root}: expected {root}/train/<class>/ "
                        f"and {root}/test/<class>/ (the same class sub-folders)")
    train = image_folder_set(root / "train", transform)
    test = image_folder_set(root / "test", transform)
    if train.classnames != test.classnames:
        raise EvalError(f"{root}/train and {root}/test have different class sub-folders "
                        f"({len(train.classnames)} and {len(test.classnames)} classes)")
    return train, test


def _train_dataset(name: str, root: Path, transform) -> Dataset:
    """torchvision's (or the original split's) training part of a paper set."""
    import torchvision.datasets as tvd

    layout = TRAIN_LAYOUTS[name].format(root=root)
    if name == "cifar10":
        _require(name, root, [root / "cifar-10-batches-py" / "data_batch_1"], layout)
        return _tv(name, root, lambda: tvd.CIFAR10(str(root), train=True, transform=transform))
    if name == "cifar100":
        _require(name, root, [root / "cifar-100-python" / "train"], layout)
        return _tv(name, root, lambda: tvd.CIFAR100(str(root), train=True, transform=transform))
    if name == "food101":
        _require(name, root, [root / "food-101" / "meta" / "train.json"], layout)
        return _tv(name, root, lambda: tvd.Food101(str(root), split="train", transform=transform))
    if name == "pets":
        _require(name, root, [root / "oxford-iiit-pet" / "annotations" / "trainval.txt"], layout)
        return _tv(name, root, lambda: tvd.OxfordIIITPet(str(root), split="trainval",
                                                         transform=transform))
    if name == "flowers":
        return ConcatDataset([
            _tv(name, root, functools.partial(tvd.Flowers102, str(root), split=s,
                                              transform=transform)) for s in ("train", "val")])
    if name == "stanford_car":
        return _tv(name, root, lambda: tvd.StanfordCars(str(root), split="train",
                                                        transform=transform))
    if name == "dtd":
        return ConcatDataset([
            _tv(name, root, functools.partial(tvd.DTD, str(root), split=s, partition=1,
                                              transform=transform)) for s in ("train", "val")])
    if name == "aircraft":
        return _tv(name, root, lambda: tvd.FGVCAircraft(str(root), split="trainval",
                                                        annotation_level="variant",
                                                        transform=transform))
    if name == "caltech101":
        _require(name, root, [root / "caltech101" / "101_ObjectCategories"], layout)
        full = Caltech101Images(root, transform)
        if len(full) != 3000 + 5677:
            raise _missing(name, root, layout, f"(found {len(full)} images, expected 8677)")
        train_idx, _ = random_split_indices(len(full), [3000, 5677], ORIGINAL_SEED)
        return _Subset(full, train_idx)
    if name == "sun397":
        _require(name, root, [root / "SUN397" / "ClassName.txt"], layout)
        sun = SUN397Images(root, transform)
        n = len(sun)
        train_idx, _, _ = random_split_indices(n, [19850, 19850, n - 2 * 19850], SUN397_SEED)
        return _Subset(sun, train_idx)
    if name == "imagenet":
        from .datasets import ImageListDataset, scan_image_folder

        folder = next((p for p in (root / "imagenet" / "train", root / "train") if p.is_dir()),
                      None)
        rec = next((p for p in (root / "imagenet" / "train.rec", root / "train.rec")
                    if p.is_file()), None)
        if folder is not None:
            return ImageListDataset(scan_image_folder(folder)[1], transform)
        if rec is not None:
            return RecordImageSet(str(rec), transform, num_classes=1000)
        raise _missing(name, root, layout)
    raise EvalError(f"no training split known for {name!r}")  # pragma: no cover


def probe_splits(name: str, data_root, transform, templates_file=None, builtin=None
                 ) -> tuple[ClassificationSet, ClassificationSet]:
    """(train set, test set) of ``name``: builtin, imagefolder or a paper set."""
    name = canonical_name(name)
    if name == "builtin":
        return builtin_splits(transform, builtin)
    if name == "imagefolder":
        return imagefolder_splits(data_root, transform)
    if name not in PAPER_DATASETS:
        raise EvalError(f"--task linear_probe: unknown dataset {name!r}; choose from builtin, "
                        f"imagefolder, {', '.join(PAPER_DATASETS)}")
    test = build_classification_set(name, data_root, transform, templates_file=templates_file)
    train_ds = _train_dataset(name, Path(data_root), transform)
    return ClassificationSet(name, train_ds, test.classnames, test.templates), test
