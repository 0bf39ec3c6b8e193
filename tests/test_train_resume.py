"""Checkpoints: atomic writes, contents loadable by create_RWKV_Model, exact resume."""
import errno
import json

import pytest
import torch
from train_util import TINY_CONFIG, make_tiny_rec, tiny_argv

from rwkv_clip import create_RWKV_Model, load_model_configs
from rwkv_clip.errors import CheckpointError, ResumeError
from rwkv_clip.train import checkpoint as ckpt_io
from rwkv_clip.train import main, parse_args


@pytest.fixture(scope="module")
def tiny_rec(tmp_path_factory):
    return make_tiny_rec(tmp_path_factory.mktemp("data"), n=24)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_atomic_save_never_leaves_a_broken_file(tmp_path, monkeypatch):
    """A full disk during a save: one clear error, the previous checkpoint kept, no
    temporary file left."""
    good = {"state_dict": {"w": torch.ones(3)}, "step": 1}
    ckpt_io.save_checkpoint(good, tmp_path, "step_1.pt")
    latest = tmp_path / "checkpoints" / ckpt_io.LATEST
    assert torch.load(latest, weights_only=True)["step"] == 1

    real_save = torch.save

    def crash_midway(obj, f, *a, **kw):
        f.write(b"partial bytes")  # the disk fills after part of the file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", crash_midway)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step_2.pt \(the "
                       r"disk is full; \d+ MiB free there\); the partial file was removed and "
                       r"the previous checkpoint \(epoch_latest.pt\) is kept"):
        ckpt_io.save_checkpoint({"step": 2}, tmp_path, "step_2.pt")
    monkeypatch.setattr(torch, "save", real_save)
    assert not (tmp_path / "checkpoints" / "step_2.pt").exists()
    assert torch.load(latest, weights_only=True)["step"] == 1  # last good one kept
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()
            if p.name.startswith(".")] == []  # no temporary files left


def test_files_that_are_not_checkpoints_say_so(tmp_path):
    cases = {"empty.pt": b"", "run.json": b'{"step": 3}', "random.pt": bytes(range(7, 250)),
             "truncated.pt": None}
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(100)}, good)
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(good.read_bytes()[:200] if content is None else content)
        with pytest.raises(CheckpointError, match=f"{name} is not a PyTorch checkpoint") as exc:
            ckpt_io.load_checkpoint(path)
        assert "weights_only" not in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(CheckpointError, match=r"empty\.pt is not a PyTorch checkpoint \(empty"):
        ckpt_io.load_checkpoint(tmp_path / "empty.pt")
    with pytest.raises(CheckpointError, match="looks like JSON"):
        ckpt_io.load_checkpoint(tmp_path / "run.json")
    with pytest.raises(ResumeError, match="not a training checkpoint"):
        ckpt_io.load_checkpoint(good)  # a torch file, but plain weights


def test_retention_keeps_the_newest_and_latest(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in range(1, 6):
        ckpt_io.save_checkpoint({"step": step}, tmp_path, f"step_{step}.pt", keep=2)
    assert sorted(p.name for p in folder.iterdir()) == [ckpt_io.LATEST, "step_4.pt",
                                                        "step_5.pt"]
    assert torch.load(folder / ckpt_io.LATEST, weights_only=True)["step"] == 5
    previous = None
    for step in range(6, 8):  # open_clip's --delete-previous-checkpoint
        previous = str(ckpt_io.save_checkpoint({"step": step}, tmp_path, f"epoch_{step}.pt",
                                               keep=0, previous=previous))
    assert sorted(p.name for p in folder.iterdir()) == ["epoch_7.pt", ckpt_io.LATEST,
                                                        "step_4.pt", "step_5.pt"]
    assert torch.load(folder / ckpt_io.LATEST, weights_only=True)["step"] == 7


def test_output_not_writable_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match=r"output folder .*a_file/run is not writable"):
        main(parse_args(["--output", str(blocker / "run"), "--device", "cpu"]))


def test_resume_latest_without_checkpoint_starts_fresh(tmp_path):
    assert ckpt_io.resolve_resume("latest", tmp_path) is None
    with pytest.raises(ResumeError, match="no such checkpoint"):
        ckpt_io.resolve_resume(str(tmp_path / "missing.pt"), tmp_path)


