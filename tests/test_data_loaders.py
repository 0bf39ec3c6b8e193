"""Writer -> loader (DALI CPU pipeline and torch fallback): pairing, shapes, statistics,
sharding across ranks, epochs, evaluation variant, 154-label records."""

from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from test_data_common import check_batch_pairs, dali_or_skip, make_samples, solid_image, token_map

from rwkv_clip.data import RecordIOWriter, build_eval_loader, build_train_loader
from rwkv_clip.data.tokens import encode_captions_batch, labels_for_rec
from rwkv_clip.data.writers import write_rec, write_wds

N = 37
LOADERS = ["dali", "torch"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("loaders")
    samples = make_samples(N)
    write_rec(samples, str(d / "train"))
    shards = write_wds(samples, str(d / "wds" / "s"), shard_size=10)["outputs"]
    return {"rec": str(d / "train"), "wds": str(d / "wds"), "shards": shards,
            "tmap": token_map(N)}


def _args(path, fmt, kind, **kw):
    a = dict(train_data=path, data_format=fmt, batch_size=8, workers=0, input_size=24,
             seed=0, skip_corrupt=False, device="cpu", rank=0, world_size=1, loader=kind)
    a.update(kw)
    return NS(**a)


def _epoch(loader, tmap):
    ids = []
    for images, tokens in loader:
        assert images.shape == (8, 3, 24, 24) and images.dtype == torch.float32
        assert tokens.shape == (8, 231) and tokens.dtype == torch.int64
        assert images.device.type == "cpu"
        ids += check_batch_pairs(images, tokens, tmap)
    return ids


@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.parametrize("fmt", ["rec", "wds"])
def test_train_loader_pairs_and_coverage(data, kind, fmt):
    dali_or_skip(kind)
    L = build_train_loader(_args(data[fmt], fmt, kind, workers=2), log=None)
    assert len(L) == 5  # ceil(37 / 8), full batches
    for _ in range(2):
        ids = _epoch(L, data["tmap"])
        assert len(ids) == 40 and set(ids) == set(range(N))
        L.reset()


@pytest.mark.parametrize("kind", LOADERS)
@pytest.mark.parametrize("fmt", ["rec", "wds"])
def test_two_ranks_disjoint_and_complete(data, kind, fmt):
    dali_or_skip(kind)
    per_rank = []
    lens = []
    for rank in (0, 1):
        L = build_train_loader(_args(data[fmt], fmt, kind, rank=rank, world_size=2), log=None)
        lens.append(len(L))
        per_rank.append(set(_epoch(L, data["tmap"])))
    assert lens[0] == lens[1] == 3  # ceil(19 / 8) on both ranks
    assert not per_rank[0] & per_rank[1]
    assert per_rank[0] | per_rank[1] == set(range(N))


def test_rank_from_torchrun_env(data, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    a = _args(data["rec"], "rec", "torch")
    del a.rank, a.world_size
    L = build_train_loader(a, log=None)
    ids = set(_epoch(L, data["tmap"]))
    assert len(ids) == N - N // 2  # rank 1 holds [18, 37)


@pytest.mark.parametrize("kind", LOADERS)
def test_augmentation_varies_and_is_seeded(tmp_path, kind):
    """A non-uniform image: crops/flips differ between epochs; same seed -> same batches
    (torch); both produce CLIP-normalised statistics."""
    dali_or_skip(kind)
    import io

    from PIL import Image
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)
    arr[:, :40] = 255
    b = io.BytesIO()
    Image.fromarray(arr).save(b, "PNG")
    write_rec([{"name": "x", "image_bytes": b.getvalue(), "raw": f"c {i}"} for i in range(8)],
              str(tmp_path / "one"))
    L = build_train_loader(_args(str(tmp_path / "one"), "rec", kind), log=None)
    e1 = torch.cat([x for x, _ in L])
    L.reset()
    e2 = torch.cat([x for x, _ in L])
    assert e1.shape == (8, 3, 24, 24)
    assert not torch.allclose(e1, e2)
    # white half present: max equals (255 - mean) / std in every channel
    from test_data_common import MEAN, STD
    top = ((255 - MEAN) / STD)
    assert np.allclose(e1.amax(dim=(0, 2, 3)).numpy(), top, atol=0.05)
    if kind == "torch":
        L2 = build_train_loader(_args(str(tmp_path / "one"), "rec", kind), log=None)
        assert torch.equal(torch.cat([x for x, _ in L2]), e1)


@pytest.mark.parametrize("kind", LOADERS)
def test_eval_loader_in_order_partial_batch(data, kind):
    dali_or_skip(kind)
    L = build_eval_loader(_args(data["rec"], "rec", kind), log=None)
    assert len(L) == 5
    sizes, ids = [], []
    for images, tokens in L:
        sizes.append(len(images))
        ids += check_batch_pairs(images, tokens, data["tmap"])
    assert sizes == [8, 8, 8, 8, 5]
    assert ids == list(range(N))


@pytest.mark.parametrize("kind", LOADERS)
def test_two_caption_records_padded(tmp_path, kind):
    """154 labels (the original data2rec) -> third caption repeats the second."""
    dali_or_skip(kind)
    caps = [(f"raw {i}", f"second {i}", None) for i in range(6)]
    toks = encode_captions_batch(caps)
    with RecordIOWriter(str(tmp_path / "two.rec"), str(tmp_path / "two.idx")) as w:
        for i, t in enumerate(toks):
            lab = labels_for_rec(t)[:154] if i % 2 else labels_for_rec(t)
            w.write_image_record(i, lab, solid_image(i))
    L = build_eval_loader(_args(str(tmp_path / "two"), "rec", kind, batch_size=6), log=None)
    (images, tokens), = list(L)
    for i in range(6):
        want = toks[i].copy()
        if i % 2:
            want[154:] = want[77:154]
        assert tokens[i].tolist() == want.tolist()


@pytest.mark.slow
def test_torch_loader_workers_match_single_process(data):
    a0 = _args(data["rec"], "rec", "torch", workers=0)
    a2 = _args(data["rec"], "rec", "torch", workers=2)
    b0 = [x for x, _ in build_train_loader(a0, log=None)]
    b2 = [x for x, _ in build_train_loader(a2, log=None)]
    assert all(torch.equal(x, y) for x, y in zip(b0, b2, strict=False))


def test_auto_picks_dali_cpu_when_installed(data):
    pytest.importorskip("nvidia.dali")
    L = build_train_loader(_args(data["rec"], "rec", "auto"), log=None)
    assert type(L).__name__ == "DALIWrapper"


def test_original_dali_entry_point(data, monkeypatch):
    pytest.importorskip("nvidia.dali")
    import importlib.util
    import os
    spec = importlib.util.spec_from_file_location(
        "dali_top", os.path.join(os.path.dirname(os.path.dirname(__file__)), "dali.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    L = mod.dali_dataloader(NS(train_data=data["rec"], batch_size=8, workers=1, input_size=24,
                               dali_cpu=True))
    assert len(L) == 5
    ids = _epoch(L, data["tmap"])
    assert set(ids) == set(range(N))
    L.reset()
    assert set(_epoch(L, data["tmap"])) == set(range(N))
