"""The command-line tools as a new user meets them: each succeeds where the docs say it
does, and each failure is a message that points at the fix (first line the essential,
exit status 2, no traceback)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HAS_CXX = shutil.which("g++") is not None or shutil.which("c++") is not None


def run(args: list[str], cwd: Path | None = None, env: dict | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, HF_HUB_OFFLINE="1",
                    PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def assert_user_error(res: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit 2, no traceback, and the first stderr line holding ``error:`` has every
    fragment; returns that message (the error line and the lines after it)."""
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    lines = res.stderr.splitlines()
    first = next(i for i, ln in enumerate(lines) if "error:" in ln)
    message = "\n".join(lines[first:])
    for fragment in fragments:
        assert fragment in message, message
    return message


# ------------------------------------------------------------ python -m rwkv_clip.ops build
@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
def test_ops_build_success_prints_what_it_built():
    res = run(["-m", "rwkv_clip.ops", "build", "--no-cuda"])
    assert res.returncode == 0, res.stdout + res.stderr
    ok = [ln for ln in res.stdout.splitlines() if ln.startswith("[ok] cpu kernel")]
    assert len(ok) == 1, res.stdout
    built = Path(ok[0].split(" -> ", 1)[1].rsplit(" (", 1)[0])
    assert built.is_file() and built.suffix == ".so", ok[0]
    assert "[skipped] CUDA kernels: --no-cuda" in res.stdout
    assert res.stdout.rstrip().endswith("done")


# ------------------------------------------------------- errors from DataLoader workers
TINY_CONFIG = str(REPO / "model_config" / "RWKV_CLIP_tiny.json")


def tiny_train(data: str, out: Path, *extra: str) -> list[str]:
    return ["train.py", "--config", TINY_CONFIG, "--train-data", data, "--output", str(out),
            "--device", "cpu", "--batch-size", "2", "--epochs", "1", "--precision", "fp32",
            "--progress", "False", "--final-zero-shot", "False", "--zero-shot-every", "0",
            "--tensorboard", "False", *extra]


def png(colour=(200, 30, 30), size=24) -> bytes:
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


