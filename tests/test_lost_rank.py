"""A rank SIGKILLed in a 2-process gloo job on CPU: the survivor stops within 60 s with one
line (``lost rank R at step S; last checkpoint: ...``) and exit status 3, every checkpoint
left loads, and going on ends with the weights of the uninterrupted 2-rank run.

Launched the SLURM way (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, MASTER_ADDR /
MASTER_PORT, no torchrun) and under torchrun, where ``--max-restarts 1`` recovers by itself.
The kill step is drawn from ``RWKV_CLIP_LOST_RANK_SEED`` (default 0). Every process runs one
thread, as the reference does: the resumed runs then repeat its arithmetic exactly, so the
weights are compared bitwise.
"""
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from train_util import REPO, TINY_CONFIG, make_tiny_rec, tiny_argv

from rwkv_clip.faults import EXIT_LOST_RANK
from rwkv_clip.train.checkpoint import LATEST

# 32 pairs over 2 ranks in batches of 2: 8 steps per epoch, 16 in all; a checkpoint every 3
# steps and at the end of each epoch
EXTRA = ["--batch-size", "2", "--epochs", "2", "--save-every-steps", "3", "--seed", "3"]
TOTAL_STEPS = 16
LINE = re.compile(r"^train\.py: error: lost rank (\d+)(?: \(it hosts the rendezvous store\))? "
                  r"at step (\d+); last checkpoint: (\S+); (.+)$", re.M)
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_step() -> int:
    return random.Random(int(os.environ.get("RWKV_CLIP_LOST_RANK_SEED", "0"))).randint(2, 11)


def start_slurm(argv, logs: Path, port: int | None = None) -> list[subprocess.Popen]:
    """Two ranks with only SLURM's variables and MASTER_ADDR / MASTER_PORT."""
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(SLURM_NTASKS="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or _free_port()))
    logs.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([sys.executable, str(REPO / "train.py"), *argv],
                             env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                             stdout=open(logs / f"rank{r}.txt", "w"), stderr=subprocess.STDOUT)
            for r in range(2)]


def start_torchrun(argv, log: Path, max_restarts: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--max-restarts", str(max_restarts), "--master-port", str(_free_port()),
           str(REPO / "train.py"), *argv]
    return subprocess.Popen(cmd, env=ENV, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait_for_step(out: Path, step: int, procs, timeout: float = 300) -> None:
    log, deadline = out / "training.log", time.time() + timeout
    pattern = re.compile(rf"\bstep {step}/")
    while time.time() < deadline:
        if log.exists() and pattern.search(log.read_text()):
            return
        assert all(p.poll() is None for p in procs), "the run ended before the kill"
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout} s")


def worker_pids(torchrun: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of torchrun's worker processes (from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != torchrun.pid:
                continue
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry)
    return found


def wait_gone(pid: int, timeout: float) -> float:
    """Seconds until process ``pid`` is gone (or a zombie), at most ``timeout``."""
    start = time.time()
    while time.time() - start < timeout:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return time.time() - start
        if state == "Z":
            return time.time() - start
        time.sleep(0.05)
    return timeout


def checkpoints_load(out: Path) -> list[str]:
    """Every checkpoint file loads (no half-written one); their names."""
    names = sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith("."))
    for name in names:
        assert "state_dict" in torch.load(out / "checkpoints" / name, weights_only=True), name
    return names


def check_lost_line(text: str, lost: int, killed_at: int, out: Path, how: str,
                    pruned: bool = False) -> None:
    """The survivor's one line: the lost rank, a step at or after the kill, the newest
    complete checkpoint (a file that loads, unless a later run pruned it; or none yet)
    and how to go on."""
    lines = LINE.findall(text)
    assert len(lines) == 1, text[-3000:]
    rank, step, checkpoint, rest = lines[0]
    assert int(rank) == lost and killed_at <= int(step) < TOTAL_STEPS, lines
    # a save follows its step (and a collective starts it): the newest save at or before
    # the step, or the one before it when the peer was lost between the step and its save
    saves = [(0, "none yet")] + sorted([(n, f"step_{n}.pt") for n in range(3, TOTAL_STEPS, 3)]
                                       + [(8, "epoch_1.pt")])
    done = [save for save in saves if save[0] <= int(step)]
    expected = {done[-1], [save for save in saves if save[0] < int(step)][-1]}
    named = {name for _, name in expected}
    if checkpoint == "none yet":
        assert "none yet" in named, lines
    else:
        assert Path(checkpoint).parent == out / "checkpoints", lines
        assert Path(checkpoint).name in named, (lines, named)
        if not pruned:
            saved = dict((name, n) for n, name in saves)[Path(checkpoint).name]
            assert torch.load(checkpoint, weights_only=True)["step"] == saved
    assert rest == how


