"""rwkv_clip.distributed: launch environments (single, torchrun, SLURM) and a real
2-process gloo group started the way ``srun`` starts tasks (no torchrun)."""
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rwkv_clip.distributed import first_slurm_host, launch_environment
from rwkv_clip.errors import DistributedError

ROOT = Path(__file__).resolve().parents[1]


def test_single_process_when_nothing_is_set():
    assert launch_environment({}) == ("single", 0, 0, 1)
    # one SLURM task (an interactive salloc shell) is a single process too
    assert launch_environment({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == ("single", 0, 0, 1)


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert launch_environment(env) == ("torchrun", 3, 1, 4)


def test_slurm_variables_and_torchrun_wins():
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    assert launch_environment(slurm) == ("slurm", 5, 1, 8)
    both = {**slurm, "RANK": "2", "WORLD_SIZE": "8", "LOCAL_RANK": "2"}
    assert launch_environment(both) == ("torchrun", 2, 2, 8)


@pytest.mark.parametrize("env, words", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x': expected an integer"),
    ({"SLURM_PROCID": "9", "SLURM_NTASKS": "2"}, "bad slurm environment"),
])
def test_bad_environments_name_the_variable(env, words):
    with pytest.raises(DistributedError, match=words):
        launch_environment(env)


@pytest.mark.parametrize("nodelist, host", [
    ("node7", "node7"), ("gpu[03-05,07]", "gpu03"), ("gpu[12],cpu1", "gpu12"),
    ("a-b-1,a-b-2", "a-b-1"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_srun_style_launch_forms_a_gloo_group(tmp_path):
    """Two tasks with only SLURM's variables (and the node list) all-reduce their ranks."""
    script = tmp_path / "task.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from rwkv_clip.distributed import init_distributed, cleanup_distributed
        info = init_distributed("cpu", timeout_minutes=1)
        t = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(t)
        print(info.launcher, info.rank, info.world_size, info.backend, int(t.item()))
        cleanup_distributed(info)
    """))
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    base.update(PYTHONPATH=str(ROOT), SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost",
                MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script)], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)})
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=False):
        assert p.returncode == 0, err
    lines = sorted(out.strip() for out, _ in outs)
    assert lines == ["slurm 0 2 gloo 3", "slurm 1 2 gloo 3"]
