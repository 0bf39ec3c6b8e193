"""rwkv_clip.report: the run picture, its log parser and its predictions."""
import json

import pytest
import torch
from PIL import Image
from train_util import tiny_model

from rwkv_clip.errors import EvalError
from rwkv_clip.report import (
    TrainingCurves,
    compute_predictions,
    confusion_matrix,
    main,
    parse_training_log,
    pick_grid_samples,
    write_report,
)
from rwkv_clip.train.logger import SpeedLogger, close_logging, setup_logging


def _write_log(run_dir, fmt, steps, total=12, per_epoch=4, losses=None, resumed_at=None,
               zero_shot=()):
    """A training.log written by the real logger: setup lines, progress lines and the
    zero-shot lines as the training loop words them."""
    log = setup_logging(str(run_dir), 0, fmt)
    log.info("rank 0/1 on cpu (backend none); model settings from x.json")
    if resumed_at is not None:
        log.info(f"resumed from {run_dir}/checkpoints/epoch_1.pt: step {resumed_at}, epoch 1, "
                 "batch 0 of that epoch")
    log.info(f"{per_epoch} batches/epoch/rank, {per_epoch} optimizer steps/epoch, {total} "
             "steps in all; global batch 8 (8 x 1 accumulation [exact] x 1 rank(s))")
    speed = SpeedLogger(1, total, 1, start_step=steps[0] - 1, fmt=fmt,
                        steps_per_epoch=per_epoch)
    for i, step in enumerate(steps):
        loss = losses[i] if losses else 5.0 - step / 10
        log.info(speed.update(step=step, loss=loss, samples=8, lr=1e-3 / step, amp_scale=1))
        for label, top1 in zero_shot:
            if label == f"epoch {step // per_epoch}" and step % per_epoch == 0:
                log.info(f"zero-shot ({label}) on /z: top-1 {top1:.1f}%, top-5 99.0% "
                         "(chance 3.3%: 30 classes)")
                # the built-in set's shifted split, as the training loop words it
                log.info(f"zero-shot ({label}, shifted) on /s: top-1 {top1 - 10:.1f}%, top-5 "
                         "80.0% (chance 3.3%: 30 classes)")
    close_logging()


@pytest.mark.parametrize("fmt", ["plain", "original"])
def test_log_round_trip(tmp_path, fmt):
    _write_log(tmp_path, fmt, list(range(1, 13)), zero_shot=[("epoch 1", 20.0),
                                                             ("epoch 3", 91.3)])
    c = parse_training_log(tmp_path / "training.log")
    assert c.steps == list(range(1, 13))
    assert c.loss == pytest.approx([5.0 - s / 10 for s in c.steps], abs=6e-3)
    assert c.lr == pytest.approx([1e-3 / s for s in c.steps], rel=0.06)
    assert c.steps_per_epoch == 4 and c.total_steps == 12
    assert [(z[0], z[1], z[2]) for z in c.zero_shot] == [(4, "epoch 1", 20.0),
                                                         (12, "epoch 3", 91.3)]
    assert [(z[0], z[1], z[2], z[3]) for z in c.zero_shot_shifted] == [
        (4, "epoch 1", 10.0, 80.0), (12, "epoch 3", 81.3, 80.0)]  # their own curve
    assert c.zero_shot_dir == "/z"  # the in-distribution folder, not the shifted one


