"""zero_shot.py end to end on a generated image folder and a retrieval JSONL (tiny model),
the JSON schema, the classifier formula, and clear errors for bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
CLASSES = {"red_square": (220, 20, 20), "green_disc": (20, 200, 30), "blue_star": (30, 40, 210)}
TINY = "RWKV_CLIP_tiny"


def make_folder(root: Path, per_class: int = 2) -> Path:
    rng = np.random.default_rng(0)
    for cls, color in CLASSES.items():
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            h, w = 18 + 3 * i, 22 + 2 * i
            img = np.clip(np.array(color) * rng.uniform(0.6, 1.0, (h, w, 1)), 0, 255).astype(np.uint8)
            Image.fromarray(img).save(root / cls / f"img{i}.png")
    return root


def make_jsonl(root: Path, folder: Path) -> Path:
    path = root / "pairs.jsonl"
    with open(path, "w") as f:
        for cls in CLASSES:
            colour, shape = cls.split("_")
            for img in sorted((folder / cls).iterdir()):
                f.write(json.dumps({"image": str(img.relative_to(root)),
                                    "captions": [f"a {colour} {shape}", f"{shape} in {colour}"]}) + "\n")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("zs")
    folder = make_folder(root / "folder")
    (root / "templates.json").write_text(json.dumps(["a photo of a {}.", "a drawing of a {}."]))
    return {"root": root, "folder": folder, "templates": root / "templates.json",
            "jsonl": make_jsonl(root, folder)}


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    from rwkv_clip import create_RWKV_Model, load_model_configs
    torch.manual_seed(7)
    model = create_RWKV_Model(load_model_configs(TINY))
    path = tmp_path_factory.mktemp("w") / "tiny.pt"
    torch.save({"module." + k: v for k, v in model.state_dict().items()}, path)  # as DDP saves
    return path


def cli(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "zero_shot.py", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def check_schema(record, task):
    assert set(record) >= {"dataset", "model", "pretrained", "task", "metrics"}
    assert record["task"] == task
    assert isinstance(record["dataset"], str) and isinstance(record["model"], str)
    assert isinstance(record["pretrained"], str)
    for key, value in record["metrics"].items():
        assert value is None or (isinstance(value, float) and 0.0 <= value <= 1.0), (key, value)


def test_cli_imagefolder_end_to_end(data, tmp_path):
    out = tmp_path / "out"
    r = cli("--config", TINY, "--dataset", "imagefolder", "--data-root", data["folder"],
            "--templates", data["templates"], "--workers", "0", "--device", "cpu",
            "--batch-size", "4", "--output-dir", out)
    assert r.returncode == 0, r.stderr
    record = json.loads((out / "imagefolder_zeroshot_classification.json").read_text())
    check_schema(record, "zeroshot_classification")
    assert set(record["metrics"]) == {"acc1", "acc5", "mean_per_class_recall"}
    assert record["metrics"]["acc5"] is None  # 3 classes
    assert record["num_samples"] == 6 and record["model"] == TINY
    assert record["pretrained"].startswith("none")
    # acc1 of 6 samples is a multiple of 1/6
    assert abs(record["metrics"]["acc1"] * 6 - round(record["metrics"]["acc1"] * 6)) < 1e-9
    assert "Zero-shot classification" in r.stdout and "imagefolder" in r.stdout
    line = (out / "zero_shot_scores.txt").read_text().strip()
    assert float(line) == pytest.approx(100 * record["metrics"]["acc1"], abs=1e-4)


def test_cli_jsonl_retrieval_end_to_end(data, tmp_path):
    r = cli("--config", TINY, "--task", "zeroshot_retrieval", "--retrieval-file", data["jsonl"],
            "--workers", "0", "--device", "cpu", "--output-dir", tmp_path / "scores.txt")
    assert r.returncode == 0, r.stderr
    record = json.loads((tmp_path / "jsonl_zeroshot_retrieval.json").read_text())
    check_schema(record, "zeroshot_retrieval")
    assert set(record["metrics"]) == {f"{d}_retrieval_recall@{k}" for d in ("image", "text")
                                      for k in (1, 5, 10)}
    assert record["num_images"] == 6 and record["num_texts"] == 12
    assert record["metrics"]["image_retrieval_recall@10"] == 1.0  # only 6 images to rank
    for d in ("image", "text"):
        r1, r5, r10 = (record["metrics"][f"{d}_retrieval_recall@{k}"] for k in (1, 5, 10))
        assert r1 <= r5 <= r10
    values = [float(v) for v in (tmp_path / "scores.txt").read_text().strip().split(",")]
    assert len(values) == 6  # original-style line: I2T R@1,5,10 then T2I R@1,5,10
    assert values[0] == pytest.approx(100 * record["metrics"]["text_retrieval_recall@1"], abs=1e-4)


def test_cli_errors_are_one_line(data, tmp_path):
    r = cli("--config", TINY, "--dataset", "cifar10", "--data-root", tmp_path, "--device", "cpu",
            "--output-dir", tmp_path / "o")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()  # the essential on the error line, details below
    assert lines[0].startswith("zero_shot.py: error:") and "cifar10" in lines[0]
    assert all(line.startswith("  ") and "error:" not in line for line in lines[1:])
    assert "cifar-10-batches-py" in r.stderr


def test_help_explains_every_flag():
    from rwkv_clip.eval.cli import build_eval_parser
    parser = build_eval_parser()
    text = parser.format_help()
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in text
        if action.option_strings and action.dest != "help":
            assert action.help, action.option_strings
    for flag in ("--model-weight", "--config", "--dataset", "--data-root", "--templates",
                 "--batch-size", "--workers", "--precision", "--output-dir", "--device", "--task",
                 "--retrieval-file"):
        assert flag in text


# ---------------------------------------------------------------- in-process (fast) checks
def run_main(capsys, *args):
    from zero_shot import main
    rc = main([str(a) for a in args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_one_line_error(rc, err, *needles):
    assert rc != 0
    lines = err.strip().splitlines()  # one error line; details, if any, indented below it
    assert lines[0].startswith("zero_shot.py: error:"), err
    assert all(line.startswith("  ") for line in lines[1:]), err
    for needle in needles:
        assert needle in err, (needle, err)


def test_weights_infer_config_and_load(data, tiny_weights, tmp_path, capsys):
    rc, out, err = run_main(capsys, "--model-weight", tiny_weights, "--dataset", "imagefolder",
                            "--data-root", data["folder"], "--templates", data["templates"],
                            "--workers", "0", "--device", "cpu", "--output-dir", tmp_path)
    assert rc == 0, err
    assert "inferred" in out
    record = json.loads((tmp_path / "imagefolder_zeroshot_classification.json").read_text())
    assert record["model"] == TINY and record["pretrained"] == str(tiny_weights)


def test_checkpoint_not_fitting_config(data, tiny_weights, tmp_path, capsys):
    rc, _, err = run_main(capsys, "--model-weight", tiny_weights, "--config", "RWKV_CLIP_small",
                          "--dataset", "imagefolder", "--data-root", data["folder"],
                          "--device", "cpu", "--output-dir", tmp_path)
    assert_one_line_error(rc, err, "does not fit", "shape mismatches")


def test_other_image_size_resizes_pos_embed(data, tiny_weights, tmp_path, capsys):
    """Weights trained at 16 px evaluated at 32 px: pos_embed is resized on loading."""
    rc, _, err = run_main(capsys, "--model-weight", tiny_weights, "--config", TINY,
                          "--input-size", "32", "--dataset", "imagefolder", "--data-root",
                          data["folder"], "--device", "cpu", "--output-dir", tmp_path)
    assert rc == 0, err


def test_garbage_checkpoint(data, tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    rc, _, err = run_main(capsys, "--model-weight", bad, "--dataset", "imagefolder",
                          "--data-root", data["folder"], "--device", "cpu", "--output-dir", tmp_path)
    assert_one_line_error(rc, err, str(bad))


@pytest.mark.parametrize("workers", [0, 1])
def test_unreadable_image(tmp_path, capsys, workers):
    folder = make_folder(tmp_path / "f", per_class=1)
    (folder / "green_disc" / "broken.png").write_bytes(b"\x89PNG not really")
    rc, _, err = run_main(capsys, "--config", TINY, "--dataset", "imagefolder", "--data-root", folder,
                          "--device", "cpu", "--workers", workers, "--output-dir", tmp_path / "o")
    assert_one_line_error(rc, err, "cannot read image", "broken.png")


def test_empty_class_folder(tmp_path, capsys):
    folder = make_folder(tmp_path / "f", per_class=1)
    (folder / "empty_class").mkdir()
    rc, _, err = run_main(capsys, "--config", TINY, "--dataset", "imagefolder", "--data-root", folder,
                          "--device", "cpu", "--output-dir", tmp_path / "o")
    assert_one_line_error(rc, err, "empty_class", "without images")


def test_unknown_dataset_and_missing_retrieval(tmp_path, capsys):
    rc, _, err = run_main(capsys, "--config", TINY, "--dataset", "notaset", "--device", "cpu",
                          "--data-root", tmp_path, "--output-dir", tmp_path / "o")
    assert_one_line_error(rc, err, "unknown dataset")
    rc, _, err = run_main(capsys, "--config", TINY, "--dataset", "mscoco", "--device", "cpu",
                          "--data-root", tmp_path, "--output-dir", tmp_path / "o")
    assert_one_line_error(rc, err, "coco_karpathy_test.json")
    bad = tmp_path / "x.jsonl"
    bad.write_text(json.dumps({"image": "missing.jpg", "captions": ["a"]}) + "\n")
    rc, _, err = run_main(capsys, "--config", TINY, "--retrieval-file", bad, "--task",
                          "zeroshot_retrieval", "--device", "cpu", "--output-dir", tmp_path / "o")
    assert_one_line_error(rc, err, "missing.jpg", "not found")


def test_classifier_and_logits_follow_the_formula(data):
    """Recompute logits by hand: per class, mean of normalised template features,
    renormalised; logits = 100 * normalised image features @ classifier."""
    from rwkv_clip import create_RWKV_Model, image_transform, load_model_configs, tokenize
    from rwkv_clip.eval.datasets import image_folder_set
    from rwkv_clip.eval.zeroshot import (
        build_classifier,
        classification_logits,
        evaluate_imagefolder,
    )

    torch.manual_seed(3)
    model = create_RWKV_Model(load_model_configs(TINY)).eval()
    templates = ["a photo of a {}.", "a drawing of a {}.", "{}"]
    s = image_folder_set(data["folder"], image_transform(16, is_train=False), templates=templates)
    with torch.no_grad():
        cols = []
        for name in s.classnames:
            e = F.normalize(model.encode_text(tokenize([t.format(name) for t in templates])), dim=-1)
            cols.append(F.normalize(e.mean(0), dim=0))
        expected_w = torch.stack(cols, dim=1)
        imgs = torch.stack([s.dataset[i][0] for i in range(len(s))])
        expected = 100.0 * F.normalize(model.encode_image(imgs), dim=-1) @ expected_w
    w = build_classifier(model, s.classnames, templates, "cpu", batch_size=4)
    torch.testing.assert_close(w, expected_w, rtol=1e-5, atol=1e-6)
    logits, targets = classification_logits(model, s, w, "cpu", batch_size=4)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert targets.tolist() == [0, 0, 1, 1, 2, 2]
    m = evaluate_imagefolder(model, data["folder"], "cpu", batch_size=4, templates=templates)
    assert m["acc1"] == pytest.approx((expected.argmax(1) == targets).double().mean().item())
    assert m["num_samples"] == 6 and m["headline_metric"] == "acc1"
    assert model.training is False


def test_evaluate_imagefolder_restores_train_mode(data):
    from rwkv_clip import create_RWKV_Model, load_model_configs
    from rwkv_clip.eval import evaluate_imagefolder

    model = create_RWKV_Model(load_model_configs(TINY)).train()
    m = evaluate_imagefolder(model, data["folder"], "cpu", batch_size=8,
                             classnames=["red", "green", "blue"], templates=["{}"])
    assert model.training is True
    assert set(m) >= {"acc1", "acc5", "mean_per_class_recall"}
    wrapped = torch.nn.DataParallel(model)  # has .module like DDP; unwrapped by the evaluator
    m2 = evaluate_imagefolder(wrapped, data["folder"], "cpu", batch_size=3, single_process=True,
                              classnames=["red", "green", "blue"], templates=["{}"])
    assert m2 == pytest.approx(m) and model.training is True


@pytest.mark.slow
def test_cli_default_builtin_split(tmp_path):
    """No dataset given: the built-in held-out split (generated once, cached)."""
    r = cli("--config", TINY, "--workers", "0", "--device", "cpu", "--output-dir", tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    record = json.loads((tmp_path / "builtin_zeroshot_classification.json").read_text())
    check_schema(record, "zeroshot_classification")
    assert record["num_samples"] > 0
    r = cli("--config", TINY, "--workers", "0", "--device", "cpu", "--output-dir", tmp_path,
            "--dataset", "builtin_shifted", timeout=600)
    assert r.returncode == 0, r.stderr
    shifted = json.loads((tmp_path / "builtin_shifted_zeroshot_classification.json").read_text())
    check_schema(shifted, "zeroshot_classification")
    assert shifted["num_samples"] == record["num_samples"]


def test_original_script_flags(data, tiny_weights, tmp_path, capsys):
    """The original shell script passes the architecture as flags (no --config); here the
    tiny model's values, plus the flags it passes that we ignore."""
    rc, out, err = run_main(
        capsys, "--pretrained", tiny_weights, "--model-type", "V_T_rwkv", "--model-name", "tiny-flags",
        "--input-size", 16, "--image-depth", 2, "--image-embed-dims", 64, "--image-patch-size", 4,
        "--image-hidden-rate", 1, "--image-num-heads", 2, "--ctx-len", 77, "--vocab-size", 49408,
        "--head-size", 32, "--head-size-divisor", 8, "--n-embd", 64, "--n-layer", 2,
        "--text-initialization", "True", "--dropout", 0.0, "--precision", "tf32",
        "--dataset", "imagefolder", "--data-root", data["folder"], "--templates", data["templates"],
        "--workers", 0, "--device", "cpu", "--output-dir", tmp_path / "zero_shot_imagenet.txt")
    assert rc == 0, err
    record = json.loads((tmp_path / "imagefolder_zeroshot_classification.json").read_text())
    assert record["model"] == "tiny-flags" and record["pretrained"] == str(tiny_weights)
    assert (tmp_path / "zero_shot_imagenet.txt").read_text().count("\n") == 1
    # a wrong architecture flag is caught against the weights
    rc, _, err = run_main(capsys, "--pretrained", tiny_weights, "--config", TINY, "--n-layer", 3,
                          "--dataset", "imagefolder", "--data-root", data["folder"], "--device", "cpu",
                          "--output-dir", tmp_path)
    assert_one_line_error(rc, err, "missing keys", "text_model.blocks.2")


