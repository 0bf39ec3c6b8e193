"""Parquet shards (img2dataset's parquet and the Hub's YFCC15M layout), caption-token
arrays and make_rec.py's parquet input, on small parquet files written here."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace as NS

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_data_common import (
    caption,
    check_batch_pairs,
    make_samples,
    make_samples_captions,
    solid_image,
    token_map,
)
from train_util import make_tiny_rec, tiny_argv

from rwkv_clip.data import DataError, RecordIOReader, build_eval_loader, build_train_loader
from rwkv_clip.data.parquet import index_parquet
from rwkv_clip.data.tokens import encode_captions_batch
from rwkv_clip.data.wds import check_wds
from rwkv_clip.data.writers import convert, write_rec, write_wds
from rwkv_clip.errors import TrainArgsError
from rwkv_clip.train.args import parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 13
FAILED = {3, 8}  # img2dataset rows that failed to download


def img2dataset_table(ids, failed=()):
    """img2dataset's parquet columns; failed rows have no image, as img2dataset writes."""
    caps = make_samples_captions(max(ids) + 1)
    return pa.table({
        "key": [f"{i:09d}" for i in ids],
        "jpg": [None if i in failed else solid_image(i, 40 + i % 7, 36 + i % 5) for i in ids],
        "caption": [caps[i][0] for i in ids],
        "syn": [caps[i][1] for i in ids],
        "gen": [caps[i][2] for i in ids],
        "url": [f"http://example.com/{i}.jpg" for i in ids],
        "width": pa.array([40 + i % 7 for i in ids], pa.int32()),
        "status": ["failed_to_download" if i in failed else "success" for i in ids],
    })


def write_img2dataset(folder, n=N, per_file=5, row_group=2, failed=FAILED):
    os.makedirs(folder, exist_ok=True)
    paths = []
    for f, lo in enumerate(range(0, n, per_file)):
        ids = list(range(lo, min(n, lo + per_file)))
        paths.append(os.path.join(folder, f"{f:05d}.parquet"))
        pq.write_table(img2dataset_table(ids, failed), paths[-1], row_group_size=row_group)
    return paths


def yfcc_table(ids, labels):
    """The Hub YFCC15M card: images (Image struct {bytes, path}), texts (float32 list)."""
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa.table({
        "images": pa.array([{"bytes": solid_image(i), "path": None} for i in ids], struct),
        "texts": pa.array([labels[i].astype(np.float32).tolist() for i in ids],
                          pa.list_(pa.float32())),
    })


def args(path, **kw):
    a = dict(train_data=str(path), data_format="parquet", batch_size=4, workers=0,
             input_size=16, seed=0, skip_corrupt=False, device="cpu", rank=0, world_size=1,
             loader="auto", caption_columns="caption,syn,gen")
    a.update(kw)
    return NS(**a)


def epoch_ids(loader, tmap):
    ids = []
    for images, tokens in loader:
        assert images.shape == (4, 3, 16, 16) and tokens.dtype.is_floating_point is False
        ids.extend(check_batch_pairs(images, tokens, tmap))
    return ids


@pytest.fixture(scope="module")
def i2d(tmp_path_factory):
    d = tmp_path_factory.mktemp("i2d")
    write_img2dataset(str(d))
    return d


@pytest.fixture(scope="module")
def tmap():
    return token_map(N)


GOOD = sorted(set(range(N)) - FAILED)


# ----------------------------------------------------------------------------- loading