def final_weights(out: Path) -> dict:
    state = torch.load(out / "checkpoints" / LATEST, weights_only=True)
    assert state["step"] == TOTAL_STEPS
    return state["state_dict"]


def assert_same_weights(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    differ = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


@pytest.fixture(scope="module")
def run_setup(tmp_path_factory):
    """Data and the uninterrupted 2-rank run's final weights."""
    tmp = tmp_path_factory.mktemp("lost_rank")
    data = make_tiny_rec(tmp / "data", n=32)
    out = tmp / "reference"
    procs = start_slurm(tiny_argv(out, data, *EXTRA), tmp / "reference_logs")
    for r, p in enumerate(procs):
        assert p.wait(timeout=600) == 0, (tmp / "reference_logs" / f"rank{r}.txt").read_text()
    return tmp, data, final_weights(out)


@pytest.mark.slow
def test_slurm_lost_rank_stops_the_survivor_and_resume_ends_as_uninterrupted(run_setup):
    """Rank 0 (which hosts the rendezvous store) is killed; rank 1 names it."""
    tmp, data, reference = run_setup
    out, logs = tmp / "slurm", tmp / "slurm_logs"
    argv = tiny_argv(out, data, *EXTRA)
    procs = start_slurm(argv, logs)
    step = _kill_step()
    wait_for_step(out, step, procs)
    procs[0].send_signal(signal.SIGKILL)
    killed = time.time()
    rc = procs[1].wait(timeout=120)
    took = time.time() - killed
    procs[0].wait(timeout=60)
    text = (logs / "rank1.txt").read_text()
    assert rc == EXIT_LOST_RANK, text[-3000:]
    assert took < 60, took
    assert "Traceback" not in text, text[-3000:]
    check_lost_line(text, 0, step, out, "resume with --resume latest")
    checkpoints_load(out)
    # both ranks again with --resume latest: the uninterrupted run's weights
    procs = start_slurm([*argv, "--resume", "latest"], tmp / "slurm_resume_logs")
    for r, p in enumerate(procs):
        assert p.wait(timeout=600) == 0, (tmp / "slurm_resume_logs" / f"rank{r}.txt").read_text()
    assert_same_weights(final_weights(out), reference)


@pytest.mark.slow
def test_a_silent_rank_is_noticed_by_its_heartbeat(run_setup):
    """SIGSTOP: the peer's sockets stay open, so the collective blocks (as NCCL's do for a
    dead peer); the heartbeat names the rank after half the --dist-timeout, before the
    timeout itself."""
    tmp, data, _ = run_setup
    out, logs = tmp / "silent", tmp / "silent_logs"
    procs = start_slurm(tiny_argv(out, data, *EXTRA, "--dist-timeout", "40"), logs)
    step = _kill_step()
    wait_for_step(out, step, procs)
    procs[1].send_signal(signal.SIGSTOP)
    stopped = time.time()
    try:
        rc = procs[0].wait(timeout=120)
        took = time.time() - stopped
    finally:
        procs[1].kill()
        procs[1].wait(timeout=60)
    text = (logs / "rank0.txt").read_text()
    assert rc == EXIT_LOST_RANK, text[-3000:]
    assert 15 <= took < 40, took  # the silence limit: min(30 s, 40 s / 2) = 20 s
    assert "Traceback" not in text, text[-3000:]
    check_lost_line(text, 1, step, out, "resume with --resume latest")


@pytest.mark.slow
def test_torchrun_lost_rank_stops_the_survivor_with_status_3(run_setup):
    tmp, data, _ = run_setup
    out, log = tmp / "torchrun", tmp / "torchrun.txt"
    run = start_torchrun(tiny_argv(out, data, *EXTRA), log)
    step = _kill_step()
    wait_for_step(out, step, [run])
    pids = worker_pids(run)
    os.kill(pids[1], signal.SIGKILL)
    took = wait_gone(pids[0], 120)
    assert run.wait(timeout=120) != 0
    text = log.read_text()
    assert took < 60, (took, text[-3000:])
    check_lost_line(text, 1, step, out, "resume with --resume latest")
    # torchrun's summary: rank 0 ended with the distinct status
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s*\n\s*exitcode\s*: 3 ", text), text[-3000:]
    assert f'File "{REPO / "rwkv_clip"}' not in text, text[-3000:]  # no traceback of ours
    checkpoints_load(out)


@pytest.mark.slow
def test_torchrun_max_restarts_recovers_by_itself(run_setup):
    """Without --resume: the restarted attempt resumes from the newest checkpoint."""
    tmp, data, reference = run_setup
    out, log = tmp / "elastic", tmp / "elastic.txt"
    run = start_torchrun(tiny_argv(out, data, *EXTRA), log, max_restarts=1)
    step = _kill_step()
    wait_for_step(out, step, [run])
    os.kill(worker_pids(run)[1], signal.SIGKILL)
    assert run.wait(timeout=600) == 0, log.read_text()[-3000:]
    text = log.read_text()
    check_lost_line(text, 1, step, out, "torchrun restarts the job, which resumes by itself",
                    pruned=True)  # --keep-checkpoints: the restarted run saved 5 more
    assert "torchrun restart 1: resuming as with --resume latest" in text
    assert_same_weights(final_weights(out), reference)


# ----------------------------------------------------------------------------- evaluator

def _image_folder(root: Path, n: int = 160) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        cls = root / ("cat", "dog")[i % 2]
        cls.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(cls / f"{i}.png")
    return root


@pytest.mark.slow
def test_evaluator_lost_rank_writes_no_result(tmp_path):
    folder = _image_folder(tmp_path / "images")
    results = tmp_path / "results"
    argv = [str(REPO / "zero_shot.py"), "--config", TINY_CONFIG, "--dataset", "imagefolder",
            "--data-root", str(folder), "--workers", "0", "--device", "cpu", "--batch-size", "1",
            "--output-dir", str(results)]
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(SLURM_NTASKS="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    logs = [tmp_path / f"rank{r}.txt" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, *argv],
                              env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=open(logs[r], "w"), stderr=subprocess.STDOUT)
             for r in range(2)]
    deadline = time.time() + 300
    while "imagefolder: 160 images" not in logs[0].read_text():  # rank 0 starts the set
        assert procs[0].poll() is None and time.time() < deadline, logs[0].read_text()
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.time()
    rc = procs[0].wait(timeout=120)
    took = time.time() - killed
    procs[1].wait(timeout=60)
    text = logs[0].read_text()
    assert rc == EXIT_LOST_RANK, text[-3000:]
    assert took < 60, took
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if "error:" in line]
    assert lines == ["zero_shot.py: error: lost rank 1 while evaluating imagefolder; complete "
                     "results: none; nothing was written for imagefolder"], text[-3000:]
    assert not results.exists() or not any(results.iterdir())  # no result, no score line


