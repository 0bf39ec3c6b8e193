"""Which WKV kernel runs is said, and a mistyped choice is an error on every device:
``RWKV_CLIP_WKV_BACKEND`` / ``RWKV_CLIP_WKV_CUDA_VARIANT`` with an unknown name stop
train.py and zero_shot.py in one line naming the allowed ones (on a CPU-only machine too,
where the CUDA variant is never used), and train.py's log names the backend it runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rwkv_clip.errors import WKVError
from rwkv_clip.ops import (
    BACKEND_ENV_VAR,
    describe_wkv,
    reset_backend_override,
    wkv6_bidirectional,
)
from rwkv_clip.ops.build import CUDA_VARIANT_ENV_VAR

REPO = Path(__file__).resolve().parents[1]
VARIANT_ERROR = (f"unknown CUDA WKV variant 'bogus' (from {CUDA_VARIANT_ENV_VAR}); expected "
                 "one of faithful, fast, chunked")
BACKEND_ERROR = (f"unknown WKV backend 'gpu' (from {BACKEND_ENV_VAR}); expected one of auto, "
                 "cuda, cpu, reference")


def command(script: str, *argv: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in (BACKEND_ENV_VAR, CUDA_VARIANT_ENV_VAR)}
    return subprocess.run([sys.executable, str(REPO / script), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**clean, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
                               **env})


@pytest.mark.parametrize("script", ["train.py", "zero_shot.py"])
@pytest.mark.parametrize("env, message", [({CUDA_VARIANT_ENV_VAR: "bogus"}, VARIANT_ERROR),
                                          ({BACKEND_ENV_VAR: "gpu"}, BACKEND_ERROR)])
def test_an_unknown_kernel_name_stops_the_command_on_a_cpu_machine(script, env, message,
                                                                  tmp_path):
    out = command(script, "--config", "RWKV_CLIP_tiny", "--device", "cpu",
                  "--output" if script == "train.py" else "--output-dir", str(tmp_path), **env)
    assert out.returncode == 2
    assert out.stderr.strip() == f"{script}: error: {message}"


def test_the_first_wkv_call_checks_the_cuda_variant_on_the_cpu(monkeypatch):
    r, k, v, w = (torch.randn(1, 3, 4, dtype=torch.float64) for _ in range(4))
    u = torch.randn(1, 4, dtype=torch.float64)
    monkeypatch.setenv(CUDA_VARIANT_ENV_VAR, "bogus")
    reset_backend_override()
    try:
        with pytest.raises(WKVError, match=VARIANT_ERROR.replace("(", r"\(").replace(")", r"\)")):
            wkv6_bidirectional(r, k, v, w, u)
        monkeypatch.setenv(CUDA_VARIANT_ENV_VAR, "faithful")
        reset_backend_override()
        assert wkv6_bidirectional(r, k, v, w, u, backend="reference").shape == (1, 3, 4)
        from rwkv_clip.cpu_isa import cpu_info
        from rwkv_clip.ops import build
        assert describe_wkv("cpu") == (f"WKV: cpu kernel {build.cpu_kernel_name()} on "
                                       f"{cpu_info().describe()} (choice: {BACKEND_ENV_VAR})")
        assert "rwkv_clip_wkv6_cpu_" in describe_wkv("cpu")
        assert describe_wkv("cpu", "reference").startswith("WKV: pure-PyTorch reference")
    finally:
        monkeypatch.delenv(CUDA_VARIANT_ENV_VAR)
        reset_backend_override()


def test_train_log_names_the_wkv_backend(tmp_path):
    from train_util import make_tiny_rec, tiny_argv
    data = make_tiny_rec(tmp_path / "data", n=8)
    out = command("train.py", *tiny_argv(tmp_path / "run", data, "--max-steps", "1"),
                  **{BACKEND_ENV_VAR: "reference"})
    assert out.returncode == 0, out.stderr
    log = (tmp_path / "run" / "training.log").read_text()
    assert f"WKV: pure-PyTorch reference (choice: {BACKEND_ENV_VAR})" in log