def test_round_trip_status_filter_and_coverage(i2d, tmap):
    L = build_train_loader(args(i2d), log=None)
    assert L.filtered == len(FAILED) and L.skipped == 0
    assert len(L) == -(-len(GOOD) // 4)
    ids = epoch_ids(L, tmap)
    assert len(ids) == len(L) * 4
    assert set(ids) == set(GOOD)  # each usable row, none of the failed ones
    assert ids[:len(GOOD)] != GOOD  # shuffled


def test_default_columns_fit_img2dataset(i2d):
    L = build_train_loader(args(i2d, caption_columns=None), log=None)
    images, tokens = next(iter(L))
    caps = [c for c, _, _ in make_samples_captions(N)]
    raw_only = encode_captions_batch([(c, None, None) for c in caps])
    found = {tuple(t) for t in raw_only.tolist()}
    assert all(tuple(t) in found for t in tokens.tolist())  # raw caption in all 3 slots


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_disjoint_and_complete(i2d, tmap, world):
    shares = []
    for r in range(world):
        L = build_train_loader(args(i2d, rank=r, world_size=world), log=None)
        shares.append(epoch_ids(L, tmap))
        per_rank = -(-len(GOOD) // world)
        assert len(L) == -(-per_rank // 4)  # the same batch count on every rank
    own = [set(s) for s in shares]
    for a in range(world):
        for b in range(a + 1, world):
            assert not own[a] & own[b]
    assert set().union(*own) == set(GOOD)
    assert sum(len(s) for s in own) == len(GOOD)


@pytest.mark.slow  # worker start-up from a forkserver takes tens of seconds on a busy box
def test_workers_do_not_change_the_batches(i2d):
    b0 = [(im, tok) for im, tok in build_train_loader(args(i2d, workers=0), log=None)]
    b2 = [(im, tok) for im, tok in build_train_loader(args(i2d, workers=2), log=None)]
    assert len(b0) == len(b2)
    for (i0, t0), (i2, t2) in zip(b0, b2, strict=True):
        assert np.array_equal(t0.numpy(), t2.numpy())
        assert np.allclose(i0.numpy(), i2.numpy())


def test_seeded_epochs_and_exact_resume(i2d):
    def run(loader, epochs):
        out = []
        for _ in range(epochs):
            out.append([(im.clone(), tok.clone()) for im, tok in loader])
            loader.reset()
        return out

    a = run(build_train_loader(args(i2d), log=None), 2)
    b = run(build_train_loader(args(i2d), log=None), 2)
    other = run(build_train_loader(args(i2d, seed=1), log=None), 1)
    for ea, eb in zip(a, b, strict=True):
        for (ia, ta), (ib, tb) in zip(ea, eb, strict=True):
            assert np.array_equal(ta.numpy(), tb.numpy()) and np.allclose(ia, ib)
    order = [t[:, :8].numpy().tolist() for _, t in a[0]]
    assert order != [t[:, :8].numpy().tolist() for _, t in a[1]]  # new order each epoch
    assert order != [t[:, :8].numpy().tolist() for _, t in other[0]]
    # resume as the training loop does: set the epoch, skip the consumed batches
    fresh = build_train_loader(args(i2d), log=None)
    fresh.set_epoch(1)
    it = iter(fresh)
    next(it)
    rest = list(it)
    assert len(rest) == len(a[1]) - 1
    for (ia, ta), (ib, tb) in zip(a[1][1:], rest, strict=True):
        assert np.array_equal(ta.numpy(), tb.numpy()) and np.allclose(ia, ib)


def test_eval_loader_in_file_order(i2d, tmap):
    L = build_eval_loader(args(i2d), data=str(i2d), data_format="parquet", log=None)
    seen = []
    for images, tokens in L:
        seen.extend(check_batch_pairs(images, tokens, tmap))
    assert seen == GOOD and len(L) == -(-len(GOOD) // 4)


def test_globs_brace_lists_and_args(tmp_path, i2d, tmap):
    brace = str(i2d / "{00000,00001,00002}.parquet")
    glob = str(i2d / "*.parquet")
    for spec in (brace, glob):
        assert len(index_parquet(spec, caption_columns="caption,syn,gen").files) == 3
    a = parse_args(["--train-data", brace, "--image-column", "jpg",
                    "--caption-columns", "caption,syn,gen", "--caption-tokens", "t.npy"])
    assert a.data_format == "parquet" and a.image_column == "jpg"
    assert a.caption_columns == "caption,syn,gen" and a.caption_tokens == "t.npy"
    with pytest.raises(TrainArgsError, match="dali cannot read parquet"):
        build_train_loader(args(i2d, loader="dali"), log=None)


def test_hub_yfcc15m_layout(tmp_path):
    labels = encode_captions_batch(make_samples_captions(6))
    two = labels[:, :154]  # the original's data2rec wrote two captions: also accepted
    pq.write_table(yfcc_table(range(6), labels), tmp_path / "train-00000-of-00002.parquet",
                   row_group_size=4)
    pq.write_table(yfcc_table(range(6), two), tmp_path / "train-00001-of-00002.parquet")
    L = build_eval_loader(args(tmp_path, caption_columns=None, batch_size=12), data=str(tmp_path),
                          data_format="parquet", log=None)
    images, tokens = next(iter(L))
    expect = np.concatenate([labels, np.concatenate([two, two[:, 77:]], axis=1)])
    assert np.array_equal(tokens.numpy(), expect)
    tmap6 = {tuple(int(v) for v in t): i for i, t in enumerate(expect[:6])}
    assert check_batch_pairs(images[:6], tokens[:6], tmap6) == list(range(6))


# ----------------------------------------------------------------------------- bad input

def test_missing_column_names_the_columns(i2d):
    with pytest.raises(DataError, match=r"no caption column 'text2'.*key, jpg, caption"):
        build_train_loader(args(i2d, caption_columns="caption,text2"), log=None)
    with pytest.raises(DataError, match=r"no image column 'png'.*columns: key, jpg"):
        build_train_loader(args(i2d, image_column="png"), log=None)


def test_missing_image_column_by_default(tmp_path):
    pq.write_table(pa.table({"photo": [b"x"], "caption": ["a"]}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match="no image column.*--image-column.*photo, caption"):
        build_train_loader(args(tmp_path, caption_columns=None), log=None)


def _single(tmp_path, table, name="a.parquet"):
    d = tmp_path / name.split(".")[0]
    d.mkdir()
    pq.write_table(table, d / name)
    return d, str(d / name)


def test_null_and_undecodable_images_name_file_and_row(tmp_path, tmap):
    t = img2dataset_table(list(range(6)), failed=()).drop(["status"])
    jpg = t.column("jpg").to_pylist()
    jpg[2] = None
    jpg[4] = b"\xff\xd8 this is not a JPEG"
    t = t.set_column(t.schema.get_field_index("jpg"), "jpg", pa.array(jpg, pa.binary()))
    d, path = _single(tmp_path, t)
    L = build_eval_loader(args(d, batch_size=6), data=str(d), data_format="parquet", log=None)
    with pytest.raises(DataError, match=rf"null or empty image.*file: {path} \| record: row 2"):
        list(L)
    L = build_eval_loader(args(d, batch_size=6, skip_corrupt=True), data=str(d),
                          data_format="parquet", log=None)
    images, tokens = next(iter(L))
    assert L.skipped == 2
    assert set(check_batch_pairs(images, tokens, tmap)) == {0, 1, 3, 5}
    t2 = t.slice(0, 2).set_column(t.schema.get_field_index("jpg"), "jpg",
                                  pa.array([jpg[4], jpg[5]], pa.binary()))
    d2, path2 = _single(tmp_path, t2, "b.parquet")
    with pytest.raises(DataError, match=rf"undecodable image.*file: {path2} \| record: row 0"):
        list(build_train_loader(args(d2), log=None))


def test_empty_files(tmp_path, i2d):
    (tmp_path / "zero.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty file \(0 bytes\).*zero.parquet"):
        build_train_loader(args(tmp_path / "zero.parquet"), log=None)
    pq.write_table(img2dataset_table([0]).slice(0, 0), tmp_path / "norows.parquet")
    with pytest.raises(DataError, match=r"empty file \(no rows\).*norows.parquet"):
        build_train_loader(args(tmp_path / "norows.parquet"), log=None)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="not a readable parquet file.*junk.parquet"):
        build_train_loader(args(tmp_path / "junk.parquet"), log=None)
    spec = "::".join([str(i2d / "00000.parquet"), str(tmp_path / "zero.parquet"),
                      str(tmp_path / "norows.parquet")])
    L = build_train_loader(args(spec, skip_corrupt=True), log=None)
    assert len(L.index.bad) == 2 and len(L.index.units) == 3  # 5 rows in groups of 2


def test_schema_change_between_shards(tmp_path, i2d):
    t = img2dataset_table([20, 21], failed=())
    t = t.set_column(t.schema.get_field_index("caption"), "caption",
                     pa.array([[1.0] * 77, [2.0] * 77], pa.list_(pa.float32())))
    pq.write_table(t, tmp_path / "changed.parquet")
    spec = "::".join([str(i2d / "00000.parquet"), str(tmp_path / "changed.parquet")])
    first = str(i2d / "00000.parquet")
    with pytest.raises(DataError, match=rf"schema differs from {first}: column 'caption' is "
                                        r"list<.*here, string there.*changed.parquet"):
        build_train_loader(args(spec), log=None)
    L = build_train_loader(args(spec, skip_corrupt=True), log=None)
    assert L.skipped == 2 and L.index.usable == 4  # the 2 rows dropped; 00000 has 4 good


# ----------------------------------------------------------------------------- token arrays

def test_caption_token_array_fills_the_variants(i2d, tmp_path):
    all_caps = encode_captions_batch(make_samples_captions(N))
    raw_ofa = all_caps[:, :154].astype(np.int32)  # (N, 2 x 77) as the original shared them
    np.save(tmp_path / "tok.npy", raw_ofa)
    L = build_eval_loader(args(i2d, batch_size=16, caption_tokens=str(tmp_path / "tok.npy"),
                               caption_columns="caption"), data=str(i2d),
                          data_format="parquet", log=None)
    _, tokens = next(iter(L))
    got = tokens.numpy()
    # raw + synthetic from the array; the generated slot keeps the file's own (raw) caption
    own_raw = encode_captions_batch([(caption(i), None, None) for i in GOOD])
    assert np.array_equal(got[:, :154], raw_ofa[GOOD])
    assert np.array_equal(got[:, 154:], own_raw[:, 154:])
    # images only + k = 1: the one caption fills all three slots
    np.save(tmp_path / "one.npy", all_caps[:, :77])
    t = img2dataset_table(list(range(N)), FAILED).select(["jpg", "status"])
    d, _ = _single(tmp_path, t)
    L = build_eval_loader(args(d, batch_size=16, caption_tokens=str(tmp_path / "one.npy"),
                               caption_columns=None), data=str(d), data_format="parquet",
                          log=None)
    _, tokens = next(iter(L))
    assert np.array_equal(tokens.numpy(), np.tile(all_caps[GOOD, :77], 3))


def test_caption_token_array_mismatches(i2d, tmp_path):
    np.save(tmp_path / "short.npy", np.zeros((N - 1, 154), np.int64))
    with pytest.raises(DataError, match=rf"has {N - 1} rows but the parquet files \(3\) "
                                        rf"holds {N} samples"):
        build_train_loader(args(i2d, caption_tokens=str(tmp_path / "short.npy")), log=None)
    np.save(tmp_path / "wide.npy", np.zeros((N, 100), np.int64))
    with pytest.raises(DataError, match=r"rows of 100 tokens; expected \(N, L x k\) with "
                                        r"k = 1, 2 or 3 captions of L = 77"):
        build_train_loader(args(i2d, caption_tokens=str(tmp_path / "wide.npy")), log=None)
    with pytest.raises(TrainArgsError, match="dali cannot read --caption-tokens"):
        build_train_loader(args(i2d, data_format="rec", loader="dali",
                                caption_tokens=str(tmp_path / "wide.npy")), log=None)


def test_caption_token_array_for_rec_and_wds(tmp_path):
    samples = make_samples(6)
    write_rec(samples, str(tmp_path / "r"))
    write_wds(samples, str(tmp_path / "w" / "s"), shard_size=4)
    new = encode_captions_batch([(f"other caption {i}", f"other synthetic {i}", None)
                                 for i in range(6)])
    np.save(tmp_path / "t.npy", new[:, :154])
    own = encode_captions_batch(make_samples_captions(6))
    tok = str(tmp_path / "t.npy")
    for fmt, data in (("rec", str(tmp_path / "r")), ("wds", str(tmp_path / "w" / "s-*.tar"))):
        L = build_eval_loader(args(data, data_format=fmt, batch_size=6, caption_tokens=tok),
                              data=data, data_format=fmt, log=None)
        _, tokens = next(iter(L))
        assert np.array_equal(tokens.numpy()[:, :154], new[:, :154]), fmt
        assert np.array_equal(tokens.numpy()[:, 154:], own[:, 154:]), fmt
    assert check_wds(str(tmp_path / "w" / "s-*.tar")).num_keys == 6
    np.save(tmp_path / "seven.npy", new[:5, :154])
    with pytest.raises(DataError, match=r"has 5 rows but .*r.rec holds 6 samples"):
        build_train_loader(args(str(tmp_path / "r"), data_format="rec",
                                caption_tokens=str(tmp_path / "seven.npy")), log=None)


# ----------------------------------------------------------------------------- make_rec

def test_make_rec_converts_parquet(i2d, tmp_path, tmap):
    s = convert(str(i2d), str(tmp_path / "out"), fmt="rec", progress=False,
                caption_columns="caption,syn,gen")
    assert s["written"] == len(GOOD) and s["reasons"] == {
        "skipped: img2dataset status is not 'success'": len(FAILED)}
    r = RecordIOReader(str(tmp_path / "out"))
    got = [tmap[tuple(int(v) for v in labels)] for _, _, labels, _ in r]
    assert got == GOOD  # file order, captions tokenised as the loader does
    s = convert(str(i2d / "*.parquet"), str(tmp_path / "w"), fmt="wds", progress=False,
                shard_size=4, caption_columns="caption,syn,gen")
    assert s["written"] == len(GOOD) and len(s["outputs"]) == 3
    L = build_eval_loader(args(str(tmp_path / "w-*.tar"), data_format="wds", batch_size=16),
                          data=str(tmp_path / "w-*.tar"), data_format="wds", loader="torch",
                          log=None)
    images, tokens = next(iter(L))
    assert check_batch_pairs(images, tokens, tmap) == GOOD


def test_make_rec_cli_parquet_tokens_and_errors(tmp_path):
    labels = encode_captions_batch(make_samples_captions(4))
    pq.write_table(yfcc_table(range(4), labels), tmp_path / "train-0.parquet")
    script = os.path.join(REPO, "scripts", "make_rec.py")
    out = subprocess.run([sys.executable, script, str(tmp_path / "train-0.parquet"),
                          str(tmp_path / "y"), "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "written: 4  skipped: 0" in out.stdout
    stored = [labels for _, _, labels, _ in RecordIOReader(str(tmp_path / "y"))]
    assert np.array_equal(np.stack(stored), labels.astype(np.float32))  # copied as stored
    bad = subprocess.run([sys.executable, script, str(tmp_path / "train-0.parquet"),
                          str(tmp_path / "z"), "--image-column", "jpg", "--no-progress"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.startswith("make_rec.py: error: no image column 'jpg'")
    assert "columns: images, texts" in bad.stderr and len(bad.stderr.splitlines()) == 1


# ----------------------------------------------------------------------------- bench_data

def test_bench_data_prints_json(tmp_path):
    (tmp_path / "train.json").write_text(json.dumps({"samples_per_s": 0.5, "config": "x"}))
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "bench_data.py"), "--workers", "0",
         "--loaders", "torch,parquet,dali_gpu", "--samples", "12", "--image-size", "64x48",
         "--input-size", "32", "--batch-size", "4", "--batches", "4",
         "--data-dir", str(tmp_path), "--train-json", str(tmp_path / "train.json")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["train_samples_per_s"] == 0.5 and out["input_size"] == 32
    for name in ("torch", "parquet"):
        r = out["loaders"][name]["0"]
        assert r["batches"] == 4 and r["images_per_s"] > 0.5 and r["keeps_up"] is True
    if not torch.cuda.is_available():
        assert "skipped" in out["loaders"]["dali_gpu"]


# ----------------------------------------------------------------------------- training

@pytest.fixture(scope="module")
def tiny_parquet(tmp_path_factory):
    """train_util's tiny coloured squares as img2dataset parquet (two shards)."""
    d = tmp_path_factory.mktemp("tinypq")
    rec = make_tiny_rec(d, n=24)
    rows = [(img, labels) for _, _, labels, img in RecordIOReader(rec)]
    from rwkv_clip.data.tokens import decode_tokens
    caps = [decode_tokens(labels) for _, labels in rows]
    for f in range(2):
        part = range(12 * f, 12 * f + 12)
        pq.write_table(pa.table({"jpg": [rows[i][0] for i in part],
                                 "caption": [caps[i][0] for i in part],
                                 "status": ["success"] * 12}),
                       d / f"{f:05d}.parquet", row_group_size=5)
    return str(d / "*.parquet")


@pytest.mark.slow
def test_train_on_parquet_and_resume_exactly(tmp_path, tiny_parquet):
    from rwkv_clip.train import main
    extra = ["--epochs", "2", "--batch-size", "4", "--save-every-steps", "2", "--seed", "3",
             "--dropout", "0.1"]
    full = main(parse_args(tiny_argv(tmp_path / "full", tiny_parquet, *extra)))
    assert full["steps"] == 2 * 24 // 4 and full["epochs"] == 2
    ckpt = tmp_path / "full" / "checkpoints" / "step_8.pt"  # mid-epoch 1
    resumed = main(parse_args(tiny_argv(tmp_path / "resumed", tiny_parquet, *extra,
                                        "--resume", str(ckpt))))
    a, b = full["model"].state_dict(), resumed["model"].state_dict()
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) < 1e-6
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    assert max((a[k].double() - state[k].double()).abs().max().item() for k in a) > 1e-4


def test_caption_token_rows_stay_aligned_when_a_shard_is_dropped(i2d, tmp_path):
    t = img2dataset_table([20, 21], failed=()).drop(["syn"])  # schema differs: dropped
    pq.write_table(t, tmp_path / "changed.parquet")
    spec = "::".join([str(i2d / "00000.parquet"), str(tmp_path / "changed.parquet"),
                      str(i2d / "00001.parquet")])
    rows = encode_captions_batch([(f"row {i}", None, None) for i in range(12)])
    np.save(tmp_path / "t.npy", rows)
    L = build_eval_loader(args(spec, batch_size=16, skip_corrupt=True,
                               caption_tokens=str(tmp_path / "t.npy")), data=spec,
                          data_format="parquet", log=None)
    _, tokens = next(iter(L))
    # file 0 holds rows 0-4 (3 failed), the dropped file rows 5-6, file 1 rows 7-11 (8 failed)
    want = [0, 1, 2, 4] + [7 + k for k in range(5) if 5 + k != 8]
    assert np.array_equal(tokens.numpy(), rows[want])
    (tmp_path / "junk.parquet").write_bytes(b"junk")
    spec = "::".join([str(i2d / "00000.parquet"), str(tmp_path / "junk.parquet")])
    with pytest.raises(DataError, match="row count is unknown.*junk.parquet"):
        build_train_loader(args(spec, skip_corrupt=True,
                                caption_tokens=str(tmp_path / "t.npy")), log=None)
