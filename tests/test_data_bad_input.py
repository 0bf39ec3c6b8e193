"""Bad input gives a DataError naming the file and the record (never a hang); with
skip_corrupt the loaders skip and count bad records."""

import io
import os
import shutil
import tarfile
from types import SimpleNamespace as NS

import pytest
from test_data_common import check_batch_pairs, dali_or_skip, make_samples, token_map

from rwkv_clip.data import (
    DataError,
    RecordIOReader,
    RecordIOWriter,
    build_train_loader,
    check_rec,
    dali_available,
)
from rwkv_clip.data.wds import check_wds
from rwkv_clip.data.writers import write_rec, write_wds

N = 12
LOADERS = ["dali", "torch"]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    samples = make_samples(N)
    write_rec(samples, str(d / "g"))
    write_wds(samples, str(d / "w" / "s"), shard_size=5)
    return d


@pytest.fixture(scope="module")
def tmap():
    return token_map(N)


def copy_rec(good, tmp_path, name="b"):
    shutil.copy(good / "g.rec", tmp_path / f"{name}.rec")
    shutil.copy(good / "g.idx", tmp_path / f"{name}.idx")
    return str(tmp_path / name)


def offsets(prefix):
    return [int(line.split("\t")[1]) for line in open(prefix + ".idx").read().splitlines()]


def args(path, kind, fmt="rec", **kw):
    a = dict(train_data=path, data_format=fmt, batch_size=4, workers=0, input_size=16, seed=0,
             skip_corrupt=False, device="cpu", rank=0, world_size=1, loader=kind,
             check_level="full")
    a.update(kw)
    return NS(**a)


def expect_error(a, match, path, record):
    with pytest.raises(DataError, match=match) as e:
        L = build_train_loader(a, log=None)
        for _ in L:
            pass
    msg = str(e.value)
    assert os.path.basename(path) in msg, msg
    if record is not None:
        assert f"record: {record}" in msg, msg
    return e.value


def run_skipping(a, tmap):
    L = build_train_loader(a, log=None)
    ids = []
    for images, tokens in L:
        ids += check_batch_pairs(images, tokens, tmap)
    return L, set(ids)


# ----------------------------------------------------------------------------- .rec problems

def make_truncated(good, tmp_path):
    p = copy_rec(good, tmp_path)
    last = offsets(p)[-1]
    with open(p + ".rec", "r+b") as f:
        f.truncate(last + 100)
    return p, N - 1


def make_bad_magic(good, tmp_path):
    p = copy_rec(good, tmp_path)
    with open(p + ".rec", "r+b") as f:
        f.seek(offsets(p)[5])
        f.write(b"\0\0\0\0")
    return p, 5


def make_idx_past_end(good, tmp_path):
    p = copy_rec(good, tmp_path)
    size = os.path.getsize(p + ".rec")
    with open(p + ".idx", "a") as f:
        f.write(f"{N}\t{size + 400}\n")
    return p, N


def make_idx_not_a_record(good, tmp_path):
    p = copy_rec(good, tmp_path)
    lines = open(p + ".idx").read().splitlines()
    off = offsets(p)[3] + 64  # aligned, inside record 3's labels
    lines[3] = f"3\t{off}"
    open(p + ".idx", "w").write("\n".join(lines) + "\n")
    return p, 3


def make_bad_label_count(good, tmp_path):
    p = str(tmp_path / "b")
    src = RecordIOReader(str(good / "g"))
    with RecordIOWriter(p + ".rec", p + ".idx") as w:
        for i in range(N):
            _, _, lab, img = src.read_item(i)
            w.write_image_record(i, lab[:100] if i == 7 else lab, img)
    return p, 7


