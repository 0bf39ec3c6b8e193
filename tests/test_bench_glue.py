"""scripts/bench_glue.py: every glue case runs forward + backward on the CPU at batch 1,
checked against float64, with the Triton op named as skipped; one JSON on stdout."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rwkv_clip.bench import glue as bench
from rwkv_clip.config import complete_args, load_model_configs
from rwkv_clip.errors import ConfigError


def test_cases_take_the_b32_shapes():
    """The image tower's 7 x 7 patch grid at 640 wide in heads of 80 and its 5x hidden
    width; the text tower's 77 tokens in heads of 64 and its 2240-wide channel mix."""
    by_name = {c.name: c for c in bench.cases("RWKV_CLIP_B32")}
    assert len(by_name) == 10
    assert by_name["image_time_mix_lerps"].shape == {
        "x": ["B", 49, 640], "weight": [5, "B", 49, 640], "shift": "q", "head_dim": 80,
        "shifted_first": False}
    assert by_name["image_channel_mix_lerps"].shape["shifted_first"] is True
    assert by_name["text_channel_mix_lerps"].shape == {
        "x": ["B", 77, 640], "weight": [2, 1, 1, 640], "shift": "sequence", "head_dim": 64,
        "shifted_first": False}
    args = complete_args(load_model_configs("RWKV_CLIP_B32"))
    assert by_name["text_head_norm_gate"].shape == {
        "y": ["B", 77, 640], "heads": 10, "eps": 1e-5 * args.head_size_divisor ** 2}
    assert by_name["image_head_norm_gate"].shape["heads"] == 8
    assert by_name["image_relu_square"].shape == {"x": ["B", 49, 3200]}
    assert by_name["text_relu_square"].shape == {"x": ["B", 77, 2240]}


@pytest.mark.parametrize("extra", [
    ["--modes", "eager,triton"],
    pytest.param(["--ops", "image_time_mix_lerps,text_head_norm_gate", "--compile-backend",
                  "aot_eager"], marks=pytest.mark.slow)])  # tracing forward and backward
def test_bench_glue_cpu_prints_json(repo_root, extra):
    cmd = [sys.executable, str(repo_root / "scripts" / "bench_glue.py"), "--device", "cpu",
           "--batch", "1", "--warmup", "0", "--repeats", "2", "--threads", "1", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=repo_root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    assert result["device"] == "cpu" and result["batch"] == 1 and result["all_checks_passed"]
    assert result["machine"]["cores"] and result["dtype"] == "bf16"
    names = [c["name"] for c in result["cases"]]
    assert names == ([c.name for c in bench.cases("RWKV_CLIP_B32")] if "--modes" in extra
                     else ["image_time_mix_lerps", "text_head_norm_gate"])
    for case in result["cases"]:
        modes = case["modes"]
        assert modes["triton"] == {"skipped": "no CUDA device"}
        timed = [m for m in modes if "fwd_bwd_ms" in modes[m]]
        assert timed == (["eager"] if "--modes" in extra else ["eager", "compiled"])
        for m in timed:
            assert modes[m]["check_passed"] and modes[m]["finite"]
            assert len(modes[m]["fwd_bwd_ms_all"]) == 2
        if "compiled" in timed:
            ratio = case["compiled_vs_eager"]
            assert len(ratio["paired_ratios"]) == 2 and ratio["ratio"] > 0
        assert case["fastest"] in timed


def test_bench_glue_refuses_an_unknown_case():
    import argparse
    ap = argparse.ArgumentParser()
    bench.add_flags(ap)
    with pytest.raises(ConfigError, match="--ops 'image_gelu': expected .*image_relu_square"):
        bench.main(ap.parse_args(["--device", "cpu", "--ops", "image_gelu"]))