@pytest.mark.slow
def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path, tiny_rec):
    """fp32 CPU, dropout and drop path on (RNG states must be restored), accumulation 2
    (the data position is a micro-batch count): a run resumed from its step-2
    checkpoint (mid-epoch) ends with the same weights as the uninterrupted run."""
    extra = ["--epochs", "2", "--gradient-acc", "2", "--batch-size", "4", "--dropout", "0.1",
             "--drop-path-rate", "0.1", "--save-every-steps", "2", "--seed", "5"]
    full = main(parse_args(tiny_argv(tmp_path / "full", tiny_rec, *extra)))
    steps_per_epoch = 24 // 4 // 2
    assert full["steps"] == 2 * steps_per_epoch and full["epochs"] == 2
    ckdir = tmp_path / "full" / "checkpoints"
    names = sorted(p.name for p in ckdir.iterdir())
    assert {"step_2.pt", "epoch_1.pt", "epoch_2.pt", ckpt_io.LATEST} <= set(names)
    assert torch.load(ckdir / ckpt_io.LATEST, weights_only=True)["step"] == full["steps"]

    # the checkpoint: model state dict loadable by create_RWKV_Model, + training state
    state = torch.load(ckdir / "step_2.pt", weights_only=True)
    assert state["step"] == 2 and state["epoch"] == 0 and state["batch_in_epoch"] == 4
    for key in ("optimizer", "rng", "args", "model_config", "total_steps"):
        assert state[key] is not None, key
    assert state["scaler"] is None  # fp32
    assert not any(k.startswith("module.") for k in state["state_dict"])
    reloaded = create_RWKV_Model(load_model_configs(TINY_CONFIG),
                                 model_weight_path=ckdir / "epoch_2.pt")
    assert _max_diff(_weights(reloaded), _weights(full["model"])) == 0

    resumed = main(parse_args(tiny_argv(tmp_path / "resumed", tiny_rec, *extra,
                                        "--resume", str(ckdir / "step_2.pt"))))
    assert resumed["steps"] == full["steps"]
    assert _max_diff(_weights(resumed["model"]), _weights(full["model"])) < 1e-6
    # and the check has teeth: the step-2 weights are far from the final ones
    assert _max_diff(state["state_dict"], _weights(full["model"])) > 1e-4

    # a checkpoint in the format before lr_at (format 1: a OneCycleLR state dict, and the
    # scheduler's keys in the optimizer's param groups) resumes to the same weights
    old = tmp_path / "format1_step_2.pt"
    torch.save(_as_format_1(state, lr=1e-3, total_steps=full["steps"], steps_done=2), old)
    from_old = main(parse_args(tiny_argv(tmp_path / "from_old", tiny_rec, *extra,
                                         "--resume", str(old))))
    assert _max_diff(_weights(from_old["model"]), _weights(full["model"])) < 1e-6


ONE_CYCLE_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum")


def _as_format_1(ckpt: dict, lr: float, total_steps: int, steps_done: int) -> dict:
    """``ckpt`` as the trainer wrote it while it stepped a torch OneCycleLR object."""
    from torch.optim.lr_scheduler import OneCycleLR

    from rwkv_clip.train.schedule import warmup_fraction
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in ckpt["optimizer"]["param_groups"]]
    opt = torch.optim.AdamW([{"params": [p]} for p in params], lr=lr, betas=(0.9, 0.98))
    sched = OneCycleLR(opt, max_lr=lr, total_steps=total_steps,
                       pct_start=warmup_fraction(0.1, total_steps))
    for _ in range(steps_done):
        opt.step()
        sched.step()
    old = {k: v for k, v in ckpt.items() if k != "total_steps"}
    old["format_version"], old["scheduler"] = 1, sched.state_dict()
    old["total_steps"] = total_steps
    old["optimizer"] = {"state": ckpt["optimizer"]["state"], "param_groups": [
        {**group, **{k: sched_group[k] for k in ONE_CYCLE_GROUP_KEYS}}
        for group, sched_group in zip(ckpt["optimizer"]["param_groups"],
                                      opt.state_dict()["param_groups"], strict=True)]}
    return old


@pytest.mark.slow
def test_resume_latest_continues_and_refuses_other_models(tmp_path, tiny_rec):
    argv = tiny_argv(tmp_path / "run", tiny_rec, "--max-steps", "2")
    first = main(parse_args(argv))
    assert first["steps"] == 2
    latest = tmp_path / "run" / "checkpoints" / ckpt_io.LATEST
    assert torch.load(latest, weights_only=True)["step"] == 2
    # a longer schedule given again is a change of the run: refused unless meant
    longer = ["--resume", "latest", "--max-steps", "3"]
    with pytest.raises(ResumeError, match=r"--max-steps 3 contradicts the checkpoint's 2 "
                                          r"\(add --resume-allow-changes"):
        main(parse_args(tiny_argv(tmp_path / "run", tiny_rec, *longer)))
    again = main(parse_args(tiny_argv(tmp_path / "run", tiny_rec, *longer,
                                      "--resume-allow-changes")))
    assert again["steps"] == 3
    log = (tmp_path / "run" / "training.log").read_text()
    assert "resumed from" in log and "step 2" in log and "schedule length changed (2 -> 3" in log
    with pytest.raises(ResumeError, match="--n-layer 1 contradicts the checkpoint's 2"):
        main(parse_args(tiny_argv(tmp_path / "run", tiny_rec, "--resume", "latest",
                                  "--n-layer", "1")))
    # the data position is counted in batches: never changeable
    with pytest.raises(ResumeError, match="--batch-size 4 contradicts.*data position"):
        main(parse_args(tiny_argv(tmp_path / "run", tiny_rec, "--resume", "latest",
                                  "--batch-size", "4", "--resume-allow-changes")))
    with pytest.raises(ResumeError, match="--train-data .*other.* contradicts the checkpoint"):
        main(parse_args(tiny_argv(tmp_path / "run", tiny_rec + "_other", "--resume", "latest")))