def make_truncated_jpeg(good, tmp_path):
    p = str(tmp_path / "b")
    src = RecordIOReader(str(good / "g"))
    with RecordIOWriter(p + ".rec", p + ".idx") as w:
        for i in range(N):
            _, _, lab, img = src.read_item(i)
            w.write_image_record(i, lab, img[:len(img) // 2] if i == 2 else img)
    return p, 2


STRUCTURAL = {
    "truncated rec": (make_truncated, "truncated record"),
    "bad magic": (make_bad_magic, "not the start of a record"),
    "idx past end": (make_idx_past_end, "past the end"),
    "idx not a record": (make_idx_not_a_record, "not the start of a record"),
    "label count": (make_bad_label_count, "100 labels"),
    "truncated jpeg": (make_truncated_jpeg, "JPEG image is truncated"),
}


@pytest.mark.parametrize("case", list(STRUCTURAL))
def test_check_rec_names_bad_record(good, tmp_path, case):
    make, match = STRUCTURAL[case]
    p, key = make(good, tmp_path)
    chk = check_rec(p)
    assert [k for k, _ in chk.bad] == [key]
    assert match in chk.bad[0][1]


@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.parametrize("case", list(STRUCTURAL))
def test_loader_raises_then_skips(good, tmp_path, tmap, kind, case):
    dali_or_skip(kind)
    make, match = STRUCTURAL[case]
    p, key = make(good, tmp_path)
    expect_error(args(p, kind), match, p + ".rec", key)
    L, ids = run_skipping(args(p, kind, skip_corrupt=True), tmap)
    assert L.skipped == 1
    want = set(range(N)) - {key}
    assert ids == want


@pytest.mark.parametrize("kind", LOADERS)
def test_missing_files(good, tmp_path, kind):
    dali_or_skip(kind)
    p = copy_rec(good, tmp_path)
    os.remove(p + ".idx")
    expect_error(args(p, kind), "index file not found", p + ".idx", None)
    os.remove(p + ".rec")
    expect_error(args(p, kind), "record file not found", p + ".rec", None)
    open(p + ".rec", "wb").close()
    expect_error(args(p, kind), "record file is empty", p + ".rec", None)


@pytest.mark.parametrize("kind", LOADERS)
def test_malformed_index(good, tmp_path, kind):
    dali_or_skip(kind)
    p = copy_rec(good, tmp_path)
    open(p + ".idx", "a").write("garbage line here\n")
    expect_error(args(p, kind), "malformed index line", p + ".idx", None)


def _undecodable(good, tmp_path):
    """JPEG markers intact, entropy data garbage: passes check_rec, fails decoding."""
    p = str(tmp_path / "u")
    src = RecordIOReader(str(good / "g"))
    with RecordIOWriter(p + ".rec", p + ".idx") as w:
        for i in range(N):
            _, _, lab, img = src.read_item(i)
            if i == 4:
                img = b"\xff\xd8\xff\xe0" + b"\x13" * 200 + b"\xff\xd9"
            w.write_image_record(i, lab, img)
    return p, 4


@pytest.mark.parametrize("kind", LOADERS)
def test_undecodable_image(good, tmp_path, tmap, kind):
    dali_or_skip(kind)
    p, key = _undecodable(good, tmp_path)
    assert not check_rec(p).bad
    for workers in ([1] if kind == "dali" else [0, 2]):
        expect_error(args(p, kind, workers=workers), "undecodable image", p + ".rec", key)
    if kind == "torch":
        L, ids = run_skipping(args(p, kind, skip_corrupt=True), tmap)
        assert L.skipped >= 1 and key not in ids and len(ids) == N - 1


# ----------------------------------------------------------------------------- wds problems

def _wds_copy(good, tmp_path):
    d = tmp_path / "w"
    shutil.copytree(good / "w", d)
    return d


def test_wds_empty_shard(good, tmp_path, tmap):
    d = _wds_copy(good, tmp_path)
    with tarfile.open(d / "s-000009.tar", "w"):
        pass
    with pytest.raises(DataError, match="empty shard") as e:
        check_wds(str(d))
    assert "s-000009.tar" in str(e.value)
    for kind in LOADERS:
        if kind == "dali":
            pytest.importorskip("nvidia.dali")
        expect_error(args(str(d), kind, "wds"), "empty shard", "s-000009.tar", None)
        L, ids = run_skipping(args(str(d), kind, "wds", skip_corrupt=True), tmap)
        assert ids == set(range(N))


def test_wds_missing_and_bad_components(good, tmp_path, tmap):
    d = _wds_copy(good, tmp_path)
    # rewrite shard 0 without the tok of sample 1 and with a short tok for sample 3
    src = d / "s-000000.tar"
    members = []
    with tarfile.open(src) as tf:
        for m in tf:
            members.append((m.name, tf.extractfile(m).read()))
    with tarfile.open(src, "w") as tf:
        for name, data in members:
            if name == "000000001.tok":
                continue
            if name == "000000003.tok":
                data = data[:40]
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with pytest.raises(DataError, match="no 'tok' component") as e:
        check_wds(str(d))
    assert "record: 000000001" in str(e.value) and "s-000000.tar" in str(e.value)
    idx = check_wds(str(d), skip_corrupt=True)
    assert [b[1] for b in idx.bad] == ["000000001", "000000003"]
    assert "40 bytes" in idx.bad[1][2]
    # DALI cannot drop single samples: explicit loader='dali' refuses, auto falls back
    pytest.importorskip("nvidia.dali")
    expect_error(args(str(d), "dali", "wds", skip_corrupt=True), "DALI cannot skip",
                 "s-000000.tar", "000000001")
    L, ids = run_skipping(args(str(d), "auto", "wds", skip_corrupt=True), tmap)
    assert type(L).__name__ == "TorchLoader" and ids == set(range(N)) - {1, 3}
    assert L.skipped == 2


def test_wds_truncated_and_missing_shard(good, tmp_path):
    d = _wds_copy(good, tmp_path)
    p = d / "s-000001.tar"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2 + 7])
    with pytest.raises(DataError, match="s-000001.tar"):
        check_wds(str(d))
    with pytest.raises(DataError, match="shard not found"):
        check_wds(str(d / "nope-{000000..000002}.tar"))
    with pytest.raises(DataError, match="no .tar shards"):
        check_wds(str(tmp_path))


