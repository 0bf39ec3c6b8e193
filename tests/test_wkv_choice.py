"""Which WKV implementation runs is said, and a mistyped choice is an error on every
device: ``RWKV_CLIP_DISPATCH`` with an unknown op or implementation stops train.py and
zero_shot.py in one line naming the allowed ones (on a CPU-only machine too, where the
CUDA implementations never run), and train.py's log names the implementation it runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rwkv_clip.errors import WKVError
from rwkv_clip.ops import describe_wkv, dispatch, wkv6_bidirectional

REPO = Path(__file__).resolve().parents[1]
ENV = dispatch.OVERRIDE_ENV_VAR
IMPL_ERROR = (f"unknown wkv implementation 'bogus' (from {ENV}); expected one of auto, "
              "cuda-fast, cuda-faithful, chunked, cpu, reference, cuda")
OP_ERROR = (f"{ENV}: unknown op 'gpu'; expected one of wkv, shift_lerp, head_norm_gate, relu_square, "
            "linear, lowp_matmul")


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


def command(script: str, *argv: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != ENV}
    return subprocess.run([sys.executable, str(REPO / script), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**clean, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
                               **env})


@pytest.mark.parametrize("script", ["train.py", "zero_shot.py"])
@pytest.mark.parametrize("value, message", [("wkv=bogus", IMPL_ERROR), ("gpu=cpu", OP_ERROR)])
def test_an_unknown_kernel_name_stops_the_command_on_a_cpu_machine(script, value, message,
                                                                  tmp_path):
    out = command(script, "--config", "RWKV_CLIP_tiny", "--device", "cpu",
                  "--output" if script == "train.py" else "--output-dir", str(tmp_path),
                  **{ENV: value})
    assert out.returncode == 2
    assert out.stderr.strip() == f"{script}: error: {message}"


def test_the_first_wkv_call_checks_the_override_on_the_cpu(monkeypatch):
    r, k, v, w = (torch.randn(1, 3, 4, dtype=torch.float64) for _ in range(4))
    u = torch.randn(1, 4, dtype=torch.float64)
    monkeypatch.setenv(ENV, "wkv=cuda-bogus")
    dispatch.reset()
    with pytest.raises(WKVError, match="unknown wkv implementation 'cuda-bogus'"):
        wkv6_bidirectional(r, k, v, w, u)
    monkeypatch.setenv(ENV, "wkv=cuda-faithful")  # known: only an error where it runs
    dispatch.reset()
    assert wkv6_bidirectional(r, k, v, w, u, backend="reference").shape == (1, 3, 4)
    with pytest.raises(WKVError, match=(f"wkv implementation 'cuda-faithful' \\(from {ENV}\\) "
                                         "does not run on cpu; there: cpu, reference")):
        describe_wkv("cpu")  # train.py says so before building anything
    monkeypatch.delenv(ENV)
    dispatch.reset()
    from rwkv_clip.cpu_isa import cpu_info
    from rwkv_clip.ops import build
    auto = describe_wkv("cpu")
    assert auto.startswith("WKV: auto among cpu, reference per dtype and length (cache ")
    assert auto.endswith(f"; cpu kernel {build.cpu_kernel_name()} on {cpu_info().describe()}")
    assert "rwkv_clip_wkv6_cpu_" in auto
    assert describe_wkv("cpu", "reference") == "WKV: reference (pinned)"


def test_train_log_names_the_wkv_choice_and_the_run_stores_it(tmp_path):
    from train_util import make_tiny_rec, tiny_argv
    data = make_tiny_rec(tmp_path / "data", n=8)
    out = command("train.py", *tiny_argv(tmp_path / "run", data, "--max-steps", "1"),
                  **{ENV: "wkv=reference"})
    assert out.returncode == 0, out.stderr
    log = (tmp_path / "run" / "training.log").read_text()
    assert f"WKV: reference ({ENV})" in log
    assert "wkv: reference (override), float32, T=" in log
    stored = json.loads((tmp_path / "run" / "dispatch.json").read_text())
    wkv = [c for c in stored.values() if c["op"] == "wkv"]
    assert wkv and {c["implementation"] for c in wkv} == {"reference"}
    assert {c["how"] for c in wkv} == {"override"}
    # the glue ops around it: chosen by the table, each choice stored and logged
    assert {c["op"] for c in stored.values()} == {"wkv", "shift_lerp", "head_norm_gate",
                                                  "relu_square", "linear"}
    for c in stored.values():
        if c["op"] != "wkv":
            assert c["how"] in ("auto", "cache") and c["implementation"] in c["times_ms"]
            assert f"{c['op']}: {c['implementation']} (" in log


def test_train_dispatch_setting_pins_and_repeats_a_run(tmp_path):
    """--dispatch pins (logged, stored as pinned); a run's dispatch.json given back makes
    the next run take the same implementations without choosing; a bad value is one line."""
    from train_util import make_tiny_rec, tiny_argv
    data = make_tiny_rec(tmp_path / "data", n=8)
    first = command("train.py", *tiny_argv(tmp_path / "a", data, "--max-steps", "1",
                                            "--dispatch", "relu_square=reference"))
    assert first.returncode == 0, first.stderr
    assert "dispatch: pinned relu_square=reference" in (tmp_path / "a" / "training.log").read_text()
    stored = json.loads((tmp_path / "a" / "dispatch.json").read_text())
    relu = [c for c in stored.values() if c["op"] == "relu_square"]
    assert relu and all(c["implementation"] == "reference" and c["how"] == "pinned"
                        for c in relu)
    again = command("train.py", *tiny_argv(tmp_path / "b", data, "--max-steps", "1",
                                            "--dispatch", str(tmp_path / "a" / "dispatch.json")))
    assert again.returncode == 0, again.stderr
    log = (tmp_path / "b" / "training.log").read_text()
    assert f"dispatch: {len(stored)} choice(s) adopted from" in log
    repeated = json.loads((tmp_path / "b" / "dispatch.json").read_text())
    assert {k: c["implementation"] for k, c in repeated.items()} == \
        {k: c["implementation"] for k, c in stored.items()}
    assert {c["how"] for c in repeated.values()} == {"adopted"}
    bad = command("train.py", *tiny_argv(tmp_path / "c", data, "--max-steps", "1",
                                          "--dispatch", "relu_square=fastest"))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].endswith(
        "unknown relu_square implementation 'fastest' (from --dispatch); expected one of "
        "auto, triton, short-backward, reference")
    assert "Traceback" not in bad.stderr
