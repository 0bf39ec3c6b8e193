"""The evaluation sets, read from the usual on-disk layouts under ``--data-root``.

Nothing is downloaded: a missing set shows the layout we look for. Class names, templates
and splits are the original's (``rwkv_clip/eval/data``); the one deviation is at
:data:`SUN397_SEED`.
"""
from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from ..errors import DataError, DatasetNotFoundError, EvalError
from ..text_files import read_text

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
UTF8_HINT = "save the file as UTF-8"  # templates and class names have no --encoding
ORIGINAL_SEED = 3072  # the original zero_shot.py passes seed=3072 to every loader
# The original seeded SUN397's random_split with 3072 + hash("sun397") % 2048, which
# changes with every Python process (salted string hashing); crc32 over a sorted file
# list gives the same 19850/19850 split on every run and machine.
SUN397_SEED = ORIGINAL_SEED + zlib.crc32(b"sun397") % 2048

# The 11 classification sets of the paper, in the order of its table.
PAPER_DATASETS = ("cifar10", "cifar100", "food101", "pets", "flowers", "sun397",
                  "stanford_car", "dtd", "caltech101", "aircraft", "imagenet")
ALIASES = {
    "oxford_pets": "pets", "pets37": "pets", "flowers102": "flowers", "fgvc_aircraft": "aircraft",
    "stanford_cars": "stanford_car", "cars": "stanford_car", "imagenet1k": "imagenet",
    "sun": "sun397", "caltech": "caltech101",
}


# ------------------------------------------------------------------ shipped data
def _data_json(name: str) -> Any:
    return json.loads(resources.files("rwkv_clip.eval").joinpath("data", name).read_text("utf-8"))


def default_classnames(dataset: str) -> list[str]:
    """The original's class names for one of the 11 sets."""
    return list(_data_json("classnames.json")[dataset])


def default_templates(dataset: str = "imagenet") -> list[str]:
    """The original's prompt templates for a set (``imagenet``: CLIP's 80 templates,
    also the default for custom image folders)."""
    return list(_data_json("templates.json")[dataset])


def load_templates(path: str | os.PathLike, dataset: str | None = None) -> list[str]:
    """Templates from a file: a JSON list, a JSON object keyed by dataset name (the
    original's template.json), or plain text with one template per line. Each template
    holds ``{}`` (or ``{c}``) where the class name goes."""
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"templates file {path} does not exist")
    text = read_text(path, hint=UTF8_HINT)
    templates: Any
    if path.suffix.lower() == ".json":
        try:
            templates = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EvalError(f"templates file {path}: not valid JSON ({exc})") from None
        if isinstance(templates, dict):
            if dataset not in templates:
                raise EvalError(f"templates file {path} has no entry for {dataset!r} "
                                f"(keys: {sorted(templates)[:10]})")
            templates = templates[dataset]
    else:
        templates = [line.strip() for line in text.splitlines() if line.strip()]
    if not isinstance(templates, list) or not templates or not all(isinstance(t, str) for t in templates):
        raise EvalError(f"templates file {path}: expected a non-empty list of strings")
    bad = [t for t in templates if "{}" not in t and "{c}" not in t]
    if bad:
        raise EvalError(f"templates file {path}: template {bad[0]!r} has no '{{}}' placeholder")
    return templates


def fill_template(template: str, classname: str) -> str:
    if "{c}" in template:
        return template.replace("{c}", classname)
    return template.replace("{}", classname)


# ------------------------------------------------------------------ eval set record
@dataclass
class ClassificationSet:
    """A classification test set: ``dataset[i] -> (PIL image or tensor, label)``."""
    name: str
    dataset: Any  # a map-style dataset with len()
    classnames: list[str]
    templates: list[str]
    describe: Callable[[int], str] = field(default=lambda i: f"sample {i}")

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def num_classes(self) -> int:
        return len(self.classnames)


def _missing(name: str, root: Path, layout: str, extra: str = "") -> DatasetNotFoundError:
    msg = (f"dataset {name!r} not found under --data-root {root}. Expected layout:\n"
           + "\n".join("    " + line for line in layout.strip().splitlines()))
    if extra:
        msg += "\n" + extra
    return DatasetNotFoundError(msg)