def test_dali_error_past_unchecked_record_is_diagnosed(good, tmp_path, monkeypatch):
    """A bad record the pre-check did not look at (quick check on a big file): DALI's own
    error is turned into a DataError naming the record, promptly."""
    pytest.importorskip("nvidia.dali")
    import rwkv_clip.data.dali_pipeline as dp
    from rwkv_clip.data.recordio import RecCheck, read_index
    p, key = make_bad_magic(good, tmp_path)
    real = dp.check_rec
    calls = []

    def blind_first(prefix, level="full", **kw):
        calls.append(level)
        if len(calls) == 1:  # pretend the pre-check sampled only good records
            idx = read_index(prefix + ".idx")
            return RecCheck(prefix + ".rec", prefix + ".idx", len(idx), 1, idx, [], {231})
        return real(prefix, level=level, **kw)

    monkeypatch.setattr(dp, "check_rec", blind_first)
    expect_error(args(p, "dali", check_level="quick"), "not the start of a record",
                 p + ".rec", key)
    assert calls == ["quick", "full"]


# ----------------------------------------------------------------------------- one answer

def _flipped_label(good, tmp_path):
    """One flipped byte inside record 6's float32 token labels (the structure is intact)."""
    p = copy_rec(good, tmp_path, "l")
    off = offsets(p)[6] + 8 + 24 + 4 * 1 + 3  # record header, IRHeader, label 1 (a token)
    with open(p + ".rec", "r+b") as f:
        f.seek(off)
        byte = f.read(1)[0]
        f.seek(off)
        f.write(bytes([byte ^ 0x40]))
    return p, 6


ONE_ANSWER = {
    "undecodable image": (_undecodable, "undecodable image \\((OSError|UnidentifiedImageError)"),
    "flipped label byte": (_flipped_label, "token ids outside|not integral token ids"),
}


