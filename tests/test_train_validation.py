"""Validation during training (loss, recall and ranks on held-out pairs, one process and two
gloo ranks) and experiment tracking (TensorBoard and an offline wandb run read back)."""
import json
import os
import socket
import struct
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from train_util import make_tiny_rec, tiny_argv

from rwkv_clip.loss import ClipLoss
from rwkv_clip.train.validation import (
    batched_contrastive_loss,
    clip_metrics,
    ranks,
    read_results,
)


def scores_with_ranks(true_ranks):
    """A square score matrix whose diagonal entry of row i has 0-based rank true_ranks[i]."""
    n = len(true_ranks)
    s = torch.zeros(n, n)
    for i, r in enumerate(true_ranks):
        others = [j for j in range(n) if j != i]
        for pos, j in enumerate(others):  # descending scores 10, 9, ... in column order
            s[i, j] = 10.0 - pos
        s[i, i] = 10.0 - r + 0.5  # between the (r-1)-th and r-th of the others
    return s


def test_recall_and_ranks_on_known_ranks():
    true = [0, 1, 4, 9, 0, 2, 5, 11, 0, 3, 6, 7]
    s = scores_with_ranks(true)
    assert ranks(s).tolist() == true
    m = clip_metrics(s, torch.eye(12))  # logits = s @ I^T = s
    assert m["image_to_text_R@1"] == pytest.approx(3 / 12)
    assert m["image_to_text_R@5"] == pytest.approx(7 / 12)
    assert m["image_to_text_R@10"] == pytest.approx(11 / 12)
    assert m["image_to_text_mean_rank"] == pytest.approx(sum(true) / 12 + 1)
    assert m["image_to_text_median_rank"] == 4.0  # floor(median(0-based ranks) = 3.5) + 1
    m_t = clip_metrics(torch.eye(12), s)  # the other direction reads the transpose
    assert m_t["text_to_image_R@5"] == pytest.approx(7 / 12)


def test_ties_rank_the_lower_index_first():
    s = torch.ones(3, 3)  # every score equal: rank of the diagonal = its row index
    assert ranks(s).tolist() == [0, 1, 2]


def test_loss_equals_clip_loss_per_batch():
    g = torch.Generator().manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(10, 8, generator=g), dim=-1)
    txt = torch.nn.functional.normalize(torch.randn(10, 8, generator=g), dim=-1)
    loss = ClipLoss()
    whole = loss(img, txt, torch.tensor(7.0)).item()
    assert batched_contrastive_loss(img, txt, 7.0, 64) == pytest.approx(whole, rel=1e-6)
    halves = (4 * loss(img[:4], txt[:4], torch.tensor(7.0)).item()
              + 6 * loss(img[4:], txt[4:], torch.tensor(7.0)).item()) / 10
    assert batched_contrastive_loss(img, txt, 7.0, 4) != pytest.approx(halves)  # 4+4+2
    assert batched_contrastive_loss(img, txt, 7.0, 6) == pytest.approx(
        (6 * loss(img[:6], txt[:6], torch.tensor(7.0)).item()
         + 4 * loss(img[6:], txt[6:], torch.tensor(7.0)).item()) / 10, rel=1e-6)


# ----------------------------------------------------------------------------- one vs two ranks

def _validate(prefix: str, rank: int, world: int):
    from types import SimpleNamespace

    from rwkv_clip import create_RWKV_Model, load_model_configs
    from rwkv_clip.distributed import DistInfo
    from rwkv_clip.train.validation import build_val_loader, evaluate_pairs

    torch.manual_seed(0)
    model = create_RWKV_Model(load_model_configs("RWKV_CLIP_tiny"))
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"),
                    backend="gloo" if world > 1 else None)
    args = SimpleNamespace(batch_size=4, input_size=16, workers=0, seed=0, data_format="rec")
    loader = build_val_loader(prefix, "rec", args, info)
    return evaluate_pairs(model, loader, info, "fp32", batch_size=4)


