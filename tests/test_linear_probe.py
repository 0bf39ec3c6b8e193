"""Linear probe: the logistic regression, the regularisation search, the splits, the cached
features, the built-in set and the zero_shot.py task."""
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from rwkv_clip.errors import EvalError
from rwkv_clip.eval.linear_probe import (
    LAMBDAS,
    Features,
    linear_probe,
    search_grid,
    search_regularization,
    select_fewshot,
    split_train_val,
)

pytest.importorskip("sklearn")

TINY = "RWKV_CLIP_tiny"


def clusters(n_per_class: int, num_classes: int, dim: int, spread: float, seed: int) -> Features:
    """Unit-norm features around one far-apart centre per class."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.eye(dim)[:num_classes] * 4
    targets = torch.arange(num_classes).repeat_interleave(n_per_class)
    x = centres[targets] + spread * torch.randn(len(targets), dim, generator=g)
    return Features(torch.nn.functional.normalize(x, dim=-1), targets)


def test_separable_features_reach_100_percent():
    train, test = clusters(30, 6, 8, 0.3, 0), clusters(10, 6, 8, 0.3, 1)
    m = linear_probe(train, test, num_classes=6, seed=0)
    assert m["lp_acc1"] == 1.0 and m["lp_acc5"] == 1.0 and m["lp_mean_per_class_recall"] == 1.0
    assert m["val_acc1"] == 1.0 and m["C"] == pytest.approx(1 / m["l2_lambda"])
    assert m["num_train"] == 180 and m["num_samples"] == 60


def test_overlapping_classes_are_not_separated():
    """The same code on features that carry no class information: near chance."""
    g = torch.Generator().manual_seed(0)
    train = Features(torch.randn(300, 8, generator=g), torch.arange(3).repeat(100))
    test = Features(torch.randn(300, 8, generator=g), torch.arange(3).repeat(100))
    m = linear_probe(train, test, num_classes=3, seed=0)
    assert m["lp_acc1"] < 0.45 and m["lp_acc5"] is None


@pytest.mark.parametrize("peak", [0, 23, 48, 71, 96])
def test_search_finds_the_peak_of_a_unimodal_score(peak):
    calls = []

    def score(i):
        calls.append(i)
        return 1.0 - abs(i - peak) / 100

    best, tried = search_grid(score, len(LAMBDAS))
    assert best == peak
    assert len(calls) == len(set(calls)) == len(tried) < 20  # no index is fitted twice


def test_search_prefers_the_stronger_regularisation_on_a_tie():
    best, _ = search_grid(lambda i: 1.0 if 30 <= i <= 60 else 0.5, len(LAMBDAS))
    assert best == 60


def test_search_on_real_fits_picks_the_best_of_the_values_it_tries():
    """With real fits: the chosen value scores the best held-out top-1 of those tried, the
    coarse pass spans the whole range, and the strongest L2 underfits: its weights are ~0,
    so the (unpenalised) intercept of the majority class decides everywhere."""
    big = clusters(60, 3, 6, 0.3, 0)
    keep = torch.cat([torch.arange(60), torch.arange(60, 70), torch.arange(120, 130)])
    train, val = big.take(keep), clusters(10, 3, 6, 0.3, 1)
    lam, tried = search_regularization(train, val, 3, lambdas=LAMBDAS)
    assert tried[lam] == max(tried.values())
    assert min(tried) == LAMBDAS[0] and max(tried) == LAMBDAS[-1]  # the whole range, coarse
    assert tried[LAMBDAS[-1]] == pytest.approx(1 / 3)  # class 0 everywhere
    assert lam < LAMBDAS[-1]


def test_split_is_stratified_and_seeded():
    targets = torch.tensor([0] * 10 + [1] * 5 + [2] * 1)
    fit, val = split_train_val(targets, 0.2, seed=3)
    assert sorted(fit.tolist() + val.tolist()) == list(range(16))
    assert torch.bincount(targets[val], minlength=3).tolist() == [2, 1, 0]  # class 2 kept
    assert torch.equal(split_train_val(targets, 0.2, seed=3)[1], val)
    assert not torch.equal(split_train_val(targets, 0.5, seed=4)[1], split_train_val(targets, 0.5, seed=5)[1])


def test_fewshot_takes_k_per_class_seeded():
    targets = torch.arange(4).repeat(10)
    idx = select_fewshot(targets, 3, seed=0)
    assert torch.bincount(targets[idx]).tolist() == [3, 3, 3, 3]
    assert torch.equal(idx, select_fewshot(targets, 3, seed=0))
    assert not torch.equal(idx, select_fewshot(targets, 3, seed=1))
    with pytest.raises(EvalError, match="too few training samples"):
        select_fewshot(targets, 11, seed=0)


def test_fewshot_probe_refits_on_k_shots_only():
    train, test = clusters(30, 4, 8, 0.3, 0), clusters(10, 4, 8, 0.3, 1)
    m = linear_probe(train, test, num_classes=4, fewshot_k=2, seed=0)
    assert m["num_train"] == 8 and m["fewshot_k"] == 2 and m["lp_acc1"] > 0.9


def test_two_class_probe_and_address_free_cache_keys():
    from rwkv_clip.eval.feature_cache import describe_transform

    train, test = clusters(10, 2, 4, 0.2, 0), clusters(5, 2, 4, 0.2, 1)
    assert linear_probe(train, test, num_classes=2)["lp_acc1"] == 1.0
    assert describe_transform(lambda x: x).startswith("<function ")
    assert "0x" not in describe_transform(lambda x: x)


def test_missing_scikit_learn_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "sklearn.linear_model", None)
    train = clusters(5, 2, 4, 0.1, 0)
    with pytest.raises(EvalError, match="needs scikit-learn: pip install scikit-learn"):
        linear_probe(train, train, 2)


# ----------------------------------------------------------------------------- with a model

def _tiny_model(seed=0):
    from rwkv_clip import create_RWKV_Model, load_model_configs

    torch.manual_seed(seed)
    return create_RWKV_Model(load_model_configs(TINY)).eval()


@pytest.fixture(scope="module")
def small_builtin(tmp_path_factory):
    from rwkv_clip.data import ensure_builtin_dataset

    return ensure_builtin_dataset(root=str(tmp_path_factory.mktemp("bi")), num_train=360,
                                  num_val=0, zeroshot_per_class=4)


def test_builtin_probe_labels_agree_with_the_captions(small_builtin):
    from rwkv_clip.eval.probe_data import builtin_splits

    train, test = builtin_splits(None, small_builtin)
    assert train.classnames == test.classnames and len(train) == 360
    captions = [json.loads(line) for line in open(small_builtin.train_prefix + ".captions.jsonl")]
    for i in (0, 7, 359):
        _, label = train.dataset[i]
        key = train.dataset.reader.keys[i]
        assert captions[key]["raw"].endswith(train.classnames[label])


@pytest.mark.slow
def test_builtin_probe_beats_zero_shot_and_caches_features(small_builtin, tmp_path):
    from rwkv_clip.eval.linear_probe import evaluate_linear_probe
    from rwkv_clip.eval.zeroshot import evaluate_imagefolder

    model = _tiny_model()
    lines = []
    kw = dict(dataset="builtin", data_root=None, input_size=16, device="cpu", batch_size=64,
              feature_dir=tmp_path, builtin=small_builtin, log=lines.append)
    m = evaluate_linear_probe(model, **kw)
    zs = evaluate_imagefolder(model, small_builtin.zeroshot_dir, input_size=16)
    assert m["lp_acc1"] > zs["acc1"] + 0.1 and m["lp_acc1"] > 3 / 30  # chance: 1/30
    assert len(list(tmp_path.glob("builtin_*.pt"))) == 2
    lines.clear()
    again = evaluate_linear_probe(model, **kw)
    assert sum("cached features" in line for line in lines) == 2
    assert again == m  # seeded: the same result from the cache
    evaluate_linear_probe(_tiny_model(seed=1), **kw)  # other weights: other files
    assert len(list(tmp_path.glob("builtin_*.pt"))) == 4


def _image_folder(root, per_class):
    colours = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
    rng = np.random.default_rng(len(str(root)))
    for name, rgb in colours.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            img = np.clip(np.array(rgb) + rng.integers(-20, 20, (16, 16, 3)), 0, 255)
            Image.fromarray(img.astype(np.uint8)).save(root / name / f"{i}.png")


def test_zero_shot_py_linear_probe_on_an_image_folder(tmp_path, capsys):
    from rwkv_clip.eval.cli import zero_shot_main

    _image_folder(tmp_path / "set" / "train", 12)
    _image_folder(tmp_path / "set" / "test", 4)
    argv = ["--config", TINY, "--task", "linear_probe", "--dataset", "imagefolder",
            "--data-root", str(tmp_path / "set"), "--fewshot-k", "5", "--output-dir",
            str(tmp_path / "out"), "--feature-root", str(tmp_path / "feat"), "--workers", "0"]
    assert zero_shot_main(argv) == 0
    record = json.loads((tmp_path / "out" / "imagefolder_linear_probe.json").read_text())
    assert record["task"] == "linear_probe" and record["num_train"] == 15
    m = record["metrics"]
    assert set(m) >= {"lp_acc1", "lp_acc5", "lp_mean_per_class_recall", "C", "fewshot_k"}
    assert m["lp_acc1"] == 1.0 and m["lp_acc5"] is None and math.isfinite(m["C"])
    assert "Linear probe (%)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--task", "linear_probe", "--fewshot-k", "0"], "--fewshot-k must be -1"),
    (["--task", "linear_probe", "--val-proportion", "1.5"], "--val-proportion must lie in"),
    (["--task", "linear_probe", "--dataset", "imagefolder", "--data-root", "nowhere"],
     "expected nowhere/train/<class>/"),
])
def test_bad_linear_probe_flags_are_one_line(argv, message, capsys, tmp_path):
    from rwkv_clip.eval.cli import zero_shot_main

    assert zero_shot_main(["--config", TINY, "--output-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_too_large_fewshot_k_fails_before_encoding_and_names_a_k_that_fits(tmp_path, capsys,
                                                                           monkeypatch):
    """12 train images per class, 20% held out: 10 per class remain to draw from; k=11 is
    refused before any image is encoded (the encoder is never called) and k=10 is named."""
    from rwkv_clip.eval import common
    from rwkv_clip.eval.cli import zero_shot_main

    def no_encoding(*args, **kwargs):
        raise AssertionError("images were encoded before the --fewshot-k check")

    monkeypatch.setattr(common, "encode_image_shard", no_encoding)
    _image_folder(tmp_path / "set" / "train", 12)
    _image_folder(tmp_path / "set" / "test", 2)
    argv = ["--config", TINY, "--task", "linear_probe", "--dataset", "imagefolder",
            "--data-root", str(tmp_path / "set"), "--fewshot-k", "11", "--output-dir",
            str(tmp_path / "out"), "--feature-root", str(tmp_path / "feat")]
    assert zero_shot_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--fewshot-k 11: too few training samples" in err[0], err
    assert "blue: 10" in err[0] and err[0].endswith("use --fewshot-k 10 or less"), err
    with pytest.raises(EvalError, match="use --fewshot-k 10 or less"):
        select_fewshot(torch.arange(3).repeat(10), 11, seed=0)


def test_dataset_targets_read_without_decoding(small_builtin, tmp_path):
    from rwkv_clip.eval.datasets import image_folder_set
    from rwkv_clip.eval.probe_data import builtin_splits, dataset_targets

    train, _ = builtin_splits(None, small_builtin)
    targets = dataset_targets(train.dataset)
    assert targets is not None and targets.tolist()[:3] == [train.dataset[i][1] for i in range(3)]
    _image_folder(tmp_path / "f", 2)
    folder = image_folder_set(tmp_path / "f", None)
    assert dataset_targets(folder.dataset).tolist() == [folder.dataset[i][1] for i in range(6)]


def test_long_encodings_say_how_long_and_show_progress(monkeypatch):
    """After the first batch: the estimate for the whole set; then a line every 10%; a set
    estimated under the threshold stays quiet."""
    from rwkv_clip.eval import common

    clock = iter(float(t) for t in range(100))  # one second per call: per batch of 10
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))
    lines: list[str] = []
    progress = common.ProgressLines(lines.append, "encoding", total=95, min_seconds=5)
    for done in (10, 20, 25, 30, 40, 50, 60, 70, 80, 90, 95):
        progress.update(done, first=done == 10)
    assert lines[0] == ("encoding: 95 images, about 10 s on this machine (10 images/s on "
                        "the first batch)")
    assert lines[1] == "encoding: 20/95 images (21%), about 8 s left"
    assert [line.split("(")[1].split(")")[0] for line in lines[2:]] == [
        "31%", "42%", "52%", "63%", "73%", "84%", "94%"]  # 25 (26%) skipped; 95: done
    quiet: list[str] = []
    short = common.ProgressLines(quiet.append, "encoding", total=100, min_seconds=1000)
    short.update(10, first=True)
    short.update(50)
    assert quiet == []
