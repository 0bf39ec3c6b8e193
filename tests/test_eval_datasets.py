"""Evaluation sets: shipped class names/templates, on-disk layouts, splits, image folders."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rwkv_clip.eval import datasets as D

REPO = Path(__file__).resolve().parents[1]
ORIGINAL_COUNTS = {"cifar10": 10, "cifar100": 100, "food101": 101, "pets": 37, "flowers": 102,
                   "sun397": 397, "stanford_car": 196, "dtd": 47, "caltech101": 101,
                   "aircraft": 100, "imagenet": 1000}
ORIGINAL_TEMPLATE_COUNTS = {"cifar10": 18, "cifar100": 18, "food101": 1, "pets": 1, "flowers": 1,
                            "sun397": 2, "stanford_car": 8, "dtd": 8, "caltech101": 34,
                            "aircraft": 2, "imagenet": 80}


LAYOUT_DIRS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python",
               "food101": "food-101", "pets": "oxford-iiit-pet", "flowers": "flowers-102",
               "sun397": "SUN397", "stanford_car": "stanford_cars", "dtd": "dtd/dtd",
               "caltech101": "caltech101/101_ObjectCategories", "aircraft": "fgvc-aircraft-2013b",
               "imagenet": "imagenet/val"}


def _png(path: Path, color, size=(20, 24)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size[1], size[0], 3), color, np.uint8)).save(path)


def test_shipped_classnames_and_templates_are_the_originals():
    assert tuple(ORIGINAL_COUNTS) == D.PAPER_DATASETS
    for name, n in ORIGINAL_COUNTS.items():
        names = D.default_classnames(name)
        assert len(names) == n, name
        # CLIP's ImageNet names repeat two of them (as in the original); the others are unique
        assert len(set(names)) == (998 if name == "imagenet" else n), name
        tpl = D.default_templates(name)
        assert len(tpl) == ORIGINAL_TEMPLATE_COUNTS[name], name
        assert all("{}" in t for t in tpl)
    assert D.default_classnames("caltech101")[:3] == ["off-center face", "centered face", "leopard"]
    assert D.default_classnames("imagenet")[0] == "tench"
    assert D.default_templates("food101") == ["a photo of {}, a type of food."]


@pytest.mark.parametrize("name", D.PAPER_DATASETS)
def test_missing_set_shows_layout_and_downloads_nothing(tmp_path, name):
    with pytest.raises(D.DatasetNotFoundError) as err:
        D.build_classification_set(name, tmp_path)
    msg = str(err.value)
    assert "Expected layout" in msg and str(tmp_path) in msg
    assert f"{tmp_path}/{LAYOUT_DIRS[name]}" in msg
    assert list(tmp_path.iterdir()) == []  # nothing created, nothing downloaded


def test_unknown_set_and_aliases(tmp_path):
    with pytest.raises(D.EvalError, match="unknown dataset"):
        D.build_classification_set("mnist_or_so", tmp_path)
    assert D.canonical_name("Flowers102") == "flowers"
    assert D.canonical_name("oxford_pets") == "pets"


def test_dtd_read_from_torchvision_layout(tmp_path):
    base = tmp_path / "dtd" / "dtd"
    lines = []
    for cls, color in (("banded", 10), ("blotchy", 200)):
        for i in range(2):
            _png(base / "images" / cls / f"{cls}_{i}.jpg", color)
            lines.append(f"{cls}/{cls}_{i}.jpg")
    (base / "labels").mkdir(parents=True)
    (base / "labels" / "test1.txt").write_text("\n".join(lines) + "\n")
    s = D.build_classification_set("dtd", tmp_path, transform=lambda im: torch.tensor(np.asarray(im)))
    assert len(s) == 4 and s.num_classes == 47
    labels = [s.dataset[i][1] for i in range(4)]
    assert labels == [0, 0, 1, 1]  # banded, blotchy: the first two of the original's names
    assert s.templates == D.default_templates("dtd")


def _fake_caltech(root: Path, counts):
    base = root / "caltech101" / "101_ObjectCategories"
    (base / "BACKGROUND_Google").mkdir(parents=True)
    (base / "BACKGROUND_Google" / "image_0001.jpg").write_bytes(b"")
    for c, n in counts.items():
        (base / c).mkdir()
        for i in range(1, n + 1):
            (base / c / f"image_{i:04d}.jpg").write_bytes(b"")


def test_caltech101_original_split(tmp_path):
    import torchvision
    # 101 categories (names sort like the real ones: Faces, Faces_easy, Leopards, ...), 8677 files
    cats = ["Faces", "Faces_easy", "Leopards", "Motorbikes"] + [f"cat{i:03d}" for i in range(97)]
    counts = {c: 85 + (i % 3) for i, c in enumerate(cats)}
    counts["cat096"] += 8677 - sum(counts.values())
    _fake_caltech(tmp_path, counts)
    s = D.build_classification_set("caltech101", tmp_path, caltech101_split="original")
    assert len(s) == 5677
    # same sample order as torchvision's Caltech101 ...
    tv = torchvision.datasets.Caltech101(str(tmp_path), download=False)
    full = D.Caltech101Images(tmp_path)
    assert [lbl for _, lbl in full.samples] == tv.y
    assert [int(p[-8:-4]) for p, _ in full.samples] == tv.index
    # ... and the same subset as the original's random_split(seed 3072)
    _, test = torch.utils.data.random_split(range(8677), [3000, 5677],
                                            generator=torch.Generator().manual_seed(3072))
    assert [s.dataset.base.samples[i] for i in s.dataset.indices] == [full.samples[i] for i in test.indices]
    assert s.describe(0) == full.samples[test.indices[0]][0]
    everything = D.build_classification_set("caltech101", tmp_path, caltech101_split="all")
    assert len(everything) == 8677


def test_caltech101_incomplete_is_a_clear_error(tmp_path):
    _fake_caltech(tmp_path, {f"c{i:03d}": 2 for i in range(101)})
    with pytest.raises(D.DatasetNotFoundError, match="8677"):
        D.build_classification_set("caltech101", tmp_path)


def test_random_split_indices_match_torch():
    for seed in (0, 3072, D.SUN397_SEED):
        parts = torch.utils.data.random_split(range(50), [10, 15, 25],
                                              generator=torch.Generator().manual_seed(seed))
        assert D.random_split_indices(50, [10, 15, 25], seed) == [p.indices for p in parts]


def test_sun397_split_seed_does_not_depend_on_hash_salt():
    code = "from rwkv_clip.eval.datasets import SUN397_SEED; print(SUN397_SEED)"
    seeds = set()
    for salt in ("1", "2", "random"):
        env = dict(os.environ, PYTHONHASHSEED=salt, PYTHONPATH=str(REPO))
        seeds.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, check=True).stdout.strip())
    assert seeds == {str(D.SUN397_SEED)}


def test_sun397_reader_sorted_and_too_small_error(tmp_path):
    base = tmp_path / "SUN397"
    base.mkdir()
    (base / "ClassName.txt").write_text("/a/abbey\n/a/airplane_cabin\n/b/bar\n")
    for rel in ("b/bar/sun_b2.jpg", "a/abbey/sun_z.jpg", "a/abbey/sun_a.jpg", "a/airplane_cabin/sun_c.jpg"):
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_bytes(b"")
    ds = D.SUN397Images(tmp_path)
    assert [(Path(p).name, lbl) for p, lbl in ds.samples] == [
        ("sun_a.jpg", 0), ("sun_z.jpg", 0), ("sun_c.jpg", 1), ("sun_b2.jpg", 2)]
    with pytest.raises(D.DatasetNotFoundError, match="19850"):
        D.build_classification_set("sun397", tmp_path)


def test_image_folder_names_classnames_and_templates(tmp_path):
    for cls, color in (("sea_lion", 10), ("zebra", 100), ("apple", 200)):
        for i in range(2):
            _png(tmp_path / cls / f"{i}.png", color)
    (tmp_path / "zebra" / "notes.txt").write_text("not an image")
    s = D.image_folder_set(tmp_path)
    assert s.classnames == ["apple", "sea lion", "zebra"]  # sorted folders, '_' -> ' '
    assert len(s) == 6 and [lbl for _, lbl in s.dataset.samples] == [0, 0, 1, 1, 2, 2]
    assert s.templates == D.default_templates("imagenet")
    (tmp_path / "classnames.json").write_text(json.dumps(["red apple", "seal", "horse"]))
    assert D.image_folder_set(tmp_path).classnames == ["red apple", "seal", "horse"]
    (tmp_path / "classnames.json").write_text(json.dumps({"apple": "A", "sea_lion": "S", "zebra": "Z"}))
    assert D.image_folder_set(tmp_path).classnames == ["A", "S", "Z"]
    (tmp_path / "classnames.json").write_text(json.dumps(["only one"]))
    with pytest.raises(D.EvalError, match="lists 1 class names"):
        D.image_folder_set(tmp_path)
    (tmp_path / "classnames.json").unlink()
    tfile = tmp_path.parent / "t.txt"
    tfile.write_text("a photo of a {}.\n\nitap of a {c}.\n")
    s = D.image_folder_set(tmp_path, templates_file=tfile)
    assert s.templates == ["a photo of a {}.", "itap of a {c}."]
    assert [D.fill_template(t, "cat") for t in s.templates] == ["a photo of a cat.", "itap of a cat."]
    (tmp_path / "templates.json").write_text(json.dumps(["{}!"]))
    assert D.image_folder_set(tmp_path).templates == ["{}!"]


def test_image_folder_bad_inputs(tmp_path):
    with pytest.raises(D.DatasetNotFoundError):
        D.image_folder_set(tmp_path / "nope")
    with pytest.raises(D.EvalError, match="no class sub-folders"):
        D.image_folder_set(tmp_path)
    _png(tmp_path / "cat" / "0.png", 5)
    (tmp_path / "dog").mkdir()
    with pytest.raises(D.EvalError, match="without images: dog"):
        D.image_folder_set(tmp_path)


def test_load_templates_formats_and_errors(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"cifar10": ["a {}."], "dtd": ["b {}."]}))
    assert D.load_templates(p, "dtd") == ["b {}."]
    with pytest.raises(D.EvalError, match="no entry"):
        D.load_templates(p, "pets")
    p.write_text(json.dumps(["no placeholder"]))
    with pytest.raises(D.EvalError, match="placeholder"):
        D.load_templates(p)
    p.write_text("{not json")
    with pytest.raises(D.EvalError, match="not valid JSON"):
        D.load_templates(p)
    with pytest.raises(D.EvalError, match="does not exist"):
        D.load_templates(tmp_path / "missing.json")
