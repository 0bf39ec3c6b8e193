"""The side-by-side benchmark (rwkv_clip.bench.versus, bench_train.py --versus, bench_infer.py):
its timing arithmetic, its flag checks, and one JSON object from each script."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import torch

from rwkv_clip.bench.versus import (
    Case,
    format_row,
    interleaved,
    kernel_breakdown,
    machine,
    paired_ratios,
    parse_list,
    summarise,
    table,
)
from rwkv_clip.errors import ConfigError


def test_ratio_is_the_median_of_paired_ratios():
    timings = {"rwkv_clip": {"step_s": [1.0, 2.0, 1.0], "warmup_s": 0.0, "finite": True},
               "open_clip": {"step_s": [2.0, 2.0, 3.0], "warmup_s": 0.0, "finite": True}}
    result = summarise(timings, 4, "rwkv_clip", "open_clip")
    assert result["ratio"] == 2.0  # paired: 2.0, 1.0, 3.0
    assert result["rwkv_clip"]["pairs_per_s"] == 4.0  # 4 / median(1, 2, 1)
    assert result["open_clip"]["pairs_per_s"] == 2.0
    assert result["ratio_range"] == [1.0, 3.0] and result["paired_ratios"] == [2.0, 1.0, 3.0]
    assert result["gain"] is None  # the range includes 1.0: within noise


@pytest.mark.parametrize("theirs, gain", [([1.1, 1.3, 1.2], "ours"), ([0.9, 0.5, 0.8], "theirs"),
                                          ([1.1, 0.9, 1.2], None)])
def test_a_gain_needs_the_whole_range_on_one_side_of_one(theirs, gain):
    result = paired_ratios([1.0, 1.0, 1.0], theirs)
    assert result["gain"] == gain
    assert result["ratio_range"] == [min(theirs), max(theirs)]


def test_machine_names_the_cpu_and_its_isa():
    info = machine(torch.device("cpu"))
    assert info["cpu"] and info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(info["isa"]) <= {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16",
                                "amx_fp16"}


def test_warm_ups_alternate_and_timed_steps_run_abba():
    calls = []
    runners = {name: (lambda name=name: calls.append(name) or 1.0) for name in ("a", "b")}
    out = interleaved(runners, warmup=2, repeats=3)
    assert calls == ["a", "b", "a", "b",        # warm-ups, in turn
                     "a", "b", "b", "a", "a", "b"]  # timed, ABBA
    assert all(len(out[n]["step_s"]) == 3 and out[n]["finite"] for n in "ab")


def test_compiled_over_eager_pairs_the_same_case():
    eager = Case("infer", 16, "bf16", "eager", {"rwkv_clip": {"pairs_per_s": 10.0}})
    other = Case("infer", 16, "fp32", "eager", {"rwkv_clip": {"pairs_per_s": 99.0}})
    compiled = Case("infer", 16, "bf16", "compiled", {"rwkv_clip": {"pairs_per_s": 13.0}})
    out = table([eager, other, compiled])
    assert len(out["rows"]) == 3
    assert out["compiled_over_eager"] == [{"task": "infer", "batch": 16, "precision": "bf16",
                                           "rwkv_clip": pytest.approx(1.3)}]


def test_breakdown_splits_kernels_optimizer_and_glue():
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    x = torch.randn(1 << 20)
    param = torch.nn.Parameter(torch.randn(1 << 16))
    param.grad = torch.randn(1 << 16)
    opt = torch.optim.AdamW([param], fused=True)

    def step() -> float:
        y = a @ b                 # a kernel compiling leaves alone
        z = torch.sin(x).cos()    # glue a compiler could fuse
        opt.step()                # outside the model
        return float(y[0, 0] + z[0])
    step()
    parts = kernel_breakdown(step)
    assert parts["kernels_s"] > 0 and parts["glue_s"] > 0 and parts["optimizer_s"] > 0
    total = parts["kernels_s"] + parts["optimizer_s"] + parts["glue_s"]
    assert parts["profiled_s"] == pytest.approx(total)
    fixed = parts["kernels_s"] + parts["optimizer_s"]
    assert parts["kernel_share"] == pytest.approx(fixed / total)
    assert parts["compile_ceiling"] == pytest.approx(total / fixed)
    assert parts["compile_ceiling"] > 1.0

    only_glue = kernel_breakdown(lambda: float(torch.sin(x)[0]))
    assert only_glue["kernels_s"] == 0 and only_glue["compile_ceiling"] is None  # not inf:
    json.dumps(only_glue, allow_nan=False)                                     # strict JSON
    case = Case("infer", 1, "fp32", "eager", {"rwkv_clip": {"pairs_per_s": 1.0},
                                               "breakdown": {"rwkv_clip": only_glue}})
    assert "compile ceiling unbounded" in format_row(case)


def test_list_flags_are_checked():
    assert parse_list("4,16", int, None, "--batch-sizes") == [4, 16]
    with pytest.raises(ConfigError, match="--precisions 'fp8'"):
        parse_list("fp8", str, ("fp32", "bf16"), "--precisions")


def _run(repo_root, script, *flags):
    cmd = [sys.executable, str(repo_root / "scripts" / script), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=repo_root)


@pytest.mark.parametrize("script,task", [("bench_infer.py", "infer"),
                                         ("bench_train.py", "train")])
def test_scripts_print_one_json_object(repo_root, script, task):
    proc = _run(repo_root, script, *(["--versus", "none"]),
                "--versus-config", str(repo_root / "model_config" / "RWKV_CLIP_tiny.json"),
                "--batch-sizes", "2", "--modes", "eager", "--versus-threads", "1",
                "--breakdown")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    assert [(r["task"], r["precision"]) for r in result["rows"]] == [(task, "fp32"),
                                                                     (task, "bf16")]
    assert all(r["rwkv_clip"]["pairs_per_s"] > 0 and r["rwkv_clip"]["finite"]
               for r in result["rows"])
    for row in result["rows"]:  # --breakdown: ours has matmuls and the WKV kernel
        parts = row["breakdown"]["rwkv_clip"]
        assert parts["kernels_s"] > 0 and parts["glue_s"] > 0
        assert parts["compile_ceiling"] == pytest.approx(
            parts["profiled_s"] / (parts["kernels_s"] + parts["optimizer_s"]))
        assert (parts["optimizer_s"] > 0) == (task == "train")


def test_bad_flag_is_one_line_error(repo_root):
    proc = _run(repo_root, "bench_infer.py", "--versus", "none", "--modes", "jit")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --modes 'jit'")


@pytest.mark.slow
def test_b32_beside_open_clip_vit_b32(repo_root):
    proc = _run(repo_root, "bench_infer.py", "--batch-sizes", "1", "--precisions", "fp32",
                "--modes", "eager", "--repeats", "1", "--versus-threads", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout)["rows"][0]
    ours, theirs = row["rwkv_clip"], row["open_clip"]
    assert ours["finite"] and theirs["finite"]
    # each model's rate is the batch over its median step time, and the ratio is the
    # paired one: their time over ours, repeat by repeat
    for side in (ours, theirs):
        assert side["pairs_per_s"] == pytest.approx(row["batch"] / statistics.median(side["step_s"]))
    paired = [t / o for o, t in zip(ours["step_s"], theirs["step_s"], strict=True)]
    assert row["paired_ratios"] == pytest.approx(paired)
    assert row["ratio"] == pytest.approx(statistics.median(paired))
    low, high = row["ratio_range"]
    assert [low, high] == [min(paired), max(paired)]
    assert row["gain"] == ("ours" if low > 1 else "theirs" if high < 1 else None)


MAIN_JOB_LOG = """\
13:33:05 done: 980 steps in 6.0 min, last loss 1.0839, checkpoint runs/x/checkpoints/epoch_2.pt
13:33:05 final zero-shot accuracy: top-1 99.7%, top-5 100.0% (chance 3.3%: 30 classes)
13:33:05 final zero-shot accuracy on the shifted split: top-1 93.0%, top-5 100.0% (chance 3.3%: 30 classes)
"""


def test_main_job_reads_a_runs_final_accuracies_and_their_range_over_seeds():
    from rwkv_clip.bench.main_job import read_run, summarise
    run = read_run(MAIN_JOB_LOG)
    assert run == {"steps": 980, "train_minutes": 6.0, "held_out_top1": 99.7,
                   "held_out_top5": 100.0, "shifted_top1": 93.0, "shifted_top5": 100.0}
    other = {**run, "held_out_top1": 92.3, "shifted_top1": 87.7}
    third = {**run, "held_out_top1": 95.0, "shifted_top1": 90.0}
    summary = summarise([run, other, third])
    assert summary["held_out_top1"] == {"min": 92.3, "median": 95.0, "max": 99.7}
    assert summary["shifted_top1"] == {"min": 87.7, "median": 90.0, "max": 93.0}
    with pytest.raises(ConfigError, match="final zero-shot lines"):
        read_run(MAIN_JOB_LOG.splitlines()[0])


def test_main_job_grid_paths_and_run_folders():
    """The grid of scripts/bench_main_job.py: each CPU path is the environment another CPU's
    arithmetic needs (combined with '+'), an unknown name is one error before any run, and
    the run folders name path, threads and seed (plain seedN without a grid)."""
    from rwkv_clip.bench.main_job import grid, path_environment, read_run
    assert path_environment("native") == {}
    assert path_environment("avx2+mkl") == {"ATEN_CPU_CAPABILITY": "avx2",
                                            "ONEDNN_MAX_CPU_ISA": "AVX2",
                                            "RWKV_CLIP_DISPATCH": "linear=mkl"}
    with pytest.raises(ConfigError, match=r"CPU path 'avx3' \(in 'avx2\+avx3'\): expected"):
        path_environment("avx2+avx3")
    assert [r[3] for r in grid([0, 1], ["native"], [None])] == ["seed0", "seed1"]
    assert [r[3] for r in grid([0], ["native", "avx2"], [1, 2])] == [
        "native-t1-seed0", "native-t2-seed0", "avx2-t1-seed0", "avx2-t2-seed0"]
    log = ("13:00:00 WKV: cpu kernel rwkv_clip_wkv6_cpu_avx2 on AMD EPYC (AuthenticAMD): "
           "avx512bf16, running as avx2 (ATEN_CPU_CAPABILITY=avx2) (choice: X)\n" + MAIN_JOB_LOG)
    assert read_run(log)["wkv"].startswith("cpu kernel rwkv_clip_wkv6_cpu_avx2 on AMD EPYC")


def test_main_job_time_against_needs_a_checkout(repo_root, tmp_path):
    """--against names a folder that is not a checkout: one line, exit 2, before any run."""
    proc = _run(repo_root, "bench_main_job.py", "--seeds", "0", "--against", str(tmp_path),
                "--runs", str(tmp_path / "runs"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--against {tmp_path}: expected a checkout" in lines[0]
    assert not (tmp_path / "runs").exists()
    proc = _run(repo_root, "bench_main_job.py", "--against", str(repo_root), "--repeats", "0")
    assert proc.returncode == 2 and "--repeats 0: expected 1 or more" in proc.stderr


def test_each_side_names_its_checkouts_commit(repo_root, tmp_path):
    from rwkv_clip.bench.provenance import code_commit
    head = subprocess.run(["git", "-C", str(repo_root), "rev-parse", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    if not head:
        pytest.skip("not a git checkout")
    assert code_commit(repo_root).removesuffix("-dirty") == head
    assert code_commit(tmp_path) == "unknown"


def test_each_side_gets_an_empty_cache_for_data_and_kernels(repo_root, tmp_path):
    """A checkout that still reads RWKV_CLIP_KERNEL_CACHE gets it set to the fresh folder
    too, so neither side finds a compiled kernel the other had to build; this one, which
    rejects the variable, gets RWKV_CLIP_CACHE alone."""
    from rwkv_clip.bench.main_job import fresh_cache_env
    ours = fresh_cache_env(repo_root, tmp_path / "c1")
    assert ours == {"RWKV_CLIP_CACHE": str(tmp_path / "c1")}
    old = tmp_path / "old"
    (old / "rwkv_clip" / "ops").mkdir(parents=True)
    (old / "rwkv_clip" / "ops" / "dispatch.py").write_text("# an older table\n")
    assert fresh_cache_env(old, tmp_path / "c2") == {
        "RWKV_CLIP_CACHE": str(tmp_path / "c2"),
        "RWKV_CLIP_KERNEL_CACHE": str(tmp_path / "c2" / "kernels")}


@pytest.mark.slow
def test_main_job_time_against_another_checkout_pairs_runs_abba(repo_root, tmp_path):
    """Two checkouts (here the same one twice), one pair: each side trains in a fresh data
    cache of its own, and the JSON holds both walls, their paired ratio and each run's
    accuracies."""
    runs = tmp_path / "runs"
    proc = _run(repo_root, "bench_main_job.py", "--seeds", "0", "--against", str(repo_root),
                "--repeats", "1", "--runs", str(runs), "--", "--config", "RWKV_CLIP_tiny",
                "--max-steps", "2", "--zero-shot-every", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert [(r["side"], r["repeat"]) for r in result["runs"]] == [("ours", 0), ("theirs", 0)]
    assert result["ratio"] == pytest.approx(result["theirs"]["median_wall_s"]
                                            / result["ours"]["median_wall_s"])
    assert all(r["steps"] == 2 and 0 <= r["held_out_top1"] <= 100 for r in result["runs"])
    assert sorted(p.name for p in runs.iterdir() if p.name.startswith("cache-")) == [
        "cache-ours-0", "cache-theirs-0"]