def test_parquet_junk_row_through_workers_is_one_data_error(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    images = [png() for _ in range(3)] + [b"not an image at all"]
    pq.write_table(pa.table({"jpg": images, "caption": [f"a red square {i}" for i in range(4)]}),
                   tmp_path / "bad.parquet")
    res = run(tiny_train(str(tmp_path / "bad.parquet"), tmp_path / "run", "--data-format",
                         "parquet", "--workers", "1", "--batch-size", "4"))
    msg = assert_user_error(res, "bad.parquet", "row 3")
    first = msg.splitlines()[0]
    assert first.startswith("train.py: error: ") and "DataLoader worker" not in msg, msg


# ------------------------------------------------------------- where evaluation results go
@pytest.mark.parametrize("name, folder", [
    ("hf-hub:Kaichengalex/RWKV-CLIP-B32-YFCC15M", "Kaichengalex_RWKV-CLIP-B32-YFCC15M"),
    ("hf-hub:Owner/Repo/model.safetensors@v1", "Owner_Repo_model.safetensors_v1"),
    ("RWKV-CLIP-B32:yfcc15m", "RWKV-CLIP-B32_yfcc15m"),
])
def test_results_of_weights_by_name_go_to_one_plain_folder(name, folder, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from rwkv_clip.eval.runner import output_paths
    monkeypatch.chdir(tmp_path)
    opts = SimpleNamespace(model_weight=None, pretrained=name, output_dir=None, score_file=None)
    json_dir, score = output_paths(opts)
    assert json_dir == Path("runs") / "pretrained" / folder / "eval_results"
    assert score.parent == json_dir and not any(":" in part for part in json_dir.parts)
    # a local file given as --pretrained still keeps its results beside it
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "model.pt").write_bytes(b"")
    opts.pretrained = "w/model.pt"
    assert output_paths(opts)[0].resolve() == (tmp_path / "w" / "eval_results").resolve()


# -------------------------------------------------------------- train.py --pretrained
@pytest.mark.parametrize("name, config", [
    ("RWKV-CLIP-B32:yfcc15m", "RWKV_CLIP_B32"),
    ("hf-hub:Kaichengalex/RWKV-CLIP-B16-LAION10M", "RWKV_CLIP_B16"),
])
def test_train_pretrained_name_takes_its_config(name, config):
    import json

    from rwkv_clip.train.args import parse_args
    args = parse_args(["--pretrained", name])
    shipped = json.loads((REPO / "model_config" / f"{config}.json").read_text())
    assert args.config_source.startswith(str(REPO / "model_config" / f"{config}.json"))
    for key in ("n_embd", "n_layer", "ctx_len", "image_patch_size", "input_size"):
        assert args.model_config[key] == shipped[key], key
    # an explicit --config still wins
    assert parse_args(["--pretrained", name, "--config", "RWKV_CLIP_tiny"]).n_embd != shipped["n_embd"]


def make_tiny_rec(folder: Path) -> str:
    sys.path.insert(0, str(REPO / "tests"))
    from train_util import make_tiny_rec as make
    return make(folder, n=8)


def test_train_pretrained_file_of_another_config_names_the_config_it_fits(tmp_path):
    from safetensors.torch import save_file

    from rwkv_clip import create_RWKV_Model, load_model_configs
    from rwkv_clip.errors import CheckpointError
    from rwkv_clip.model import load_model_weight
    from rwkv_clip.train.args import parse_args
    from rwkv_clip.train.loop import build_train_model
    model = create_RWKV_Model(load_model_configs("RWKV_CLIP_tiny"))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    args = parse_args(["--pretrained", str(tmp_path / "model.safetensors"), "--device", "cpu"])
    from rwkv_clip.distributed import DistInfo
    with pytest.raises(CheckpointError) as info:
        build_train_model(args, DistInfo(), print)
    first = str(info.value).splitlines()[0]
    assert "model.safetensors" in first and "fit model_config/RWKV_CLIP_tiny.json" in first
    assert "--config RWKV_CLIP_tiny" in first
    load_model_weight(create_RWKV_Model(load_model_configs("RWKV_CLIP_tiny")),
                      tmp_path / "model.safetensors")  # and it does load there


# ------------------------------------------------------------------ the memory planner
def test_planner_flags_mean_what_train_flags_mean():
    import json
    argv = ["-m", "rwkv_clip.memory", "--config", "RWKV_CLIP_tiny", "--batch-size", "64",
            "--gradient-acc", "4", "--gpus", "8", "--precision", "bf16"]
    res = run([*argv, "--json"])
    assert res.returncode == 0, res.stderr
    est = json.loads(res.stdout)["estimate"]
    assert est["micro_batch"] == 64 and est["batch_size"] == 64 * 4  # per GPU per step
    from rwkv_clip.train.args import parse_args
    train = parse_args(["--batch-size", "64", "--gradient-acc", "4"])
    assert (train.batch_size, train.gradient_acc) == (est["micro_batch"], est["gradient_acc"])
    text = run(argv)
    assert text.returncode == 0, text.stderr
    first = text.stdout.splitlines()[0]
    assert "--batch-size 64 (micro-batch per GPU) x --gradient-acc 4 x 8 GPU(s) = 2048" in first
    table = text.stdout.split("largest --batch-size that fits", 1)[1].splitlines()[1:7]
    assert [int(row.split()[-1]) for row in table] == [b // 4 for b in est["max_batch"].values()]


def test_planner_optimizer_step_has_no_temporaries():
    """The trainer's optimizer (fused AdamW) and clipping allocate nothing parameter-sized,
    and the estimate of the optimizer step counts none."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rwkv_clip.memory import build_measured_model, training_peak
    from rwkv_clip.memory.measure import trainer_defaults
    from rwkv_clip.train.loop import build_optimizer
    args, model = build_measured_model("RWKV_CLIP_tiny", "cpu", False, None)
    optimizer = build_optimizer(model, trainer_defaults())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # the moments exist (steady state)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    live = peak = 0
    events = prof.profiler.kineto_results.events()
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert peak < largest / 100, peak
    tr = training_peak(args, 16, "fp32", device="cpu")
    persistent = (tr["parameter_bytes"] + tr["optimizer_bytes"] + tr["input_bytes"]
                  + tr["gradient_bytes"])
    assert tr["training_peak_bytes"] >= persistent
    if tr["training_peak_phase"] == "optimizer step":
        assert tr["training_peak_bytes"] == persistent and tr["workspace_bytes"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("config, batch, checkpointing", [
    ("RWKV_CLIP_tiny", 16, False),   # the smallest config, batch 16, fp32
    ("RWKV_CLIP_tiny", 4, False),
    ("RWKV_CLIP_small", 16, True),
])
def test_planner_estimate_within_15_percent_of_measure(config, batch, checkpointing):
    import json
    argv = ["-m", "rwkv_clip.memory", "--config", config, "--batch-size", str(batch),
            "--precision", "fp32", "--device", "cpu", "--measure", "--json"]
    res = run(argv + (["--checkpointing"] if checkpointing else []), timeout=900)
    assert res.returncode == 0, res.stderr
    ratio = json.loads(res.stdout)["measured"]["ratio_estimate_to_measured"]
    assert abs(ratio - 1) < 0.15, ratio


# ------------------------------------------------------------ errors that point at the fix
def parse_error(capsys, argv: list[str]) -> str:
    from rwkv_clip.train.args import parse_args
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_train_data_of_pairs_says_to_convert_it(tmp_path, capsys):
    for name in ("pairs.jsonl", "pairs.csv"):
        (tmp_path / name).write_text('{"image": "a.jpg", "raw": "a cat"}\n')
        err = parse_error(capsys, ["--train-data", str(tmp_path / name)])
        first = err.splitlines()[0]
        assert first.startswith("train.py: error: ") and "scripts/make_rec.py" in first, err
        assert str(tmp_path / name) in first


def test_folder_of_parquet_suggests_the_data_format(tmp_path, capsys):
    (tmp_path / "i2d").mkdir()
    (tmp_path / "i2d" / "00000.parquet").write_bytes(b"")
    err = parse_error(capsys, ["--train-data", str(tmp_path / "i2d")])
    assert "--data-format parquet" in err.splitlines()[0], err
    from rwkv_clip.train.args import parse_args
    assert parse_args(["--train-data", str(tmp_path / "i2d"), "--data-format",
                       "parquet"]).data_format == "parquet"


def test_missing_rec_names_the_prefix_rule(tmp_path):
    from rwkv_clip.data import DataError
    from rwkv_clip.data.recordio import RecordIOReader
    with pytest.raises(DataError, match="make_rec.py") as info:
        RecordIOReader(str(tmp_path / "nowhere"))
    assert str(tmp_path / "nowhere.rec") in str(info.value)


def test_make_rec_parquet_skips_name_file_row_and_key(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"key": ["000000000", "000000001", "000000002"],
                             "jpg": [png(), None, png()], "caption": ["a", "b", "c"],
                             "status": ["success", "failed_to_download", "success"]}),
                   tmp_path / "00000.parquet", row_group_size=2)
    res = run(["scripts/make_rec.py", str(tmp_path / "00000.parquet"), str(tmp_path / "out"),
               "--no-progress"])
    assert res.returncode == 0, res.stderr
    assert "written: 2  skipped: 1" in res.stdout
    example = next(ln for ln in res.stdout.splitlines() if "e.g." in ln)
    assert "00000.parquet:row 1" in example and "'000000001'" in example, res.stdout
    assert "failed_to_download" in example and "None" not in example


def test_make_rec_missing_images_name_the_path_tried(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "pairs.jsonl").write_text(
        '{"image": "img/a.jpg", "raw": "a cat"}\n{"image": "img/b.jpg", "raw": "a dog"}\n')
    res = run([str(REPO / "scripts" / "make_rec.py"), str(tmp_path / "data" / "pairs.jsonl"),
               str(tmp_path / "out"), "--no-progress"], cwd=tmp_path)
    msg = assert_user_error(res, "no usable samples")
    lines = msg.splitlines()
    assert lines[0].startswith("make_rec.py: error: no usable samples"), msg
    assert str(tmp_path / "out.rec") in lines[0]
    assert any(ln.strip() == "2 x image file not found" for ln in lines[1:]), msg
    tried = [ln for ln in lines if "tried" in ln]
    assert str(tmp_path / "data" / "img" / "a.jpg") in tried[0], msg
    assert "relative to the folder of pairs.jsonl" in tried[0]


def test_multi_line_messages_keep_their_lines(capsys):
    from rwkv_clip.errors import CheckpointError, DataError, report
    report(CheckpointError("checkpoint w.pt does not fit\n  missing keys (2): a, b\n"
                           "  unexpected keys (1): c"), "zero_shot.py")
    report(DataError("no usable samples\n3 x bad image", "in.jsonl", 7), "make_rec.py")
    err = capsys.readouterr().err.splitlines()
    assert err == ["zero_shot.py: error: checkpoint w.pt does not fit",
                   "  missing keys (2): a, b", "  unexpected keys (1): c",
                   "make_rec.py: error: no usable samples | file: in.jsonl | record: 7",
                   "  3 x bad image"]


# ------------------------------------------------------------------------ smaller items
def test_safetensors_export_is_readable_by_others(tmp_path):
    import stat

    import torch

    from rwkv_clip.export import save_state_dict
    old = os.umask(0o022)
    try:
        for name in ("model.safetensors", "model.pt"):
            save_state_dict({"w": torch.ones(2)}, tmp_path / name)
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name
    finally:
        os.umask(old)


def test_help_texts_say_each_default_once_and_name_parquet():
    from rwkv_clip.train.args import build_train_parser
    text = build_train_parser().format_help()
    assert "(default: None)" not in text
    flat = " ".join(text.split())
    assert flat.count("(default: the config's, else 10)") == 1
    assert "(default: the config's, else 10) (default" not in flat
    train_data = flat.split("--train-data TRAIN_DATA", 2)[2].split("--train-num-samples")[0]
    assert "parquet" in train_data and "make_rec.py" in train_data
    res = run(["scripts/make_rec.py", "--help"])
    flat = " ".join(res.stdout.split())
    assert "--format {rec,wds} rec: OUTPUT.rec" in flat and "--no-progress no progress bar" in flat
    res = run(["-m", "rwkv_clip.memory", "--help"])
    assert "--gradient-acc K micro-batches per optimizer step" in " ".join(res.stdout.split())


def test_dali_py_and_gpu_check_have_help():
    res = run(["dali.py", "--help"])
    assert res.returncode == 0 and res.stdout.startswith("usage: python dali.py"), res.stderr
    assert "--train-data" in res.stdout
    out = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "bash scripts/gpu_check.sh [OUT.json]" in out.stdout
    assert "no wheels" not in out.stdout + out.stderr


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
def test_resume_log_epochs_loader_zero_shot_note_and_report(tmp_path):
    import numpy as np
    from PIL import Image

    from rwkv_clip.report import parse_training_log
    from rwkv_clip.train.schedule import lr_at
    rec = make_tiny_rec(tmp_path)  # 8 pairs: 2 steps of 4 per epoch
    out = tmp_path / "run"
    common = ["--loader", "torch", "--workers", "0", "--batch-size", "4", "--log-every", "1"]
    first = run(tiny_train(rec, out, *common, "--epochs", "2", "--max-steps", "1",
                           "--final-zero-shot", "True"))  # wanted, but no folder for this data
    assert first.returncode == 0, first.stderr
    log = (out / "training.log").read_text()
    assert "data loader: PyTorch DataLoader, 0 worker(s)" in log
    assert "zero-shot evaluation: skipped" in log and "--zero-shot-data DIR" in log
    # report.png of a run with one logged point: the loss point is drawn (tab:blue)
    curves = parse_training_log(out / "training.log")
    assert curves.steps == [1]
    png_pixels = np.asarray(Image.open(out / "report.png").convert("RGB")).astype(int)
    blue = (np.abs(png_pixels - np.array([31, 119, 180])).sum(-1) < 40).sum()
    orange = (np.abs(png_pixels - np.array([255, 127, 14])).sum(-1) < 40).sum()
    assert blue > 0 and orange > 0, (blue, orange)
    # resume into epoch 2: the log counts epochs from 1 everywhere
    second = run(tiny_train(rec, out, *common, "--epochs", "2", "--resume", "latest",
                            "--max-steps", "4", "--resume-allow-changes"))
    assert second.returncode == 0, second.stderr
    lines = (out / "training.log").read_text().splitlines()
    resumed = next(ln for ln in lines if "resumed from" in ln)
    assert "step 1, epoch 1 from its batch 2 (0 epoch(s) done)" in resumed, resumed
    progress = [ln for ln in lines if " step " in ln and " loss " in ln]
    assert "epoch 1/2 step 2/4" in progress[-3] and "epoch 2/2 step 4/4" in progress[-1]
    # the lr curve is the schedule's exact values at every step, not the rounded log
    curves = parse_training_log(out / "training.log")
    steps, lr = curves.lr_curve()
    assert steps == [1, 2, 3, 4]
    assert lr == [lr_at(min(s, 3), kind="cosine", max_lr=1.5e-3, total_steps=4, warmup=0.1)[0]
                  for s in steps]


def test_resume_keeps_the_zero_shot_folder():

    from rwkv_clip.train.args import parse_args
    from rwkv_clip.train.checkpoint import take_run_settings
    first = parse_args(["--zero-shot-data", "my_images", "--zero-shot-every", "2"])
    ckpt = {"args": vars(first), "model_config": first.model_config}
    resumed = parse_args(["--resume", "latest"])
    take_run_settings(ckpt, resumed, "epoch_latest.pt")
    assert (resumed.zero_shot_data, resumed.zero_shot_every) == ("my_images", 2)