@pytest.mark.slow
def test_resume_takes_data_config_and_schedule_from_the_checkpoint(tmp_path, tiny_rec):
    """``--resume latest --output DIR`` alone continues the same run (not the
    built-in data set, not the default config, not the default schedule)."""
    out = tmp_path / "run"
    main(parse_args(tiny_argv(out, tiny_rec, "--epochs", "3", "--max-steps", "2",
                              "--lr", "5e-4")))
    again = main(parse_args(["--resume", "latest", "--output", str(out), "--device", "cpu",
                             "--workers", "0", "--progress", "False", "--tensorboard",
                             "False"]))
    assert again["steps"] == 2 and again["zero_shot"] is None  # nothing left to train
    log = (out / "training.log").read_text()
    taken = next(line for line in log.splitlines() if "settings from the checkpoint:" in line)
    for setting in (f"train_data={tiny_rec!r}", "data_format='rec'", "n_embd=64", "lr=0.0005",
                    "max_steps=2", "epochs=3", "batch_size=8"):
        assert setting in taken, (setting, taken)
    assert "built-in dataset" not in log


@pytest.mark.slow
def test_pretrained_starts_fresh_from_weights(tmp_path, tiny_rec):
    first = main(parse_args(tiny_argv(tmp_path / "a", tiny_rec, "--max-steps", "1")))
    ckpt = tmp_path / "a" / "checkpoints" / ckpt_io.LATEST
    second = main(parse_args(tiny_argv(tmp_path / "b", tiny_rec, "--max-steps", "1",
                                       "--pretrained", str(ckpt), "--lock-image", "True")))
    assert second["steps"] == 1
    w1, w2 = _weights(first["model"]), _weights(second["model"])
    # the image tower stayed at the pretrained weights, the text tower moved on
    assert _max_diff({k: v for k, v in w1.items() if k.startswith("image_model.")},
                     {k: v for k, v in w2.items() if k.startswith("image_model.")}) == 0
    assert _max_diff({k: v for k, v in w1.items() if k.startswith("text_model.")},
                     {k: v for k, v in w2.items() if k.startswith("text_model.")}) > 0
    saved_args = torch.load(tmp_path / "b" / "checkpoints" / ckpt_io.LATEST,
                            weights_only=True)["args"]
    assert saved_args["pretrained"] == str(ckpt)
    json.dumps(saved_args)  # JSON-safe


@pytest.mark.slow
def test_nan_loss_stops_with_a_clear_message_and_keeps_the_checkpoint(tmp_path, tiny_rec):
    from rwkv_clip.train import TrainingError
    model = create_RWKV_Model(load_model_configs(TINY_CONFIG))
    with torch.no_grad():
        model.text_model.emb.weight.fill_(float("nan"))
    bad = tmp_path / "nan.pt"
    torch.save(model.state_dict(), bad)
    with pytest.raises(TrainingError, match="not finite.*last good checkpoint: none"):
        main(parse_args(tiny_argv(tmp_path / "n", tiny_rec, "--pretrained", str(bad))))
    assert not (tmp_path / "n" / "checkpoints" / ckpt_io.LATEST).exists()


def test_resume_with_another_config_names_only_the_typed_flags(tmp_path, tiny_rec):
    """A run of another model resumed with --config: one contradiction naming --config (not
    a list of tower flags nobody typed); with --resume-allow-changes, one full line saying
    how the weights differ, not torch's truncated 'Error(s) in loading state_dict'."""
    from rwkv_clip.errors import one_line

    other = ["--n-layer", "1", "--image-depth", "1", "--max-steps", "1"]
    assert main(parse_args(tiny_argv(tmp_path / "run", tiny_rec, *other)))["steps"] == 1
    with pytest.raises(ResumeError) as exc:
        main(parse_args(tiny_argv(tmp_path / "run", tiny_rec, "--resume", "latest")))
    message = str(exc.value)
    assert "\n" not in message and message.count("contradicts") == 0, message
    assert f"--config {TINY_CONFIG} gives another model than the checkpoint's" in message
    assert "n_layer 2 vs 1" in message and "image_depth 2 vs 1" in message
    assert "--n-layer" not in message and "--image-depth" not in message
    assert "--batch-size" not in message  # typed, but the checkpoint's value
    with pytest.raises(ResumeError) as exc:
        main(parse_args(tiny_argv(tmp_path / "run", tiny_rec, "--resume", "latest",
                                  "--resume-allow-changes")))
    message = one_line(exc.value)
    assert "Error(s)" not in message and str(exc.value) == message
    assert "do not fit the changed model settings" in message
    assert "56 keys the checkpoint lacks, e.g. text_model.blocks.1." in message
    assert "--pretrained" in message
