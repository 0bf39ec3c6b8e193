"""Retrieval annotation formats (JSONL, the original's Karpathy test lists, Karpathy's
dataset_*.json), image lookup, caption prefixes and precision handling."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from rwkv_clip.errors import DatasetNotFoundError, EvalError
from rwkv_clip.eval.retrieval import (
    ORIGINAL_CAPTION_PREFIX,
    build_retrieval_set,
    load_retrieval_file,
)


def _img(path, v=100):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), v, np.uint8)).save(path)


def test_jsonl_relative_to_file_and_root(tmp_path):
    _img(tmp_path / "imgs" / "a.jpg")
    _img(tmp_path / "imgs" / "b.jpg")
    f = tmp_path / "pairs.jsonl"
    f.write_text(json.dumps({"image": "imgs/a.jpg", "captions": ["one", "two"]}) + "\n\n"
                 + json.dumps({"image": "imgs/b.jpg", "caption": "three"}) + "\n")
    s = load_retrieval_file(f)
    assert s.captions == ["one", "two", "three"] and s.text_to_image == [0, 0, 1]
    assert s.image_paths == [str(tmp_path / "imgs" / "a.jpg"), str(tmp_path / "imgs" / "b.jpg")]
    s2 = build_retrieval_set("jsonl", data_root=tmp_path / "imgs", retrieval_file=f)
    assert s2.image_paths == s.image_paths  # found by file name under the root, like the original
    assert s2.captions == s.captions  # no prefix for JSONL by default


def test_jsonl_bad_records(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"image": "a.jpg", "captions": []}\n')
    with pytest.raises(EvalError, match="non-empty list"):
        load_retrieval_file(f)
    f.write_text('{"image": "a.jpg", "captions": ["x"]\n')
    with pytest.raises(EvalError, match="x.jsonl:1: not valid JSON"):
        load_retrieval_file(f)
    with pytest.raises(DatasetNotFoundError):
        load_retrieval_file(tmp_path / "missing.jsonl")


def test_original_karpathy_list_for_coco(tmp_path):
    _img(tmp_path / "val2014" / "COCO_val2014_1.jpg")
    _img(tmp_path / "val2014" / "COCO_val2014_2.jpg")
    (tmp_path / "coco_karpathy_test.json").write_text(json.dumps([
        {"image": "val2014/COCO_val2014_1.jpg", "caption": ["a dog.", "a brown dog."]},
        {"image": "val2014/COCO_val2014_2.jpg", "caption": ["a cat."]}]))
    s = build_retrieval_set("coco", tmp_path)
    assert s.name == "mscoco" and s.num_images == 2
    assert s.captions == [ORIGINAL_CAPTION_PREFIX + c for c in ("a dog.", "a brown dog.", "a cat.")]
    assert s.text_to_image == [0, 0, 1]
    assert build_retrieval_set("mscoco", tmp_path, caption_prefix="").captions[0] == "a dog."


def test_karpathy_dataset_json_for_flickr_uses_test_split(tmp_path):
    _img(tmp_path / "flickr30k-images" / "1.jpg")
    _img(tmp_path / "flickr30k-images" / "2.jpg")
    (tmp_path / "dataset_flickr30k.json").write_text(json.dumps({"images": [
        {"filename": "1.jpg", "split": "test", "sentences": [{"raw": "x"}, {"raw": "y"}]},
        {"filename": "9.jpg", "split": "train", "sentences": [{"raw": "z"}]},
        {"filename": "2.jpg", "split": "test", "sentences": [{"raw": "w"}]}]}))
    s = build_retrieval_set("flickr", tmp_path)
    assert s.name == "flickr30k" and s.num_images == 2
    assert [c[len(ORIGINAL_CAPTION_PREFIX):] for c in s.captions] == ["x", "y", "w"]
    assert s.image_paths[1].endswith("flickr30k-images/2.jpg")


def test_missing_retrieval_set_shows_layout(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="flickr30k-images"):
        build_retrieval_set("flickr30k", tmp_path)
    with pytest.raises(EvalError, match="unknown retrieval"):
        build_retrieval_set("vqa", tmp_path)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_retrieval_eval_precisions(tmp_path, precision):
    from rwkv_clip import create_RWKV_Model, image_transform, load_model_configs
    from rwkv_clip.eval.retrieval import evaluate_retrieval

    for i in range(3):
        _img(tmp_path / f"{i}.png", 60 * i)
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"image": f"{i}.png", "captions": [f"shade {i}"]}) + "\n"
                         for i in range(3)))
    torch.manual_seed(0)
    model = create_RWKV_Model(load_model_configs("RWKV_CLIP_tiny")).eval()
    m = evaluate_retrieval(model, load_retrieval_file(f), image_transform(16, is_train=False), "cpu",
                           batch_size=2, precision=precision)
    assert m["num_images"] == 3 and m["num_texts"] == 3
    for k in (1, 5, 10):
        assert 0.0 <= m[f"text_retrieval_recall@{k}"] <= 1.0
    assert m["text_retrieval_recall@5"] == 1.0 and m["image_retrieval_recall@5"] == 1.0


def test_make_rec_pairs_file_is_a_retrieval_file(tmp_path):
    """make_rec's own input (image + raw, one line per caption) evaluates as is: lines of
    the same image are one image with all its captions."""
    _img(tmp_path / "a.jpg")
    _img(tmp_path / "b.jpg", 30)
    rows = [{"image": "a.jpg", "raw": "one", "synthetic": "not a reference"},
            {"image": "b.jpg", "raw": "two"}, {"image": "a.jpg", "raw": "three"}]
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = load_retrieval_file(f)
    assert s.image_paths == [str(tmp_path / "a.jpg"), str(tmp_path / "b.jpg")]
    assert s.captions == ["one", "three", "two"] and s.text_to_image == [0, 0, 1]