@pytest.mark.parametrize("case", list(ONE_ANSWER))
def test_every_loader_gives_one_answer(good, tmp_path, tmap, case):
    """The same bad record: the same one-line DataError from every loader (naming file and
    record, with the same reason), and with skip_corrupt the same skip count and samples."""
    make, match = ONE_ANSWER[case]
    p, key = make(good, tmp_path)
    kinds = ["torch"] + (["dali"] if dali_available() else [])
    errors, skipped = {}, {}
    for kind in kinds:
        e = expect_error(args(p, kind, workers=1), match, p + ".rec", key)
        assert "\n" not in str(e) and "worker" not in str(e).lower(), str(e)
        errors[kind] = str(e).split(";")[0]
        L, ids = run_skipping(args(p, kind, workers=1, skip_corrupt=True), tmap)
        assert ids == set(range(N)) - {key}, kind
        L.reset()
        assert set(run_skipping_again(L, tmap)) == set(range(N)) - {key}, kind
        skipped[kind] = L.skipped
    assert len(set(errors.values())) == 1, errors
    # once per epoch where the record is met at run time, once where the pre-check saw it
    assert len(set(skipped.values())) == 1 and set(skipped.values()) <= {1, 2}, skipped


def run_skipping_again(L, tmap):
    ids = []
    for images, tokens in L:
        ids += check_batch_pairs(images, tokens, tmap)
    return ids


def test_torch_worker_error_is_the_data_error(good, tmp_path):
    """Raised in a worker process, the DataError reaches the caller as itself: its own
    one-line message and fields, not a worker traceback."""
    p, key = _undecodable(good, tmp_path)
    e = expect_error(args(p, "torch", workers=2), "undecodable image", p + ".rec", key)
    assert type(e) is DataError and e.path == p + ".rec" and e.record == key
    assert str(e).startswith("undecodable image (") and "Traceback" not in str(e)


def test_check_rec_catches_label_values(good, tmp_path):
    p, key = _flipped_label(good, tmp_path)
    chk = check_rec(p)
    assert [k for k, _ in chk.bad] == [key]


def test_dali_checks_labels_of_records_the_precheck_did_not_see(good, tmp_path, tmap,
                                                               monkeypatch):
    """A bad label the quick pre-check did not look at: DALI's batches are checked as the
    torch loader checks each record - the DataError names the record, or it is skipped."""
    pytest.importorskip("nvidia.dali")
    import rwkv_clip.data.dali_pipeline as dp
    from rwkv_clip.data.recordio import RecCheck, read_index
    p, key = _flipped_label(good, tmp_path)
    real = dp.check_rec

    def blind_first(prefix, level="full", **kw):
        if level == "quick":  # pretend the pre-check sampled only good records
            idx = read_index(prefix + ".idx")
            return RecCheck(prefix + ".rec", prefix + ".idx", len(idx), 1, idx, [], {231})
        return real(prefix, level=level, **kw)

    monkeypatch.setattr(dp, "check_rec", blind_first)
    expect_error(args(p, "dali", check_level="quick"), "token ids outside|not integral",
                 p + ".rec", key)
    L, ids = run_skipping(args(p, "dali", check_level="quick", skip_corrupt=True), tmap)
    assert L.skipped == 1 and ids == set(range(N)) - {key}


@pytest.mark.slow
def test_train_cli_reports_a_bad_record_in_one_line_with_every_loader(good, tmp_path):
    """train.py with 2 torch workers (the record fails inside a worker) and with DALI:
    the same one ``error:`` line, no traceback, exit status 2."""
    import subprocess
    import sys

    from train_util import REPO, tiny_argv
    p, key = _undecodable(good, tmp_path)
    lines = {}
    for kind in ["torch"] + (["dali"] if dali_available() else []):
        argv = tiny_argv(tmp_path / kind, p, "--loader", kind, "--workers", "2")
        out = subprocess.run([sys.executable, str(REPO / "train.py"), *argv],
                             capture_output=True, text=True, timeout=600, cwd=REPO,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr and "SemLock" not in out.stderr, out.stderr
        lines[kind] = out.stderr.strip().splitlines()[-1]
        assert lines[kind].startswith("train.py: error: undecodable image")
        assert f"file: {p}.rec | record: {key}" in lines[kind]
    assert len(set(lines.values())) == 1, lines
