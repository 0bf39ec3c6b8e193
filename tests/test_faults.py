"""Kill a tiny training run at random moments; what is left must load and resume exactly.

Each round starts ``train.py ... --resume latest`` (a fresh start when nothing is saved
yet), waits for a new step line, then sends SIGKILL, SIGINT or SIGTERM after a random
delay: 0-0.05 s in even rounds (a checkpoint is written right after every step line, so
these land inside the save) and 0.05-0.5 s in odd ones (mostly inside the next step);
the first six rounds send each signal once at each of the two moments.
A round moves the run on by one or two steps, so the 60-step run outlasts the rounds. After
each round every checkpoint file loads with ``weights_only=True``; SIGINT / SIGTERM end
with exit status 130 / 143 and ``interrupted at step N; resume with --resume latest``.
At the end ``--resume latest`` finishes with the weights of an uninterrupted run.

Rounds: ``RWKV_CLIP_FAULT_ROUNDS`` (default 10), shared between two independent chains
(two output folders, each its own random stream) that run side by side beside the
reference run: every process uses one thread, so two cores take two at once. A round
costs the start of a training process plus a second of steps.
"""
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from train_util import REPO, make_tiny_rec, tiny_argv

from rwkv_clip.train.checkpoint import LATEST

EXTRA = ["--epochs", "3", "--batch-size", "2", "--save-every-steps", "1", "--seed", "3",
         "--dropout", "0.1", "--keep-checkpoints", "3"]


def _start(argv, log_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *argv], stdout=out,
                            stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return proc, out


STEP_LINE = re.compile(r"\bstep \d+/\d+|\bstep:\d+")  # the plain and the original log line


def _steps_logged(path) -> int:
    return len(STEP_LINE.findall(path.read_text())) if path.exists() else 0


def _check_checkpoints(folder):
    """Every checkpoint file (epoch_latest.pt too) loads; returns the kept ones' names
    (all but epoch_latest.pt)."""
    names = sorted(p.name for p in folder.iterdir() if p.suffix == ".pt")
    for name in names:
        state = torch.load(folder / name, weights_only=True)
        assert {"state_dict", "optimizer", "step", "rng"} <= state.keys(), name
    return [n for n in names if n != LATEST]


def _chain(tmp_path, name, data, rounds, seed):
    """Kill rounds on one run folder, then finish it; returns its final checkpoint."""
    out = tmp_path / name
    argv = tiny_argv(out, data, *EXTRA, "--resume", "latest")
    rng = random.Random(seed)
    signals = [signal.SIGKILL, signal.SIGINT, signal.SIGTERM]
    finished, stopped = False, 0
    for i in range(rounds):
        before = _steps_logged(out / "training.log")
        proc, log = _start(argv, tmp_path / f"{name}_round{i}.txt")
        deadline = time.time() + 120
        while (proc.poll() is None and _steps_logged(out / "training.log") <= before
               and time.time() < deadline):
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.05) if i % 2 == 0 else rng.uniform(0.05, 0.5))
        sig = signals[i % 3] if i < 6 else rng.choice(signals)  # 6: each kind at each moment
        if proc.poll() is None:
            proc.send_signal(sig)
        rc = proc.wait(timeout=120)
        log.close()
        text = (tmp_path / f"{name}_round{i}.txt").read_text()
        assert "Traceback" not in text, text[-3000:]
        stopped += rc != 0
        if rc == 0:
            finished = True  # the run ended before the signal landed
        elif sig == signal.SIGKILL:
            assert rc == -signal.SIGKILL, (rc, text[-2000:])
        else:
            assert rc == 128 + sig, (sig, rc, text[-2000:])
            assert "interrupted at step" in text and "resume with --resume latest" in text
        kept = _check_checkpoints(out / "checkpoints") if (out / "checkpoints").exists() else []
        # --keep-checkpoints 3. A save writes the new file before pruning the oldest (a
        # checkpoint is never lost), so a SIGKILL between the two leaves one more; the
        # next save prunes it (checked at the end). SIGINT / SIGTERM finish the save.
        assert len(kept) <= 3 + (sig == signal.SIGKILL and rc != 0), (sig, rc, kept)
        if finished:
            break
    assert stopped >= min(rounds, 3), "the signals came too late to test anything"
    # finish the run
    proc, log = _start(argv, tmp_path / f"{name}_final.txt")
    assert proc.wait(timeout=600) == 0, (tmp_path / f"{name}_final.txt").read_text()[-3000:]
    log.close()
    assert len(_check_checkpoints(out / "checkpoints")) <= 3
    # the temporary files of saves cut short by SIGKILL are gone too
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    return torch.load(out / "checkpoints" / LATEST, weights_only=True)


@pytest.mark.slow
def test_random_kills_leave_loadable_checkpoints_and_resume_exactly(tmp_path):
    data = make_tiny_rec(tmp_path / "data", n=40)  # 20 steps per epoch, 60 in all
    # the reference runs as the interrupted runs do (a subprocess with one thread): with
    # another thread count the float sums differ in the last bits and the runs diverge
    ref_proc, ref_log = _start(tiny_argv(tmp_path / "reference", data, *EXTRA),
                               tmp_path / "ref.txt")
    rounds = int(os.environ.get("RWKV_CLIP_FAULT_ROUNDS", "10"))
    seed = int(os.environ.get("RWKV_CLIP_FAULT_SEED", "0"))
    shares = [rounds - rounds // 2, rounds // 2]  # 10 rounds: 5 per chain
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_chain, tmp_path, f"run{c}", data, n, seed + c)
                for c, n in enumerate(shares) if n > 0]
        finals = [r.result() for r in runs]
    assert ref_proc.wait(timeout=600) == 0, (tmp_path / "ref.txt").read_text()[-3000:]
    ref_log.close()
    reference = torch.load(tmp_path / "reference" / "checkpoints" / LATEST, weights_only=True)
    assert reference["step"] == 60
    ref = reference["state_dict"]
    for final in finals:  # each interrupted run ends with the uninterrupted run's weights
        assert final["step"] == 60
        diff = max((final["state_dict"][k].double() - ref[k].double()).abs().max().item()
                   for k in ref)
        assert diff < 1e-6, diff
