"""rwkv_clip.host_memory: CPU runs keep freed memory for reuse (glibc's malloc settings).

The settings are process-wide, so everything that applies them runs in a subprocess; in
this process only the paths that change nothing are called.
"""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from rwkv_clip import host_memory
from rwkv_clip.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
GLIBC = platform.libc_ver()[0] == "glibc"

# Steps of three 64 MiB temporaries (as a training step's activations), freed at the end
# of each; after two steps to settle, print what was applied and the minor page faults of
# the next eight. glibc's default unmaps blocks above 32 MiB (the ceiling of its dynamic
# mmap threshold) when they are freed, so each step faults its 3 x 16,384 pages in again;
# retained, the heap keeps them (measured: 0 to 3 of the 24 blocks still fault, where the
# heap's fragmentation leaves no hole big enough; one thread, since with two the
# allocation order varied and up to half of them did in four steps).
_PROBE = """
import resource, sys, torch
from rwkv_clip.host_memory import configure_host_malloc
torch.set_num_threads(1)
print(configure_host_malloc(sys.argv[1], sys.argv[2]))
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    x = torch.empty(16 << 20)
    x.fill_(1.0)
    y = x * 2
    z = y + 1
    del x, y, z
step()
step()
before = faults()
for _ in range(8):
    step()
print(faults() - before)
"""


def _probe(device: str, choice: str = "auto", **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", _PROBE, device, choice], capture_output=True,
                         text=True, timeout=120, check=True,
                         env={**clean, "PYTHONPATH": str(REPO), **env})
    applied, faults = out.stdout.split("\n")[:2]
    return applied, int(faults)


SYSTEM_FAULTS = 8 * 3 * 16384  # every step's three blocks, fresh from the kernel


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_cpu_runs_reuse_freed_memory():
    applied, faults = _probe("cpu", "system")
    assert applied == "system (--host-malloc system)"
    assert faults > 0.9 * SYSTEM_FAULTS
    applied, faults = _probe("cpu")
    assert applied == "retain"
    assert faults < 0.5 * SYSTEM_FAULTS  # measured: 0 to 1/8


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_glibc_settings_from_the_environment_win():
    applied, faults = _probe("cpu", MALLOC_TRIM_THRESHOLD_="0")
    assert applied == "system (glibc's malloc settings from the environment)"
    assert faults > 0.9 * SYSTEM_FAULTS
    # asked for explicitly, it applies anyway
    applied, faults = _probe("cpu", "retain", MALLOC_TRIM_THRESHOLD_="0")
    assert applied == "retain" and faults < 0.5 * SYSTEM_FAULTS


def test_gpu_runs_and_system_change_nothing(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    assert host_memory.configure_host_malloc("cuda") == "system (a GPU run)"
    assert host_memory.applied() == "system (a GPU run)"
    assert host_memory.configure_host_malloc("cpu") == "system (a GPU run)"  # once per process
    monkeypatch.setattr(host_memory, "_applied", None)
    assert host_memory.configure_host_malloc("cpu", "system") == "system (--host-malloc system)"


def test_a_bad_choice_is_a_config_error(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    with pytest.raises(ConfigError, match=r"--host-malloc 'keep': expected one of "
                                          r"auto, retain, system"):
        host_memory.configure_host_malloc("cpu", "keep")
    assert host_memory.applied() is None


@pytest.mark.parametrize("parse", ["train", "zero_shot", "bench_resolution"])
def test_the_clis_take_host_malloc(parse):
    """--host-malloc on every command line that applies it, auto by default."""
    if parse == "train":
        from rwkv_clip.train.args import parse_args
        read = lambda argv: parse_args(argv).host_malloc
    elif parse == "zero_shot":
        from rwkv_clip.eval.cli import parse_options
        read = lambda argv: parse_options(argv, False).host_malloc
    else:
        import argparse

        from rwkv_clip.bench.resolution import add_flags
        ap = argparse.ArgumentParser()
        add_flags(ap)
        read = lambda argv: ap.parse_args(argv).host_malloc
    assert read([]) == "auto"
    assert read(["--host-malloc", "system"]) == "system"
    with pytest.raises(SystemExit):
        read(["--host-malloc", "keep"])


def _train(tmp_path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    from train_util import make_tiny_rec, tiny_argv
    data = make_tiny_rec(tmp_path / "data", n=8)
    argv = tiny_argv(tmp_path / "run", data, "--max-steps", "1", *extra)
    clean = {k: v for k, v in os.environ.items() if k != "RWKV_CLIP_HOST_MALLOC"}
    return subprocess.run([sys.executable, str(REPO / "train.py"), *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**clean, "PYTHONPATH": str(REPO), **env})


def test_train_py_refuses_a_bad_choice_and_the_old_variable_in_one_line(tmp_path):
    out = _train(tmp_path, "--host-malloc", "bogus")
    assert out.returncode == 2
    assert out.stderr.strip().startswith(
        "train.py: error: argument --host-malloc: invalid choice: 'bogus'")
    assert len(out.stderr.strip().splitlines()) == 1
    out = _train(tmp_path, RWKV_CLIP_HOST_MALLOC="system")
    assert out.returncode == 2
    assert out.stderr.strip() == ("train.py: error: RWKV_CLIP_HOST_MALLOC is not read; use the "
                                  "flag --host-malloc auto|retain|system instead "
                                  "(docs/training.md#environment-variables)")


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_train_py_on_the_cpu_keeps_freed_memory_and_says_so(tmp_path):
    out = _train(tmp_path)
    assert out.returncode == 0, out.stderr
    log = (tmp_path / "run" / "training.log").read_text()
    assert "host malloc: freed memory kept for reuse (glibc mmap threshold 1 GiB" in log