# ----------------------------------------------------------------------------- pieces

def _store_env(monkeypatch):
    """A rendezvous store on a free port, as MASTER_ADDR / MASTER_PORT name it."""
    port = _free_port()
    server = torch.distributed.TCPStore("127.0.0.1", port, is_master=True,
                                        wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    return torch.distributed.PrefixStore("rwkv_clip/peers//0/", server), server


def _watch(rank: int, world: int):
    from rwkv_clip.distributed import DistInfo
    from rwkv_clip.faults import PeerWatch
    return PeerWatch(DistInfo(rank=rank, world_size=world, backend="gloo"), 600, "train.py")


def test_peer_watch_names_the_rank_whose_heartbeat_stopped(monkeypatch):
    peers, _server = _store_env(monkeypatch)
    watch = _watch(0, 3)
    watch.close()  # its heartbeat thread would act on the published loss (exit 3)
    assert peers.get("left/0").decode() == "done"
    beating = threading.Event()
    beating.set()

    def beat():  # rank 1 keeps beating; rank 2 beat once and went silent
        while beating.is_set():
            peers.add("beat/1", 1)
            time.sleep(0.2)
    peers.add("beat/2", 1)
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        assert watch.identify() == "lost rank 2"
        # published: the other survivors read the same answer without waiting
        assert peers.get("lost").decode() == "lost rank 2"
    finally:
        beating.clear()
        thread.join()


def test_peer_watch_names_a_peer_that_stopped_with_an_error(monkeypatch):
    peers, _server = _store_env(monkeypatch)
    peers.set("left/1", "error")
    watch = _watch(0, 2)
    watch.close()
    assert watch.identify() == "rank 1 stopped with an error (its own message says why)"


def test_peer_watch_is_inert_in_one_process():
    from rwkv_clip.distributed import DistInfo
    from rwkv_clip.faults import PeerWatch
    watch = PeerWatch(DistInfo(), 600, "train.py")
    watch.check(RuntimeError("gloo: Connection reset by peer"))  # returns: nothing to stop
    watch.close()


def test_collective_failures_are_told_from_own_errors():
    from rwkv_clip.errors import DataError
    from rwkv_clip.faults import is_collective_failure
    assert is_collective_failure(RuntimeError(
        "[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:35230: Connection reset by peer"))
    assert is_collective_failure(torch.distributed.DistBackendError("NCCL communicator aborted"))
    assert not is_collective_failure(ValueError("bad shape"))
    assert not is_collective_failure(DataError("truncated record", path="x.rec"))


def test_newest_checkpoint_is_the_file_latest_links(tmp_path):
    from rwkv_clip.train.checkpoint import newest_checkpoint, save_checkpoint
    assert newest_checkpoint(tmp_path) is None
    save_checkpoint({"step": 3}, tmp_path, "step_3.pt")
    save_checkpoint({"step": 6}, tmp_path, "step_6.pt")
    assert newest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_6.pt"


def test_a_torchrun_restart_resumes_from_the_newest_checkpoint(tmp_path, monkeypatch):
    import logging
    from types import SimpleNamespace

    from rwkv_clip.train.checkpoint import save_checkpoint
    from rwkv_clip.train.loop import lost_rank_outcome, resume_after_restart
    log = logging.getLogger("test_lost_rank")
    args = SimpleNamespace(output=str(tmp_path), resume=None, pretrained="w.pt")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    resume_after_restart(args, log)
    assert args.resume is None  # the first attempt starts as told
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    resume_after_restart(args, log)
    assert args.resume == "latest" and args.pretrained == "w.pt"  # nothing saved yet
    assert lost_rank_outcome(tmp_path) == "last checkpoint: none yet; resume with --resume latest"
    save_checkpoint({"step": 4}, tmp_path, "step_4.pt")
    args = SimpleNamespace(output=str(tmp_path), resume="old/step_2.pt", pretrained=None)
    resume_after_restart(args, log)
    assert args.resume == "latest"  # the run saved since: its newest checkpoint wins
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert lost_rank_outcome(tmp_path) == (
        f"last checkpoint: {tmp_path / 'checkpoints' / 'step_4.pt'}; torchrun restarts the "
        "job, which resumes by itself")


def test_dist_timeout_must_be_positive(capsys):
    from rwkv_clip.eval.cli import zero_shot_main
    from rwkv_clip.train.args import parse_args
    with pytest.raises(SystemExit) as stopped:
        parse_args(["--dist-timeout", "0"])
    assert stopped.value.code == 2
    assert zero_shot_main(["--dist-timeout", "-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "train.py: error: --dist-timeout must be > 0 seconds, got 0.0",
        "zero_shot.py: error: --dist-timeout must be > 0 seconds, got -1.0"]