def _require(name: str, root: Path, paths: Sequence[Path], layout: str) -> None:
    absent = [p for p in paths if not p.exists()]
    if absent:
        raise _missing(name, root, layout, f"(missing: {absent[0]})")


def _need_scipy(name: str) -> None:
    try:
        import scipy.io  # noqa: F401
    except ImportError:
        raise EvalError(f"dataset {name!r} stores its labels in .mat files, which need scipy: "
                        "pip install scipy") from None


# ------------------------------------------------------------------ simple readers
class ImageListDataset(Dataset):
    """(path, label) pairs -> (transformed RGB image, label)."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform=None):
        self.samples = list(samples)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with Image.open(path) as opened:
            img = opened.convert("RGB")
        if self.transform is not None:
            img = self.transform(img)
        return img, label


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def scan_image_folder(folder: str | os.PathLike) -> tuple[list[str], list[tuple[str, int]]]:
    """Sorted class sub-folders and their image files (torchvision ImageFolder order).
    Raises for a missing folder, no class folders, or an empty class folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetNotFoundError(f"image folder {folder} does not exist (expected "
                                   "<folder>/<class name>/<image files>)")
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise EvalError(f"image folder {folder} has no class sub-folders (expected "
                        "<folder>/<class name>/<image files>)")
    samples: list[tuple[str, int]] = []
    empty = []
    for label, cls in enumerate(classes):
        files = sorted(str(p) for p in (folder / cls).rglob("*") if p.is_file() and _is_image(p.name))
        if not files:
            empty.append(cls)
        samples.extend((f, label) for f in files)
    if empty:
        raise EvalError(f"image folder {folder}: class folder(s) without images: "
                        f"{', '.join(empty[:10])}{' ...' if len(empty) > 10 else ''} "
                        f"(image extensions: {', '.join(IMAGE_EXTENSIONS)})")
    return classes, samples


def read_classnames_file(path: Path, folders: list[str]) -> list[str]:
    """``classnames.json``: a list aligned with the sorted class folders, or an object
    mapping folder name -> class name."""
    try:
        data = json.loads(read_text(path, hint=UTF8_HINT))
    except json.JSONDecodeError as exc:
        raise EvalError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict):
        missing = [f for f in folders if f not in data]
        if missing:
            raise EvalError(f"{path} has no class name for folder(s) {missing[:5]}")
        return [str(data[f]) for f in folders]
    if isinstance(data, list) and all(isinstance(c, str) for c in data):
        if len(data) != len(folders):
            raise EvalError(f"{path} lists {len(data)} class names but the folder has "
                            f"{len(folders)} class sub-folders")
        return list(data)
    raise EvalError(f"{path}: expected a list of class names or a folder->name object")


def image_folder_set(folder: str | os.PathLike, transform=None, name: str = "imagefolder",
                     classnames: Sequence[str] | None = None,
                     templates: Sequence[str] | None = None,
                     templates_file: str | os.PathLike | None = None) -> ClassificationSet:
    """Any image folder as a classification set. Class names: ``classnames`` argument,
    else ``<folder>/classnames.json``, else the folder names (``_`` -> space).
    Templates: ``templates``, else ``templates_file``, else ``<folder>/templates.json``,
    else CLIP's 80 ImageNet templates."""
    folder = Path(folder)
    folders, samples = scan_image_folder(folder)
    if classnames is not None:
        if len(classnames) != len(folders):
            raise EvalError(f"{len(classnames)} class names given but {folder} has "
                            f"{len(folders)} class sub-folders")
        names = list(classnames)
    elif (folder / "classnames.json").is_file():
        names = read_classnames_file(folder / "classnames.json", folders)
    else:
        names = [f.replace("_", " ") for f in folders]
    if templates is not None:
        tpl = list(templates)
    elif templates_file is not None:
        tpl = load_templates(templates_file, name)
    elif (folder / "templates.json").is_file():
        tpl = load_templates(folder / "templates.json", name)
    else:
        tpl = default_templates("imagenet")
    ds = ImageListDataset(samples, transform)
    return ClassificationSet(name, ds, names, tpl, describe=lambda i: samples[i][0])