@pytest.mark.slow
def test_torchcompile_gives_the_eager_features(tmp_path):
    """--torchcompile (open_clip's flag) compiles the encoders; their features are eager's."""
    import torch

    from rwkv_clip.distributed import DistInfo
    from rwkv_clip.eval.cli import parse_options
    from rwkv_clip.eval.runner import build_eval_model

    images = torch.randn(2, 3, 32, 32)
    feats = []
    for flags in ([], ["--torchcompile"]):
        opts = parse_options(["--device", "cpu", *flags])
        assert opts.torchcompile == bool(flags)
        model, *_ = build_eval_model(opts, torch.device("cpu"), DistInfo())
        with torch.no_grad():
            feats.append(model.encode_image(images))
    torch.testing.assert_close(feats[0], feats[1], rtol=1e-5, atol=1e-5)


def test_unknown_dataset_lists_every_name_before_building_a_model(capsys):
    """The list comes from the registries (classification sets, retrieval sets, the built-in
    splits), and the error comes before any model is built (no 'model ...' line)."""
    from rwkv_clip.eval.datasets import PAPER_DATASETS
    from rwkv_clip.eval.retrieval import RETRIEVAL_ALIASES

    rc, out, err = run_main(capsys, "--dataset", "cifar10,notaset", "--device", "cpu")
    assert_one_line_error(rc, err, "unknown dataset 'notaset'")
    assert rc == 2 and "model " not in out
    listed = err.split("choose from", 1)[1].strip().split(", ")
    expected = {"builtin", "builtin_shifted", "imagefolder", "jsonl", *PAPER_DATASETS,
                *RETRIEVAL_ALIASES.values()}
    assert set(listed) == expected and len(listed) == len(expected)
    rc, _, err = run_main(capsys, "--dataset", "mscoco,notaset", "--task", "linear_probe")
    assert_one_line_error(rc, err, "unknown dataset 'notaset' for --task linear_probe")


@pytest.mark.parametrize("argv,needle", [
    (["--task", "linear-probe"], "invalid choice: 'linear-probe'"),
    (["--datset", "cifar10"], "unrecognized arguments: --datset cifar10"),
])
def test_argparse_errors_are_one_line_with_a_suggestion(argv, needle, capsys):
    """A mistyped choice or flag name: one line (not the usage block), exit status 2, and
    the close valid name."""
    from rwkv_clip.eval.cli import parse_options

    with pytest.raises(SystemExit) as exc:
        parse_options(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
    assert needle in err
    assert err.rstrip().endswith("did you mean " + ("linear_probe" if "task" in argv[0]
                                                    else "--dataset") + "? (zero_shot.py "
                                 "--help lists every flag)"), err
