"""Every reader of captions answers a file that is not in its encoding, and an empty
caption, the same way: one line naming the file and line (or entry), exit status 2; the
retrieval CLI reads another encoding with --encoding, as make_rec.py does. make_rec.py
reads CSV with the csv module: a row with more fields than its header is an error naming
the row, never a caption cut at the comma."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from rwkv_clip.data import RecordIOReader, encode_captions
from rwkv_clip.data.tokens import decode_tokens
from rwkv_clip.errors import DataError
from rwkv_clip.eval.retrieval import build_retrieval_set

REPO = Path(__file__).resolve().parents[1]
CAPTIONS = ["a red square on white", "a caf\xe9 at night", "a blue circle"]
KINDS = ("coco", "dci", "jsonl", "sharegpt4v", "urban1k")


def line_of(path: str, text: bytes) -> int:
    """The line of ``path`` that holds ``text``, from 1."""
    return Path(path).read_bytes().split(b"\n").index(
        next(line for line in Path(path).read_bytes().split(b"\n") if text in line)) + 1


def image(path: Path, i: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 12), ((80 * i) % 256, 40, 200)).save(path)


def write_set(kind: str, root: Path, captions=CAPTIONS, encoding: str = "latin-1") -> list[str]:
    """One retrieval set in its published layout, text in ``encoding``; -> the CLI's
    --dataset/--data-root/--retrieval-file flags and the file that holds caption 1."""
    for i in range(len(captions)):
        image(root / ("image" if kind == "urban1k" else "val2014") / f"{i}.jpg", i)
    if kind == "urban1k":
        for i, c in enumerate(captions):
            (root / "caption" / f"{i}.txt").parent.mkdir(exist_ok=True)
            (root / "caption" / f"{i}.txt").write_bytes((c + "\n").encode(encoding))
        return ["--dataset", "urban1k", "--data-root", str(root), str(root / "caption" / "1.txt")]
    if kind == "jsonl":
        text = "".join(json.dumps({"image": f"val2014/{i}.jpg", "caption": c},
                                  ensure_ascii=False) + "\n" for i, c in enumerate(captions))
        name = "pairs.jsonl"
    elif kind == "sharegpt4v":
        entries = [{"image": f"val2014/{i}.jpg", "conversations": [
            {"from": "human", "value": "<image>\nDescribe it."}, {"from": "gpt", "value": c}]}
            for i, c in enumerate(captions)]
        text, name = json.dumps(entries, ensure_ascii=False, indent=0), "share.json"
    elif kind == "dci":
        entries = [{"image": f"val2014/{i}.jpg", "caption": c} for i, c in enumerate(captions)]
        text, name = json.dumps(entries, ensure_ascii=False, indent=0), "dci.json"
    else:  # the original's coco_karpathy_test.json
        entries = [{"image": f"val2014/{i}.jpg", "caption": [c]} for i, c in enumerate(captions)]
        text, name = json.dumps(entries, ensure_ascii=False, indent=0), "coco_karpathy_test.json"
    (root / name).write_bytes(text.encode(encoding))
    if kind == "coco":
        return ["--dataset", "coco", "--data-root", str(root), str(root / name)]
    return ["--dataset", kind, "--retrieval-file", str(root / name), "--data-root", str(root),
            str(root / name)]


def retrieval(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "text_image_retrieval.py", "--config", "RWKV_CLIP_tiny",
                           "--device", "cpu", "--workers", "0", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES=""))


def load(kind: str, root: Path, encoding: str = "utf-8"):
    """The set as the CLI reads it (build_retrieval_set with the CLI's arguments)."""
    files = {"jsonl": "pairs.jsonl", "sharegpt4v": "share.json", "dci": "dci.json"}
    file = root / files[kind] if kind in files else None
    return build_retrieval_set(kind, root, file, caption_prefix="", encoding=encoding)


@pytest.mark.parametrize("kind", KINDS)
def test_every_retrieval_reader_names_file_and_line_of_a_bad_byte(kind, tmp_path):
    *_, bad_file = write_set(kind, tmp_path)
    line = line_of(bad_file, b"caf\xe9")
    assert line > 1 or kind == "urban1k"
    with pytest.raises(DataError, match=f"line {line} is not valid utf-8 text") as e:
        load(kind, tmp_path)
    assert f"{bad_file}:{line}" in str(e.value) and "--encoding" in str(e.value)
    rset = load(kind, tmp_path, "latin-1")
    assert rset.captions == CAPTIONS and rset.num_images == 3


def test_retrieval_cli_bad_encoding_is_one_line_and_encoding_reads_it(tmp_path):
    *flags, bad_file = write_set("sharegpt4v", tmp_path)
    r = retrieval(*flags, "--output-dir", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    line = line_of(bad_file, b"caf\xe9")
    column = Path(bad_file).read_bytes().split(b"\n")[line - 1].index(b"\xe9")
    assert r.stderr.strip() == (
        f"text_image_retrieval.py: error: line {line} is not valid utf-8 text (invalid "
        f"continuation byte at byte {column} of the line); give the file's encoding with "
        f"--encoding | file: {bad_file}:{line}")
    r = retrieval(*flags, "--encoding", "latin-1", "--output-dir", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    record = json.loads((tmp_path / "out" / "sharegpt4v_zeroshot_retrieval.json").read_text())
    assert record["num_texts"] == 3
    r = retrieval(*flags, "--encoding", "latin-9x")
    assert r.returncode == 2 and r.stderr.strip() == (
        "text_image_retrieval.py: error: unknown text encoding 'latin-9x'")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("empty", ["", "  \n"])
def test_an_empty_caption_is_an_error_naming_where_in_every_retrieval_reader(kind, empty,
                                                                             tmp_path):
    *_, bad_file = write_set(kind, tmp_path, [CAPTIONS[0], empty, CAPTIONS[2]], "utf-8")
    with pytest.raises(DataError, match="empty caption") as e:
        load(kind, tmp_path)
    where = {"urban1k": f"{bad_file}", "jsonl": f"{bad_file}:2"}.get(kind, f"{bad_file} ")
    assert f"file: {where}" in str(e.value)


def make_rec(src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "make_rec.py"), str(src),
                           str(out), "--no-progress"], capture_output=True, text=True,
                          timeout=300)


def test_make_rec_skips_an_empty_caption_under_the_same_name(tmp_path):
    image(tmp_path / "images" / "good0.jpg", 0)
    (tmp_path / "pairs.csv").write_text('image,raw\nimages/good0.jpg,"a red square"\n'
                                        'images/good0.jpg,"  "\n')
    r = make_rec(tmp_path / "pairs.csv", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    assert "written: 1  skipped: 1" in r.stdout and "skipped: empty caption" in r.stdout
    assert "pairs.csv:3: empty caption" in r.stdout


def test_make_rec_reads_csv_as_csv(tmp_path):
    image(tmp_path / "images" / "good0.jpg", 0)
    src = tmp_path / "pairs.csv"
    src.write_text("image,raw\nimages/good0.jpg,a blue circle\n"
                   "images/good0.jpg,a red square, on white\n")
    r = make_rec(src, tmp_path / "o")
    assert r.returncode == 2 and not (tmp_path / "o.rec").exists()
    assert r.stderr.strip() == (
        "make_rec.py: error: row at line 3 has 3 fields but the header has 2 (image, raw); "
        f"put a caption that holds a comma in double quotes | file: {src}:3")
    src.write_text('image,raw\nimages/good0.jpg,"a red square, on white"\n')
    r = make_rec(src, tmp_path / "o")
    assert r.returncode == 0, r.stderr
    stored = RecordIOReader(str(tmp_path / "o")).read_item(0)[2][:77].astype(int).tolist()
    assert stored == encode_captions("a red square, on white")[:77].tolist()
    assert decode_tokens(encode_captions("a red square, on white"))[0].endswith("on white")


def test_long_caption_groups_follow_the_same_rules(tmp_path):
    from rwkv_clip.eval.long_captions import read_group_file
    entries = [{"image": "0.jpg", "caption": "a caf\xe9", "group": 0},
               {"image": "1.jpg", "caption": " ", "group": 0}]
    path = tmp_path / "eval.json"
    path.write_bytes(json.dumps(entries[:1], ensure_ascii=False, indent=0).encode("latin-1"))
    with pytest.raises(DataError, match=r"line 4 is not valid utf-8 text"):
        read_group_file(path)
    assert read_group_file(path, "latin-1")[0]["caption"] == "a caf\xe9"
    path.write_text(json.dumps(entries))
    with pytest.raises(DataError, match=rf"empty caption .*file: {path} entry 1"):
        read_group_file(path)
