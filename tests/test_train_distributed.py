"""torchrun with 2 processes on CPU (gloo): trains, syncs, saves on rank 0, exits cleanly."""
import os
import subprocess
import sys

import pytest
import torch
from train_util import REPO, TINY_CONFIG, make_tiny_rec, tiny_argv

from rwkv_clip import create_RWKV_Model, load_model_configs
from rwkv_clip.train.checkpoint import LATEST


def _torchrun(argv, cwd, nproc=2):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master-port", str(29500 + os.getpid() % 1000), str(REPO / "train.py"), *argv]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("loss_flags", [
    [], ["--local-loss", "True", "--gather-with-grad", "True", "--open-checkpoint", "True"],
    ["--siglip"], ["--siglip", "--siglip-dist-impl", "gather"]],
    ids=["default", "local+grad+checkpointing", "siglip-bidir", "siglip-gather"])
def test_two_process_gloo_run(tmp_path, loss_flags):
    prefix = make_tiny_rec(tmp_path, n=32)
    out_dir = tmp_path / "out"
    argv = tiny_argv(out_dir, prefix, "--batch-size", "4", "--gradient-acc", "2",
                     "--save-every-steps", "1", *loss_flags)
    run = _torchrun(argv, tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = run.stdout + run.stderr
    for bad in ("Traceback", "abort", "terminate called", "SIGABRT"):
        assert bad not in text, text[-3000:]
    log = (out_dir / "training.log").read_text()
    assert "rank 0/2 on cpu (backend gloo)" in log
    # 32 samples over 2 ranks, batch 4, accumulation 2 -> 2 optimizer steps per epoch;
    # global batch 16 = 4 x 2 x 2
    assert "2 optimizer steps/epoch" in log and "global batch 16" in log
    assert log.count("pairs/s") == 2  # rank 0 alone logs the progress lines
    # the dispatch table: rank 0 chose, every rank took its choices
    assert "dispatch: every rank runs rank 0's " in log
    ckdir = out_dir / "checkpoints"
    assert {"step_1.pt", "step_2.pt", "epoch_1.pt", LATEST} <= {p.name for p in ckdir.iterdir()}
    state = torch.load(ckdir / LATEST, weights_only=True)
    assert len(state["rng"]) == 2  # both ranks' RNG states, for an exact resume
    model = create_RWKV_Model(load_model_configs(TINY_CONFIG), model_weight_path=ckdir / LATEST)
    first = torch.load(ckdir / "step_1.pt", weights_only=True)["state_dict"]
    assert any(not torch.equal(first[k], v) for k, v in model.state_dict().items())