def _worker(rank, world, port, prefix, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        metrics = _validate(prefix, rank, world)
        Path(out, f"{rank}.json").write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_give_the_one_process_numbers(tmp_path):
    prefix = make_tiny_rec(tmp_path, n=11)  # odd: uneven shards
    one = _validate(prefix, 0, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, prefix, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        two = json.loads((tmp_path / f"{rank}.json").read_text())
        assert two.keys() == one.keys() and two["num_samples"] == 11
        for key, value in one.items():
            assert two[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


# ----------------------------------------------------------------------------- a training run

def wandb_records(run_file: Path):
    """The protobuf ``Record``s of a .wandb file, in wandb's log format: a 7-byte header
    (':W&B', magic, version), then 32 KiB blocks of chunks, each behind a 7-byte header
    (crc32, length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail shorter
    than a header is padding."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, payload, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        payload = chunk if kind in (1, 2) else payload + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(payload)
            yield rec


def wandb_history(run_file: Path) -> list[dict]:
    return [{_key(i): json.loads(i.value_json) for i in rec.history.item}
            for rec in wandb_records(run_file) if rec.WhichOneof("record_type") == "history"]


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_config(run_file: Path) -> dict:
    """The config the run started with (its ``run`` record)."""
    for rec in wandb_records(run_file):
        if rec.WhichOneof("record_type") == "run":
            return {_key(i): json.loads(i.value_json) for i in rec.run.config.update}
    return {}


@pytest.mark.slow
def test_training_validates_and_reports_to_tensorboard_and_offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rwkv_clip.train import main, parse_args

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    prefix = make_tiny_rec(tmp_path, n=24)
    out = tmp_path / "run"
    argv = tiny_argv(out, prefix, "--val-data", prefix, "--val-frequency", "1", "--epochs", "2",
                     "--tensorboard", "True", "--report-to", "tensorboard,wandb",
                     "--wandb-project-name", "test-project", "--name", "tiny-val")
    result = main(parse_args(argv))

    val = result["validation"]
    assert [v["epoch"] for v in val] == [1, 2] and all(v["num_samples"] == 24 for v in val)
    assert read_results(out) == val  # results.jsonl holds the same records
    log = (out / "training.log").read_text()
    assert log.count("validation (epoch ") == 2 and "image->text R@1/5/10" in log

    tb = EventAccumulator(str(out / "tensorboard"))
    tb.Reload()
    tb_loss = [(e.step, e.value) for e in tb.Scalars("loss")]
    assert [e.value for e in tb.Scalars("val/clip_val_loss")] == pytest.approx(
        [v["clip_val_loss"] for v in val])

    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    rows = wandb_history(runs[0])
    wb_loss = [(r["_step"], r["loss"]) for r in rows if "loss" in r]
    assert wb_loss == [(s, pytest.approx(v)) for s, v in tb_loss] and len(wb_loss) == 6
    wb_val = [r["val/clip_val_loss"] for r in rows if "val/clip_val_loss" in r]
    assert wb_val == pytest.approx([v["clip_val_loss"] for v in val])
    config = wandb_config(runs[0])
    assert config["name"] == "tiny-val" and config["batch_size"] == 8


def test_report_draws_the_validation_panel(tmp_path):
    """results.jsonl adds the recall panel (a fourth column) to report.png."""
    from rwkv_clip.report import write_report

    out = tmp_path / "run"
    out.mkdir()
    (out / "training.log").write_text(
        "2026-01-01 00:00:00 rank 0/1 on cpu (backend none); model settings from x\n"
        "2026-01-01 00:00:01 epoch 1/1 step 5/10 loss 2.00 lr 1e-3 5 pairs/s eta 0:01\n"
        "2026-01-01 00:00:02 epoch 1/1 step 10/10 loss 1.50 lr 1e-4 5 pairs/s eta 0:00\n")
    metrics = {"clip_val_loss": 1.7, "num_samples": 4,
               **{f"{d}_{k}": 0.5 for d in ("image_to_text", "text_to_image")
                  for k in ("R@1", "R@5", "R@10", "mean_rank", "median_rank")}}
    (out / "results.jsonl").write_text("".join(
        json.dumps({"epoch": e, "step": 5 * e, "start_step": 0, **metrics}) + "\n"
        for e in (1, 2)))
    from PIL import Image

    write_report(out)
    with Image.open(out / "report.png") as im:
        with_validation = im.size
    (out / "results.jsonl").unlink()
    write_report(out)
    with Image.open(out / "report.png") as im:
        without = im.size
    assert with_validation[0] == without[0] * 4 // 3  # a fourth panel: the recall
    assert with_validation[1] == without[1]


def test_results_of_a_fresh_run_and_a_resume(tmp_path):
    def rec(step, start):
        return json.dumps({"step": step, "start_step": start, "clip_val_loss": step}) + "\n"
    (tmp_path / "results.jsonl").write_text(
        rec(5, 0) + rec(10, 0) + rec(15, 0)      # an old run
        + rec(5, 0) + rec(10, 0) + rec(15, 0)    # a fresh run in the same folder
        + rec(10, 7) + rec(15, 7))               # resumed from step 7 of it
    assert [(r["step"], r["start_step"]) for r in read_results(tmp_path)] == [
        (5, 0), (10, 7), (15, 7)]


@pytest.mark.parametrize("extra, message", [
    (["--report-to", "mlflow"], "--report-to 'mlflow': unknown target 'mlflow'"),
    (["--val-frequency", "-1"], "--val-frequency must be >= 0"),
])
def test_bad_flags_are_one_line(extra, message, tmp_path, capsys):
    from rwkv_clip.train import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(tiny_argv(tmp_path, "x", *extra))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_missing_wandb_is_one_line_only_when_asked_for(tmp_path, monkeypatch, capsys):
    from rwkv_clip.train import parse_args

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    parse_args(tiny_argv(tmp_path, "x"))  # not asked for: no error
    with pytest.raises(SystemExit) as exc:
        parse_args(tiny_argv(tmp_path, "x", "--report-to", "wandb"))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["train.py: error: --report-to wandb needs the wandb package: pip install wandb"]


def test_name_names_the_run_folder(tmp_path, monkeypatch):
    from rwkv_clip.train import parse_args

    monkeypatch.chdir(tmp_path)
    argv = [a for a in tiny_argv("runs/default", "x") if a != "--output" and a != "runs/default"]
    args = parse_args([*argv, "--name", "exp1"])
    assert args.output == os.path.join("runs", "exp1") and args.name == "exp1"
    args = parse_args([*argv, "--name", "exp1", "--output", "elsewhere"])
    assert args.output == "elsewhere" and args.name == "exp1"
    assert parse_args(argv).name == "default"
