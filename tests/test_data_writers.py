import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from rwkv_clip.data import DataError, RecordIOReader, convert, encode_captions
from rwkv_clip.data.tokens import decode_tokens, normalize_labels
from rwkv_clip.data.writers import write_rec, write_wds

from test_data_common import colour_of, solid_image, write_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_encode_captions_layout_and_missing_variants():
    t = encode_captions("a dog", None, "a cute dog")
    assert t.shape == (231,) and t.dtype == np.int64
    assert list(t[:77]) == list(t[77:154])          # missing synthetic repeats raw
    assert list(t[154:]) != list(t[:77])
    assert t[0] == 49406 and decode_tokens(t) == ["a dog", "a dog", "a cute dog"]


def test_normalize_labels_154_and_bad_counts():
    t = encode_captions("a", "b", "c")
    two = t[:154].astype(np.float32)
    out = normalize_labels(two)
    assert list(out[154:]) == list(out[77:154]) and list(out[:154]) == list(t[:154])
    with pytest.raises(DataError, match="100 labels"):
        normalize_labels(np.zeros(100), "f.rec", 5)
    with pytest.raises(DataError, match="integral"):
        normalize_labels(np.full(231, 0.5))


def _pairs_folder(tmp_path):
    d = tmp_path / "imgs"
    d.mkdir()
    (d / "a.jpg").write_bytes(solid_image(0, 80, 60))
    (d / "b.png").write_bytes(solid_image(1, 50, 90, fmt="PNG"))
    (d / "c.jpg").write_bytes(b"\xff\xd8not really a jpeg")
    rows = [
        {"image": "imgs/a.jpg", "raw": "first", "synthetic": "first syn", "generated": "first gen"},
        {"image": "imgs/b.png", "raw": "second"},
        {"image": "imgs/c.jpg", "raw": "broken"},
        {"image": "imgs/missing.jpg", "raw": "gone"},
        {"image": "imgs/a.jpg", "raw": ""},
    ]
    return rows


def test_jsonl_to_rec_with_skips(tmp_path):
    rows = _pairs_folder(tmp_path)
    src = write_jsonl(tmp_path / "pairs.jsonl", rows)
    s = convert(str(src), str(tmp_path / "out" / "train"), progress=False)
    assert s["written"] == 2 and s["skipped"] == 3
    assert s["reasons"] == {"skipped: undecodable image (UnidentifiedImageError)": 1,
                            "skipped: image file not found": 1, "skipped: missing caption": 1}
    r = RecordIOReader(str(tmp_path / "out" / "train"))
    assert r.keys == [0, 1]
    _, h, lab, img = r.read_item(0)
    assert h.flag == 231
    np.testing.assert_array_equal(lab.astype(np.int64),
                                  encode_captions("first", "first syn", "first gen"))
    assert img == solid_image(0, 80, 60)          # JPEG copied byte for byte
    _, _, lab, img = r.read_item(1)
    assert decode_tokens(lab) == ["second"] * 3
    im = Image.open(io.BytesIO(img))
    assert im.format == "JPEG" and im.size == (50, 90)   # PNG re-encoded as JPEG
    assert np.abs(np.asarray(im).reshape(-1, 3).mean(0) - colour_of(1)).max() < 3


def test_csv_with_resize(tmp_path):
    _pairs_folder(tmp_path)
    with open(tmp_path / "p.csv", "w") as f:
        f.write("image,raw,synthetic\nimgs/a.jpg,hello,\"hi, there\"\n")
    s = convert(str(tmp_path / "p.csv"), str(tmp_path / "o"), resize=30, progress=False)
    assert s["written"] == 1
    _, _, lab, img = RecordIOReader(str(tmp_path / "o")).read_item(0)
    assert Image.open(io.BytesIO(img)).size == (40, 30)
    np.testing.assert_array_equal(lab.astype(np.int64), encode_captions("hello", "hi, there"))


def _img2dataset_folder(tmp_path, n=5):
    d = tmp_path / "i2d"
    d.mkdir()
    with tarfile.open(d / "00000.tar", "w") as tf:
        for i in range(n):
            key = f"{i:09d}"
            items = {key + ".jpg": solid_image(i), key + ".txt": f"caption {i}".encode()}
            if i == 1:
                items[key + ".json"] = json.dumps({"caption": "ignored", "status": "success",
                                                   "synthetic": "syn one"}).encode()
            for name, data in items.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("000000099.txt")   # caption without image
        info.size = 3
        tf.addfile(info, io.BytesIO(b"abc"))
    return d


def test_img2dataset_to_rec_and_wds(tmp_path):
    d = _img2dataset_folder(tmp_path)
    s = convert(str(d), str(tmp_path / "r"), progress=False)
    assert s["written"] == 5 and s["reasons"] == {"skipped: no image file": 1}
    r = RecordIOReader(str(tmp_path / "r"))
    caps = [decode_tokens(r.read_item(i)[2]) for i in range(5)]
    assert caps[0] == ["caption 0"] * 3
    assert caps[1] == ["caption 1", "syn one", "caption 1"]
    s = convert(str(d), str(tmp_path / "w" / "shard"), fmt="wds", shard_size=2, progress=False)
    assert s["written"] == 5 and len(s["outputs"]) == 3
    with tarfile.open(s["outputs"][0]) as tf:
        names = tf.getnames()
        assert names[:4] == ["000000000.jpg", "000000000.tok", "000000000.txt", "000000000.json"]
        tok = np.frombuffer(tf.extractfile("000000001.tok").read(), dtype="<i4")
        np.testing.assert_array_equal(tok, encode_captions("caption 1", "syn one"))


def test_write_empty_input_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no usable samples"):
        write_rec([{"name": "x", "error": "bad"}], str(tmp_path / "e"))
    assert not os.path.exists(tmp_path / "e.rec")
    with pytest.raises(DataError, match="no usable samples"):
        write_wds([], str(tmp_path / "w"))


def test_make_rec_cli(tmp_path):
    rows = _pairs_folder(tmp_path)
    src = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "make_rec.py"), str(src),
                          str(tmp_path / "cli"), "--no-progress"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert "written: 2  skipped: 3" in out.stdout
    assert "image file not found" in out.stdout
    assert len(RecordIOReader(str(tmp_path / "cli"))) == 2
    bad = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "make_rec.py"),
                          str(tmp_path / "nope.jsonl"), str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "input file not found" in bad.stderr
