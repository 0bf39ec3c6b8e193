import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image
from test_data_common import colour_of, solid_image, write_jsonl

from rwkv_clip.data import DataError, RecordIOReader, convert, encode_captions
from rwkv_clip.data.tokens import decode_tokens, normalize_labels
from rwkv_clip.data.writers import write_rec, write_wds

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
                            "skipped: image file not found": 1, "skipped: empty caption": 1}
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


# ----------------------------------------------------------------------------- image depth and range

def _stored_pixels(prefix):
    r = RecordIOReader(prefix)
    return [np.asarray(Image.open(io.BytesIO(r.read_item(i)[3])).convert("RGB"), np.float64)
            for i in range(len(r))]


def test_16_bit_and_float_images_keep_their_brightness(tmp_path):
    """A 16-bit greyscale PNG at 25% / 75% of full scale and float images in [0, 1] and
    [0, 255] are stored at those grey levels (clipping made them white)."""
    d = tmp_path / "imgs"
    d.mkdir()
    ramp = np.linspace(0.25, 0.75, 32)[None, :].repeat(24, 0)  # dark left, bright right
    Image.fromarray((ramp * 65535).astype(np.uint16)).save(d / "g16.png")
    assert Image.open(d / "g16.png").mode.startswith("I")
    Image.fromarray(ramp.astype(np.float32), mode="F").save(d / "f01.tif")
    Image.fromarray((ramp * 255).astype(np.float32), mode="F").save(d / "f255.tif")
    rows = [{"image": f"imgs/{n}", "raw": n} for n in ("g16.png", "f01.tif", "f255.tif")]
    src = write_jsonl(tmp_path / "p.jsonl", rows)
    s = convert(str(src), str(tmp_path / "o"), progress=False)
    assert s["written"] == 3, s
    for px in _stored_pixels(str(tmp_path / "o")):
        want = ramp * 255
        assert abs(px[..., 0].mean() - want.mean()) < 3
        assert abs(px[:, :4].mean() - want[:, :4].mean()) < 4      # dark side stays dark
        assert abs(px[:, -4:].mean() - want[:, -4:].mean()) < 4


@pytest.mark.parametrize("flag,value", [("--resize", "-5"), ("--resize", "0"),
                                        ("--shard-size", "0"), ("--shard-size", "x")])
def test_make_rec_refuses_bad_sizes(tmp_path, flag, value):
    rows = _pairs_folder(tmp_path)
    src = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "make_rec.py"), str(src),
                          str(tmp_path / "o"), flag, value, "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert flag in last and "whole number >= 1" in last, out.stderr
    assert "Traceback" not in out.stderr and not os.path.exists(tmp_path / "o.rec")
    with pytest.raises(DataError, match="whole number >= 1"):
        convert(str(src), str(tmp_path / "o"), resize=int(value) if value != "x" else 0,
                progress=False)


def test_non_utf8_caption_names_file_and_line(tmp_path):
    (tmp_path / "a.jpg").write_bytes(solid_image(0))
    body = '{"image": "a.jpg", "raw": "fine"}\n{"image": "a.jpg", "raw": "caf\xe9"}\n'
    (tmp_path / "p.jsonl").write_bytes(body.encode("latin-1"))
    (tmp_path / "p.csv").write_bytes("image,raw\na.jpg,fine\na.jpg,caf\xe9\n".encode("latin-1"))
    for name, line in (("p.jsonl", 2), ("p.csv", 3)):  # the CSV's line 1 is its header
        with pytest.raises(DataError, match=f"line {line} is not valid utf-8") as e:
            convert(str(tmp_path / name), str(tmp_path / "o"), progress=False)
        assert f"{name}:{line}" in str(e.value)
        s = convert(str(tmp_path / name), str(tmp_path / "o"), encoding="latin-1",
                    progress=False)
        assert s["written"] == 2
        assert decode_tokens(RecordIOReader(str(tmp_path / "o")).read_item(1)[2])[0] == "café"
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "make_rec.py"),
                          str(tmp_path / "p.jsonl"), str(tmp_path / "cli"), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "p.jsonl:2" in out.stderr and "--encoding" in out.stderr


def test_img2dataset_files_layout(tmp_path):
    """img2dataset's default output: 00000/000000000.jpg + .txt + .json (+ parquet and
    stats beside the folders)."""
    d = tmp_path / "i2d"
    words = {0: "a red cat", 1: "a blue dog", 10000: "a green bird"}
    for shard, keys in (("00000", (0, 1)), ("00001", (10000,))):
        (d / shard).mkdir(parents=True)
        for k in keys:
            stem = d / shard / f"{k:09d}"
            stem.with_suffix(".jpg").write_bytes(solid_image(k % 7))
            stem.with_suffix(".txt").write_text(words[k])
            stem.with_suffix(".json").write_text(json.dumps({"status": "success",
                                                             "caption": words[k]}))
    (d / "00000" / "000000002.json").write_text(json.dumps({"status": "failed_to_download"}))
    (d / "00000.parquet").write_bytes(b"PAR1 metadata, not read")
    (d / "00000_stats.json").write_text("{}")
    s = convert(str(d), str(tmp_path / "r"), progress=False)
    assert s["written"] == 3, s
    caps = [decode_tokens(item[2])[0] for item in RecordIOReader(str(tmp_path / "r"))]
    assert caps == [words[0], words[1], words[10000]]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no .tar shards and no img2dataset 'files'"):
        convert(str(empty), str(tmp_path / "x"), progress=False)