class Caltech101Images(Dataset):
    """Caltech101 in torchvision's sample order (sorted categories without
    BACKGROUND_Google, ``image_0001.jpg`` ... per category) without needing scipy."""

    def __init__(self, root: Path, transform=None):
        base = root / "caltech101" / "101_ObjectCategories"
        cats = sorted(os.listdir(base))
        if "BACKGROUND_Google" in cats:
            cats.remove("BACKGROUND_Google")
        self.samples: list[tuple[str, int]] = []
        for label, cat in enumerate(cats):
            n = len(os.listdir(base / cat))
            self.samples.extend((str(base / cat / f"image_{i:04d}.jpg"), label) for i in range(1, n + 1))
        self.categories = cats
        self.reader = ImageListDataset(self.samples, transform)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.reader[index]


class SUN397Images(Dataset):
    """SUN397 as torchvision reads it (``ClassName.txt``, ``sun_*.jpg``), in sorted order."""

    def __init__(self, root: Path, transform=None):
        data_dir = root / "SUN397"
        with open(data_dir / "ClassName.txt") as f:
            classes = [line[3:].strip() for line in f if line.strip()]
        to_idx = {c: i for i, c in enumerate(classes)}
        files = sorted(data_dir.rglob("sun_*.jpg"))
        self.samples = [(str(p), to_idx["/".join(p.relative_to(data_dir).parts[1:-1])]) for p in files]
        self.classes = classes
        self.reader = ImageListDataset(self.samples, transform)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.reader[index]


class RecordImageSet(Dataset):
    """Images and class indices from an MXNet RecordIO pair (``val.rec`` + ``val.idx``),
    read as the original's DALI ``readers.mxnet`` does: in index order, label = the
    record header's label (or the first entry of its label vector). Decoding, label and
    layout problems raise :class:`~rwkv_clip.errors.DataError` naming file and record,
    as for training data."""

    def __init__(self, rec_path: str, transform=None, num_classes: int | None = None):
        from ..data.recordio import RecordIOReader

        self.reader = RecordIOReader(rec_path)  # checks .rec/.idx presence and the index
        self.transform = transform
        self.num_classes = num_classes

    def __len__(self) -> int:
        return len(self.reader)

    def describe(self, index: int) -> str:
        return f"{self.reader.rec_path} record {self.reader.keys[index]}"

    def label(self, header, labels, key) -> int:
        value = float(header.label if labels is None else labels[0])
        if not value.is_integer() or value < 0 or (self.num_classes is not None
                                                   and value >= self.num_classes):
            expected = f"0..{self.num_classes - 1}" if self.num_classes else ">= 0"
            raise DataError(f"label {value} is not a class index ({expected})",
                            self.reader.rec_path, key)
        return int(value)

    def __getitem__(self, index: int):
        import io

        key, header, labels, data = self.reader.read_item(index)
        target = self.label(header, labels, key)
        try:
            with Image.open(io.BytesIO(data)) as opened:
                img = opened.convert("RGB")
        except Exception as exc:
            raise DataError(f"undecodable image ({type(exc).__name__}: {exc})",
                            self.reader.rec_path, key) from None
        if self.transform is not None:
            img = self.transform(img)
        return img, target


