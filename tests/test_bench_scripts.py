"""bench_train.py runs end to end on the tiny config and prints one valid JSON object."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

# one thread: on a shared small machine several OpenMP threads can make a step far slower

EXPECTED = {"config", "device", "batch_size", "precision", "checkpointing", "wkv_backend",
            "steps", "step_s_mean", "samples_per_s", "peak_memory_bytes",
            "estimated_peak_bytes", "wkv", "wkv_share", "loss_finite"}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_bench_train_tiny_prints_json(repo_root, checkpointing):
    cmd = [sys.executable, str(repo_root / "scripts" / "bench_train.py"), "--device", "cpu",
           "--config", str(repo_root / "model_config" / "RWKV_CLIP_tiny.json"),
           "--batch-size", "4", "--warmup", "1", "--steps", "2", "--wkv-steps", "1",
           "--threads", "1"]
    if checkpointing:
        cmd.append("--checkpointing")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=repo_root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout  # exactly one JSON object on stdout
    result = json.loads(lines[0])
    assert EXPECTED <= set(result)
    assert result["config"] == "RWKV_CLIP_tiny.json" and result["batch_size"] == 4
    assert result["checkpointing"] is checkpointing and result["loss_finite"]
    assert result["samples_per_s"] > 0 and len(result["step_s_all"]) == 2
    assert result["peak_memory_bytes"] > 0
    # one WKV call per block (2 image + 2 text blocks), timed forward and back; with
    # checkpointing each block's forward runs again in backward, WKV call included
    assert result["wkv"]["calls_per_step"] == 4 * (2 if checkpointing else 1)
    assert result["wkv"]["forward_s_per_step"] > 0 and result["wkv"]["backward_s_per_step"] > 0
    assert 0 < result["wkv_share"] < 1
