"""Exact resume at the data level: a fresh loader put at epoch E (the way the training
loop does it on ``--resume``) and advanced B batches yields exactly the batches the
uninterrupted loader yields there - same samples, same order, same augmentation - for
every loader (DALI CPU here; the GPU pipeline shares the code path)."""

from types import SimpleNamespace as NS

import pytest
import torch
from test_data_common import dali_or_skip, make_samples

from rwkv_clip.data import build_train_loader
from rwkv_clip.data.writers import write_rec

N = 20
LOADERS = ["dali", "torch"]


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    # non-uniform images, so the random crop and the mirror change the pixels
    write_rec(make_samples(N), str(d / "r"))
    return str(d / "r")


def _args(path, kind, **kw):
    a = dict(train_data=path, data_format="rec", batch_size=4, workers=1, input_size=16,
             seed=3, skip_corrupt=False, device="cpu", rank=0, world_size=1, loader=kind)
    a.update(kw)
    return NS(**a)


def _put_at_epoch(loader, epoch):
    """What the training loop does with a fresh loader on resume (train/loop.py)."""
    from rwkv_clip.train.loop import set_loader_epoch
    set_loader_epoch(loader, epoch)


def _run(loader, epochs, first_skip=0):
    """Batches of ``epochs`` epochs, the first ``first_skip`` batches of the first epoch
    consumed but not kept (as the loop does mid-epoch)."""
    out = []
    for e in range(epochs):
        it = iter(loader)
        for _ in range(first_skip if e == 0 else 0):
            next(it)
        out.append([(im.clone(), tok.clone()) for im, tok in it])
        loader.reset()
    return out


def _same(a, b):
    assert len(a) == len(b)
    for (ia, ta), (ib, tb) in zip(a, b, strict=True):
        assert torch.equal(ta, tb)
        assert torch.equal(ia, ib)


@pytest.mark.parametrize("kind", LOADERS + ["dali-gpu"])
def test_resume_at_epoch_boundary_and_mid_epoch(rec, kind, recwarn):
    kw = {}
    if kind == "dali-gpu":  # the GPU pipeline (mixed decoder, GPU ops): where there is one
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        kind, kw = "dali", {"device": "cuda"}
    dali_or_skip(kind)
    full = _run(build_train_loader(_args(rec, kind, **kw), log=None), 3)
    # epochs differ (new order / augmentation), so the comparisons below have teeth
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(full[0], full[1], strict=True))
    assert not torch.equal(full[1][0][0], full[2][0][0])

    at2 = build_train_loader(_args(rec, kind, **kw), log=None)
    _put_at_epoch(at2, 2)
    _same(_run(at2, 1)[0], full[2])

    mid = build_train_loader(_args(rec, kind, **kw), log=None)
    _put_at_epoch(mid, 1)
    got = _run(mid, 2, first_skip=2)
    _same(got[0], full[1][2:])
    _same(got[1], full[2])
    assert not [w for w in recwarn if "resetting" in str(w.message)]


@pytest.mark.parametrize("kind", LOADERS)
def test_epoch_stream_does_not_depend_on_workers(rec, kind):
    dali_or_skip(kind)
    a = _run(build_train_loader(_args(rec, kind, workers=1), log=None), 2)
    b = _run(build_train_loader(_args(rec, kind, workers=2), log=None), 2)
    for ea, eb in zip(a, b, strict=True):
        _same(ea, eb)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("kind", LOADERS)
def test_training_resumed_at_epoch_boundary_and_mid_epoch_is_exact(tmp_path, kind):
    """Issue 10's case on a tiny config (CPU, fp32, dropout on): resumed from
    ``epoch_1.pt`` and from a step inside epoch 1, the run ends with the weights of the
    uninterrupted run (with DALI it diverged from the epoch checkpoint)."""
    dali_or_skip(kind)
    from train_util import make_tiny_rec, tiny_argv

    from rwkv_clip.train import checkpoint as ckpt_io
    from rwkv_clip.train import main, parse_args

    data = make_tiny_rec(tmp_path / "data", n=24)
    extra = ["--epochs", "3", "--batch-size", "8", "--dropout", "0.1", "--seed", "5",
             "--save-every-steps", "4", "--loader", kind, "--workers", "1"]
    full = main(parse_args(tiny_argv(tmp_path / "full", data, *extra)))
    assert full["steps"] == 9
    ckdir = tmp_path / "full" / "checkpoints"
    for name, step in (("epoch_1.pt", 3), ("step_4.pt", 4)):
        state = torch.load(ckdir / name, weights_only=True)
        assert state["step"] == step and state["epoch"] == 1
        out = tmp_path / f"resumed-{name}"
        resumed = main(parse_args(tiny_argv(out, data, *extra, "--resume", str(ckdir / name))))
        assert resumed["steps"] == full["steps"]
        assert _max_diff(_weights(resumed["model"]), _weights(full["model"])) < 1e-6, name
        assert _max_diff(state["state_dict"], _weights(full["model"])) > 1e-4  # has teeth
    assert ckpt_io.LATEST