def random_split_indices(n: int, lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Index lists of ``torch.utils.data.random_split(range(n), lengths, generator seeded
    with seed)`` (identical permutation, so identical subsets)."""
    if sum(lengths) != n:
        raise ValueError(f"split lengths {list(lengths)} do not sum to {n}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    out, start = [], 0
    for length in lengths:
        out.append(perm[start:start + length])
        start += length
    return out


class _Subset(Dataset):
    def __init__(self, base, indices):
        self.base, self.indices = base, list(indices)

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return self.base[self.indices[i]]


def _samples_describer(ds) -> Callable[[int], str]:
    files = getattr(ds, "_image_files", None) or getattr(ds, "samples", None)
    if files is None:
        return lambda i: f"sample {i}"

    def describe(i: int) -> str:
        item = files[i]
        return str(item[0] if isinstance(item, tuple) else item)
    return describe


# ------------------------------------------------------------------ the 11 sets
LAYOUTS = {
    "cifar10": (
        "{root}/cifar-10-batches-py/{{data_batch_1..5, test_batch, batches.meta}}"
        "   (torchvision CIFAR10)"),
    "cifar100": "{root}/cifar-100-python/{{train, test, meta}}   (torchvision CIFAR100)",
    "food101": (
        "{root}/food-101/images/<class>/*.jpg\n"
        "{root}/food-101/meta/{{classes.txt, test.json}}   (torchvision Food101)"),
    "pets": (
        "{root}/oxford-iiit-pet/images/*.jpg\n"
        "{root}/oxford-iiit-pet/annotations/test.txt   (torchvision OxfordIIITPet)"),
    "flowers": (
        "{root}/flowers-102/jpg/image_*.jpg\n"
        "{root}/flowers-102/{{imagelabels.mat, setid.mat}}"
        "   (torchvision Flowers102; needs scipy)"),
    "sun397": (
        "{root}/SUN397/ClassName.txt\n"
        "{root}/SUN397/<letter>/<class>/sun_*.jpg   (torchvision SUN397)"),
    "stanford_car": (
        "{root}/stanford_cars/devkit/cars_meta.mat\n"
        "{root}/stanford_cars/cars_test_annos_withlabels.mat\n"
        "{root}/stanford_cars/cars_test/*.jpg   (torchvision StanfordCars; needs scipy)"),
    "dtd": (
        "{root}/dtd/dtd/images/<class>/*.jpg\n"
        "{root}/dtd/dtd/labels/test1.txt   (torchvision DTD, partition 1)"),
    "caltech101": (
        "{root}/caltech101/101_ObjectCategories/<category>/image_0001.jpg ..."
        "   (torchvision Caltech101)"),
    "aircraft": (
        "{root}/fgvc-aircraft-2013b/data/{{images/, images_variant_test.txt, variants.txt}}"
        "   (torchvision FGVCAircraft)"),
    "imagenet": (
        "{root}/imagenet/val/<wnid>/*.JPEG   (1000 class folders, sorted wnid order)\n"
        "  or {root}/val/<wnid>/*.JPEG\n"
        "  or {root}/imagenet/val.rec + val.idx"
        "   (the original's MXNet RecordIO; label = class index)\n"
        "  or {root}/val.rec + val.idx"),
}


def expected_layout(name: str, root: str | os.PathLike = "<data-root>") -> str:
    return LAYOUTS[name].format(root=root)


def canonical_name(name: str) -> str:
    name = name.strip().lower()
    return ALIASES.get(name, name)


def _tv(name: str, root: Path, build: Callable[[], Dataset]) -> Dataset:
    try:
        return build()
    except (RuntimeError, FileNotFoundError) as exc:
        raise _missing(name, root, expected_layout(name, root), f"(torchvision: {exc})") from None


def build_classification_set(name: str, data_root: str | os.PathLike, transform=None,
                             templates: Sequence[str] | None = None,
                             templates_file: str | os.PathLike | None = None,
                             caltech101_split: str = "original") -> ClassificationSet:
    """One of the 11 paper sets (``PAPER_DATASETS`` or an alias) or ``imagefolder``
    (then ``data_root`` is the folder itself)."""
    import torchvision.datasets as tvd

    name = canonical_name(name)
    root = Path(data_root) if data_root is not None else None
    if name == "imagefolder":
        if root is None:
            raise EvalError("--dataset imagefolder needs --data-root pointing at the image folder")
        return image_folder_set(root, transform, templates=templates, templates_file=templates_file)
    if name not in PAPER_DATASETS:
        raise EvalError(f"unknown dataset {name!r}: choose from {', '.join(PAPER_DATASETS)}, "
                        "imagefolder (or builtin)")
    if root is None:
        raise EvalError(f"dataset {name!r} needs --data-root. Expected layout:\n    "
                        + expected_layout(name).replace("\n", "\n    "))
    layout = expected_layout(name, root)
    describe = None
    if name == "cifar10":
        _require(name, root, [root / "cifar-10-batches-py" / "test_batch"], layout)
        ds = _tv(name, root, lambda: tvd.CIFAR10(str(root), train=False, download=False, transform=transform))
        describe = lambda i: f"test_batch image {i}"
    elif name == "cifar100":
        _require(name, root, [root / "cifar-100-python" / "test"], layout)
        ds = _tv(name, root, lambda: tvd.CIFAR100(str(root), train=False, download=False, transform=transform))
        describe = lambda i: f"cifar-100 test image {i}"
    elif name == "food101":
        _require(name, root, [root / "food-101" / "meta" / "test.json", root / "food-101" / "images"], layout)
        ds = _tv(name, root, lambda: tvd.Food101(str(root), split="test", download=False, transform=transform))
    elif name == "pets":
        _require(name, root, [root / "oxford-iiit-pet" / "annotations" / "test.txt",
                              root / "oxford-iiit-pet" / "images"], layout)
        ds = _tv(name, root, lambda: tvd.OxfordIIITPet(str(root), split="test", download=False,
                                                       transform=transform))
    elif name == "flowers":
        _require(name, root, [root / "flowers-102" / "jpg", root / "flowers-102" / "setid.mat"], layout)
        _need_scipy(name)
        ds = _tv(name, root, lambda: tvd.Flowers102(str(root), split="test", download=False,
                                                    transform=transform))
    elif name == "stanford_car":
        _require(name, root, [root / "stanford_cars" / "devkit",
                              root / "stanford_cars" / "cars_test_annos_withlabels.mat",
                              root / "stanford_cars" / "cars_test"], layout)
        _need_scipy(name)
        ds = _tv(name, root, lambda: tvd.StanfordCars(str(root), split="test", download=False,
                                                      transform=transform))
    elif name == "dtd":
        _require(name, root, [root / "dtd" / "dtd" / "labels" / "test1.txt"], layout)
        ds = _tv(name, root, lambda: tvd.DTD(str(root), split="test", partition=1, download=False,
                                             transform=transform))
    elif name == "aircraft":
        _require(name, root, [root / "fgvc-aircraft-2013b" / "data" / "images_variant_test.txt"], layout)
        ds = _tv(name, root, lambda: tvd.FGVCAircraft(str(root), split="test", annotation_level="variant",
                                                      download=False, transform=transform))
    elif name == "caltech101":
        _require(name, root, [root / "caltech101" / "101_ObjectCategories"], layout)
        full: Any = Caltech101Images(root, transform)
        if len(full.categories) != 101:
            raise _missing(name, root, layout, f"(found {len(full.categories)} categories, expected 101)")
        if caltech101_split == "all":
            ds = full
        elif caltech101_split == "original":
            if len(full) != 3000 + 5677:
                raise _missing(name, root, layout, f"(found {len(full)} images; the original split "
                               "3000/5677 needs all 8677; use caltech101_split='all' otherwise)")
            _, test_idx = random_split_indices(len(full), [3000, 5677], ORIGINAL_SEED)
            ds = _Subset(full, test_idx)
            describe = lambda i: full.samples[test_idx[i]][0]
        else:
            raise EvalError(f"caltech101 split must be 'original' or 'all', got {caltech101_split!r}")
        if describe is None:
            describe = lambda i: full.samples[i][0]
    elif name == "sun397":
        _require(name, root, [root / "SUN397" / "ClassName.txt"], layout)
        full = SUN397Images(root, transform)
        n = len(full)
        if n < 2 * 19850:
            raise _missing(name, root, layout, f"(found {n} images; the split takes 19850 train + "
                           "19850 test from the 108754 of SUN397)")
        _, test_idx, _ = random_split_indices(n, [19850, 19850, n - 2 * 19850], SUN397_SEED)
        ds = _Subset(full, test_idx)
        describe = lambda i: full.samples[test_idx[i]][0]
    elif name == "imagenet":
        folder = next((p for p in (root / "imagenet" / "val", root / "val") if p.is_dir()), None)
        rec = next((p for p in (root / "imagenet" / "val.rec", root / "val.rec") if p.is_file()),
                   None)
        if folder is not None:
            classes, samples = scan_image_folder(folder)
            if len(classes) != 1000:
                raise _missing(name, root, layout, f"(found {len(classes)} class folders in "
                               f"{folder}, expected 1000)")
            ds = ImageListDataset(samples, transform)
            describe = lambda i: samples[i][0]
        elif rec is not None:
            ds = RecordImageSet(str(rec), transform, num_classes=1000)
            describe = ds.describe
        else:
            raise _missing(name, root, layout)
    else:  # pragma: no cover - PAPER_DATASETS is exhaustive
        raise EvalError(name)
    classnames = default_classnames(name)
    if templates is not None:
        tpl = list(templates)
    elif templates_file is not None:
        tpl = load_templates(templates_file, name)
    else:
        tpl = default_templates(name)
    return ClassificationSet(name, ds, classnames, tpl, describe=describe or _samples_describer(ds))