def test_fresh_rerun_replaces_and_resume_continues(tmp_path):
    _write_log(tmp_path, "plain", list(range(1, 9)), losses=[9.0] * 8)
    _write_log(tmp_path, "plain", list(range(1, 7)))  # a new run in the same folder
    c = parse_training_log(tmp_path / "training.log")
    assert c.steps == list(range(1, 7)) and 9.0 not in c.loss
    _write_log(tmp_path, "plain", list(range(5, 13)), resumed_at=4)  # resumed from step 4
    c = parse_training_log(tmp_path / "training.log")
    assert c.steps == list(range(1, 13))
    assert c.loss == pytest.approx([5.0 - s / 10 for s in c.steps], abs=6e-3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from rwkv_clip.data import ensure_builtin_dataset
    ds = ensure_builtin_dataset(root=str(tmp_path_factory.mktemp("bi")), num_train=4,
                                num_val=0, zeroshot_per_class=2)
    return ds.zeroshot_dir


def test_predictions_agree_with_the_evaluator(folder):
    from rwkv_clip.eval.zeroshot import evaluate_imagefolder

    model = tiny_model()
    pred = compute_predictions(model, folder)
    metrics = evaluate_imagefolder(model, folder, single_process=True)
    assert len(pred["samples"]) == 60 and len(pred["classnames"]) == 30
    assert pred["acc1"] == pytest.approx(metrics["acc1"])
    top3_hit = sum(s["target"] in s["top3"] for s in pred["samples"]) / 60
    assert top3_hit >= pred["acc1"]
    for s in pred["samples"]:
        assert len(set(s["top3"])) == 3 and s["top3_prob"] == sorted(s["top3_prob"],
                                                                     reverse=True)
    counts = confusion_matrix(pred)
    assert sum(map(sum, counts)) == 60
    assert sum(counts[i][i] for i in range(30)) == round(pred["acc1"] * 60)
    assert all(sum(row) == 2 for row in counts)  # two images per class


def test_grid_shows_mistakes_first_then_correct_ones():
    names = [f"c{i}" for i in range(5)]
    samples = [{"path": "x", "target": i % 5, "top3": [(i % 5) if i % 3 else (i + 1) % 5, 0, 1],
                "top3_prob": [0.5, 0.3, 0.2]} for i in range(40)]
    picked = pick_grid_samples({"classnames": names, "samples": samples}, k=16)
    wrong = [s["top3"][0] != s["target"] for s in picked]
    assert len(picked) == 16 and wrong == [True] * 8 + [False] * 8
    assert len({id(s) for s in picked}) == 16


def _png_size(path):
    with Image.open(path) as im:
        assert im.format == "PNG"
        return im.size


def test_report_at_the_end_of_training_and_redrawn_from_the_run(tmp_path, folder, capsys):
    run = tmp_path / "run"
    _write_log(run, "plain", list(range(1, 13)), zero_shot=[("epoch 3", 50.0)])
    model = tiny_model()
    path = write_report(run, model=model, zero_shot_dir=folder)
    assert path == run / "report.png" and _png_size(path)[1] > 500  # curves + predictions
    saved = json.loads((run / "predictions.json").read_text())
    assert saved["folder"] == folder and len(saved["samples"]) == 60
    path.unlink()
    assert main([str(run)]) == 0  # from training.log + predictions.json
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"report: {run / 'report.png'}"
    assert (run / "report.png").is_file()
    # no predictions.json: the newest checkpoint is evaluated on the folder in the log
    (run / "predictions.json").unlink()
    (run / "checkpoints").mkdir()
    torch.save({"state_dict": model.state_dict()}, run / "checkpoints" / "epoch_latest.pt")
    _write_log(run, "plain", list(range(1, 13)),
               zero_shot=[("epoch 3", 50.0)])  # same run again, now naming the folder
    (run / "training.log").write_text((run / "training.log").read_text().replace("/z", folder))
    out = tmp_path / "again.png"
    assert main([str(run), "--output", str(out)]) == 0
    again = json.loads((run / "predictions.json").read_text())
    assert again["checkpoint"].endswith("epoch_latest.pt")
    assert [s["top3"] for s in again["samples"]] == [s["top3"] for s in saved["samples"]]
    assert _png_size(out) == _png_size(run / "report.png")


def test_curves_only_without_a_zero_shot_folder(tmp_path):
    _write_log(tmp_path, "original", [1, 2, 3], total=3)
    path = write_report(tmp_path)
    assert _png_size(path)[1] < 500  # one row of panels
    assert not (tmp_path / "predictions.json").exists()


def test_errors_name_the_run_folder(tmp_path, capsys):
    from rwkv_clip.report import _cli
    with pytest.raises(EvalError, match="no training.log"):
        write_report(tmp_path / "missing")
    _write_log(tmp_path, "plain", [1, 2], total=2, zero_shot=())
    with pytest.raises(EvalError, match="no predictions.json and no checkpoint"):
        write_report(tmp_path, zero_shot_dir=str(tmp_path), recompute=True)
    import sys
    argv, sys.argv = sys.argv, ["report", str(tmp_path / "missing")]
    try:
        assert _cli() == 2
    finally:
        sys.argv = argv
    assert "error: " in capsys.readouterr().err
    assert isinstance(TrainingCurves(), TrainingCurves)
