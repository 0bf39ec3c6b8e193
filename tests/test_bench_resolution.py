"""The resolution benchmark (rwkv_clip.bench.resolution, scripts/bench_resolution.py): the slope
fit, the time guard's prediction, the memory probe, one case of two models side by side,
a model that fails a case, and the script's JSON (FLOPs included) and plot."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from rwkv_clip.bench.resolution import (
    OURS,
    THEIRS,
    Sweep,
    build_ours,
    count_case_flops,
    loglog_slope,
    predict_seconds,
    run_case,
    run_sweep,
    slopes,
)
from rwkv_clip.bench.versus import interleaved, parse_list, peak_memory, resident_bytes
from rwkv_clip.config import load_model_configs
from rwkv_clip.errors import ConfigError

TINY = "RWKV_CLIP_tiny"


def test_loglog_slope_recovers_the_exponent():
    xs = [196, 784, 3136, 12544]
    assert loglog_slope(xs, [3.0 * x ** 1.5 for x in xs]) == pytest.approx(1.5)
    assert loglog_slope(xs, [0.01 * x for x in xs]) == pytest.approx(1.0)
    assert loglog_slope(xs, [7.0] * 4) == pytest.approx(0.0)
    # least squares through the logs: points 2^0, 2^1, 2^3 at x = 1, 2, 4 -> slope 1.5
    assert loglog_slope([1, 2, 4], [1, 2, 8]) == pytest.approx(1.5)
    assert loglog_slope([196], [1.0]) is None            # one point
    assert loglog_slope([196, 196], [1.0, 2.0]) is None  # one distinct x
    assert loglog_slope([196, 784], [1.0, 0.0]) is None  # no log of zero


def test_prediction_scales_by_the_local_slope_within_linear_and_quadratic():
    assert predict_seconds([], 100) is None
    assert predict_seconds([(100, 1.0)], 400) == pytest.approx(16.0)              # quadratic
    assert predict_seconds([(100, 1.0), (400, 4.0)], 1600) == pytest.approx(16.0)  # slope 1
    assert predict_seconds([(100, 1.0), (400, 8.0)], 1600) == pytest.approx(64.0)  # 1.5
    assert predict_seconds([(100, 1.0), (400, 0.5)], 1600) == pytest.approx(2.0)   # >= 1
    assert predict_seconds([(100, 1.0), (200, 16.0)], 400) == pytest.approx(64.0)  # <= 2


def test_peak_memory_is_what_is_held_plus_the_rise_during_the_call():
    x = torch.randn(256, 256)

    def run() -> float:
        a = torch.empty(1 << 20)   # 4 MiB
        b = torch.empty(1 << 20)   # 8 MiB live
        del a
        c = torch.empty(1 << 19)   # 6 MiB live
        return float(x[0, 0] + b[:1].sum() * 0 + c[:1].sum() * 0)
    value, held, rise = peak_memory(run, torch.device("cpu"), lambda: resident_bytes(x))
    assert value == float(x[0, 0])
    assert held == x.numel() * 4
    assert 8 << 20 <= rise < (8 << 20) + (1 << 16)  # the 8 MiB, and a few scalars


def test_resident_bytes_counts_each_storage_once():
    lin = torch.nn.Linear(10, 20)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(3, 10)).sum().backward()
    opt.step()
    params = (10 * 20 + 20) * 4
    # parameters, their gradients, AdamW's two moments (and its step counters)
    assert resident_bytes(lin) == 2 * params
    assert resident_bytes(lin, opt) == 4 * params + 2 * 4
    assert resident_bytes(lin, lin.weight, lin.weight[0]) == 2 * params  # views share


def test_the_probe_makes_the_last_warm_up_call():
    calls = []
    runners = {name: (lambda name=name: calls.append(name) or 1.0) for name in ("a", "b")}

    def probe(name, run):
        calls.append(f"probe {name}")
        return run()
    interleaved(runners, warmup=2, repeats=2, probe=probe)
    assert calls == ["a", "b", "probe a", "a", "probe b", "b", "a", "b", "b", "a"]


def tiny_sweep(**changes) -> Sweep:
    settings = dict(config=TINY, versus="tiny", sides=[16], train_sides=[16],
                    tasks=["infer", "train"], precisions=["fp32"], batch=1, train_batch=2,
                    warmup=1, repeats=2, device=torch.device("cpu"), max_seconds=1e9)
    return Sweep(**(settings | changes))


@pytest.mark.parametrize("task", ["infer", "train"])
def test_a_case_times_both_models_and_measures_their_memory(task):
    args = load_model_configs(TINY)
    models = {OURS: build_ours(args, 24, torch.device("cpu")),
              THEIRS: build_ours(args, 24, torch.device("cpu"))}
    assert models[OURS].image_model.pos_embed.shape[1] == (24 // 4) ** 2  # grid for 24 px
    case = run_case(tiny_sweep(), task, "fp32", 24, 36, models, args.ctx_len,
                    args.vocab_size, lambda line: None)
    assert (case["task"], case["side"], case["tokens"]) == (task, 24, 36)
    assert case["batch"] == (2 if task == "train" else 1)
    params = sum(p.numel() * p.element_size() for p in models[OURS].parameters())
    # fp32 images; training also holds the int64 token ids (inference is the image tower)
    inputs = case["batch"] * (3 * 24 * 24 * 4 + (args.ctx_len * 8 if task == "train" else 0))
    for name in (OURS, THEIRS):
        m = case[name]
        assert len(m["step_s"]) == 2 and m["finite"]
        assert m["median_s"] == pytest.approx(sum(m["step_s"]) / 2)
        assert m["peak_memory_bytes"] == m["held_bytes"] + m["step_memory_bytes"]
        assert m["step_memory_bytes"] > 0
        # held at the call's start: parameters and inputs; in training also AdamW's two
        # moments (the memory call is the second step; gradients are None between steps)
        expected = params * (3 if task == "train" else 1) + inputs
        assert expected <= m["held_bytes"] <= expected + (1 << 14)  # + AdamW's step counters
    paired = sorted(b / a for a, b in zip(case[OURS]["step_s"], case[THEIRS]["step_s"],
                                          strict=True))
    assert case["ratio"] == pytest.approx(sum(paired) / 2)
    assert case["memory_ratio"] == pytest.approx(case[THEIRS]["peak_memory_bytes"]
                                                 / case[OURS]["peak_memory_bytes"])


class Broken(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, images, tokens):
        raise RuntimeError("sequence too long for this kernel\nsecond line")

    def encode_image(self, images):
        return self(images, None)


def test_a_model_that_fails_is_dropped_with_its_error():
    args = load_model_configs(TINY)
    models = {OURS: build_ours(args, 16, torch.device("cpu")), THEIRS: Broken()}
    case = run_case(tiny_sweep(), "infer", "fp32", 16, 16, models, args.ctx_len,
                    args.vocab_size, lambda line: None)
    assert case[THEIRS] == {"error": "RuntimeError: sequence too long for this kernel"}
    assert case[OURS]["median_s"] > 0 and "ratio" not in case
    assert slopes([case]) == [{"model": OURS, "task": "infer", "precision": "fp32",
                               "sides": [16], "time_slope": None, "memory_slope": None,
                               "step_memory_slope": None, "flop_slope": None}]


def test_a_model_whose_flops_cannot_be_counted_gets_none_and_a_log_line():
    args = load_model_configs(TINY)
    models = {OURS: build_ours(args, 16, torch.device("cpu")), THEIRS: Broken()}
    lines: list[str] = []
    flops = count_case_flops("infer", 1, 16, args.ctx_len, models, lines.append)
    assert flops[THEIRS] is None and flops[OURS] > 0
    assert lines == [f"{THEIRS}: FLOPs of infer at 16 px not counted (RuntimeError: "
                     "sequence too long for this kernel)"]


def test_training_sides_outside_the_inference_sides_run_too():
    result = run_sweep(tiny_sweep(versus=None, sides=[16], train_sides=[32], repeats=1),
                       lambda line: None)
    assert [(c["task"], c["side"]) for c in result["cases"]] == [("infer", 16), ("train", 32)]


def test_a_thread_count_below_one_is_a_config_error():
    import argparse

    from rwkv_clip.bench.resolution import add_flags, sweep_from_flags
    ap = argparse.ArgumentParser()
    add_flags(ap)
    ns = ap.parse_args(["--config", TINY, "--versus", "none", "--sides", "16", "--device",
                        "cpu", "--threads", "0"])
    with pytest.raises(ConfigError, match="--threads 0: expected at least 1"):
        sweep_from_flags(ns)


def test_a_missing_open_clip_is_a_config_error(monkeypatch):
    import argparse

    from rwkv_clip.bench.resolution import add_flags, main
    ap = argparse.ArgumentParser()
    add_flags(ap)
    monkeypatch.setitem(sys.modules, "open_clip", None)  # import open_clip: ImportError
    ns = ap.parse_args(["--config", TINY, "--versus", "ViT-B-32", "--sides", "16",
                        "--device", "cpu"])
    with pytest.raises(ConfigError, match="pip install open_clip_torch"):
        main(ns)


def test_the_model_flag_finds_the_shipped_config_where_it_is_installed(tmp_path, monkeypatch):
    import argparse
    import shutil

    from rwkv_clip import config
    from rwkv_clip.bench.resolution import add_flags, sweep_from_flags
    shutil.copy(config.config_dir() / "RWKV_CLIP_B32.json", tmp_path)
    monkeypatch.setattr(config, "config_dir", lambda: tmp_path)  # an installed package
    ap = argparse.ArgumentParser()
    add_flags(ap)
    ns = ap.parse_args(["--model", "B32", "--versus", "none", "--sides", "224", "--device", "cpu"])
    assert sweep_from_flags(ns).config == str(tmp_path / "RWKV_CLIP_B32.json")


def test_a_list_flag_with_a_non_number_is_a_config_error():
    with pytest.raises(ConfigError, match=r"--sides '224,x': expected a comma-separated "
                                          r"list of int"):
        parse_list("224,x", int, None, "--sides")
    assert parse_list("224, 448", int, None, "--sides") == [224, 448]


def _script(repo_root, *flags):
    cmd = [sys.executable, str(repo_root / "scripts" / "bench_resolution.py"), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=repo_root)


def test_script_prints_one_json_and_draws_the_plot(repo_root, tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = _script(repo_root, "--config", TINY, "--versus", "none", "--sides", "16,32",
                   "--threads", "1", "--repeats", "1", "--out", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert json.loads(out.read_text()) == result
    assert result["versus"] is None and result["open_clip"] is None
    assert result["sides"] == result["train_sides"] == [16, 32]
    assert result["skipped"] == [] and result["memory_method"].startswith("torch.profiler")
    assert [(c["task"], c["side"], c["tokens"]) for c in result["cases"]] == [
        ("infer", 16, 16), ("train", 16, 16), ("infer", 32, 64), ("train", 32, 64)]
    for fit in result["slopes"]:  # what the JSON's own numbers give
        rows = [c[OURS] for c in result["cases"] if c["task"] == fit["task"]]
        assert fit["time_slope"] == pytest.approx(
            loglog_slope([16, 64], [r["median_s"] for r in rows]))
        assert fit["memory_slope"] == pytest.approx(
            loglog_slope([16, 64], [r["peak_memory_bytes"] for r in rows]))
        assert fit["flop_slope"] == pytest.approx(
            loglog_slope([16, 64], [r["flops"] for r in rows]))
    for case in result["cases"]:  # counted, and the same count under the time
        m = case[OURS]
        assert m["flops"] > 0
        assert m["gflop_per_s"] == pytest.approx(m["flops"] / 1e9 / m["median_s"], rel=1e-2)
    # the image tower's FLOPs are linear in the tokens, up to the pooled head's constant
    infer = {c["side"]: c[OURS]["flops"] for c in result["cases"] if c["task"] == "infer"}
    assert 3.9 < infer[32] / infer[16] <= 4
    assert [(f["task"], f["sides"]) for f in result["slopes"]] == [("infer", [16, 32]),
                                                                  ("train", [16, 32])]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_guard_skips_what_would_not_finish(repo_root):
    proc = _script(repo_root, "--config", TINY, "--versus", "none", "--sides", "16,32,64",
                   "--tasks", "infer", "--threads", "1", "--max-seconds", "0.001")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    # the first side has no history to predict from, so it runs; the others are skipped
    assert [c["side"] for c in result["cases"]] == [16]
    assert [s["side"] for s in result["skipped"]] == [32, 64]
    assert all(s["predicted_s"] >= 0 and "--max-seconds" in s["reason"]
               for s in result["skipped"])


def test_a_side_that_is_not_a_multiple_of_the_patch_is_one_line_error(repo_root):
    proc = _script(repo_root, "--config", TINY, "--versus", "none", "--sides", "16,30")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --sides / --train-sides [30]: expected multiples of the patch size 4 of "
        "RWKV_CLIP_tiny.json")


@pytest.mark.slow
def test_b32_beside_open_clip_vit_b32_at_two_sides(repo_root):
    pytest.importorskip("open_clip")
    proc = _script(repo_root, "--model", "B32", "--sides", "32,64", "--train-sides", "64",
                   "--threads", "2", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["versus"] == "ViT-B-32" and result["config"] == "RWKV_CLIP_B32.json"
    assert [(c["task"], c["tokens"]) for c in result["cases"]] == [
        ("infer", 1), ("infer", 4), ("train", 4)]
    fits = {(f["model"], f["task"]): f for f in result["slopes"]}
    assert fits[(THEIRS, "infer")]["time_slope"] is not None
    assert fits[(THEIRS, "train")]["time_slope"] is None  # one side
    for case in result["cases"]:
        assert case["ratio"] > 0 and case["memory_ratio"] > 0
        assert case["flop_ratio"] == pytest.approx(
            case[THEIRS]["flops"] / case[OURS]["flops"], rel=1e-3)
        assert case[THEIRS]["peak_memory_bytes"] > case[THEIRS]["held_bytes"] > 0
