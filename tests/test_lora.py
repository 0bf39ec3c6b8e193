"""LoRA fine-tuning: what trains, merged exports, exact resume, evaluation of a LoRA
checkpoint, and one-line errors."""
import sys

import pytest
import torch
from train_util import TINY_CONFIG, make_tiny_rec, tiny_argv, tiny_model

from rwkv_clip import create_RWKV_Model, load_model_configs
from rwkv_clip.checkpoint_files import read_state_dict
from rwkv_clip.errors import CheckpointError
from rwkv_clip.export import main as export_main
from rwkv_clip.lora import LoraSettings, add_adapters, merge_state_dict, parameter_counts
from rwkv_clip.train import cli, main, parse_args

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def tiny_rec(tmp_path_factory):
    return make_tiny_rec(tmp_path_factory.mktemp("data"), n=24)


@pytest.fixture(scope="module")
def base_weights(tmp_path_factory):
    """A tiny model's plain weights, the --pretrained start of every fine-tune here."""
    path = tmp_path_factory.mktemp("base") / "base.pt"
    torch.save(tiny_model().state_dict(), path)
    return str(path)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _is_adapter(key):
    return ".lora_A." in key or ".lora_B." in key


@pytest.mark.parametrize("mode", ["lora", pytest.param("lora+lock-image", marks=pytest.mark.slow),
                                  pytest.param("lock-image", marks=pytest.mark.slow),
                                  "lora-bf16-base"])
def test_only_adapters_and_unlocked_parameters_change(tmp_path, tiny_rec, base_weights, mode):
    flags = {"lora": ["--lora-rank", "4"],
             "lora+lock-image": ["--lora-rank", "4", "--lock-image"],
             "lock-image": ["--lock-image"],
             "lora-bf16-base": ["--lora-rank", "4", "--lora-base-precision", "bf16",
                                "--precision", "bf16"]}[mode]
    argv = tiny_argv(tmp_path / "run", tiny_rec, "--pretrained", base_weights,
                     "--max-steps", "2", "--lr", "1e-2", *flags)
    if mode == "lora-bf16-base":
        argv[argv.index("--precision") + 1] = "bf16"  # tiny_argv's fp32 replaced
    out = main(parse_args(argv))
    after = _weights(out["model"])
    before = torch.load(base_weights, weights_only=True)
    lora, locked = "lora" in mode, "lock" in mode
    for key, value in after.items():
        if _is_adapter(key):
            assert lora and not (locked and key.startswith("image_model.")), key
            continue
        old = before[key.replace(".base_layer.", ".")]
        if lora:  # every base weight frozen (stored in bf16: equal to its rounding)
            assert torch.equal(value, old.to(value.dtype)), key
            matrix = key.endswith((".base_layer.weight", "emb.weight")) or "patch_embed" in key
            bf16 = mode == "lora-bf16-base" and matrix
            assert value.dtype == (torch.bfloat16 if bf16 else old.dtype), key
        elif key.startswith("image_model."):
            assert torch.equal(value, old), key
        elif value.dtype == torch.float32:  # bf16 time_decay may round back to itself
            assert not torch.equal(value, old), key
    if lora:
        b = [v for k, v in after.items() if ".lora_B." in k]
        assert b and all(v.abs().max() > 0 for v in b)  # zero at init, trained
        assert all(v.dtype == torch.float32 for k, v in after.items() if _is_adapter(k))
        trainable, total = parameter_counts(out["model"])
        assert trainable == sum(v.numel() for k, v in after.items() if _is_adapter(k))
        log = (tmp_path / "run" / "training.log").read_text()
        assert f"{total:,} parameters, {trainable:,} trainable" in log
        assert "adapted layers" in log


def test_merged_export_and_evaluation_match_the_adapted_model(tmp_path, tiny_rec, base_weights):
    """fp32: the merged plain weights give the adapted model's features to 1e-5 (the
    only difference is the order of float32 sums, x W^T + s (x A^T) B^T vs x (W + s B A)^T);
    the export loads into create_RWKV_Model with strict keys, also with the original's
    ``module.`` prefix; zero_shot's model loader reads the LoRA checkpoint directly."""
    out = main(parse_args(tiny_argv(tmp_path / "run", tiny_rec, "--pretrained", base_weights,
                                    "--max-steps", "3", "--lr", "1e-2", "--lora-rank", "4",
                                    "--lora-alpha", "16", "--lora-targets",
                                    "att.key,att.output,ffn.value")))
    adapted = out["model"].eval()
    ckpt = out["checkpoint"]
    with pytest.raises(CheckpointError, match="holds LoRA adapters.*--merge-lora"):
        export_main([ckpt, str(tmp_path / "plain.pt")])
    exported = tmp_path / "merged.pt"
    assert export_main([ckpt, str(exported), "--merge-lora"]) == 0
    prefixed = tmp_path / "merged_ddp.pt"
    assert export_main([ckpt, str(prefixed), "--merge-lora", "--ddp-prefix"]) == 0
    plain_keys = set(tiny_model().state_dict())
    assert set(torch.load(exported, weights_only=True)) == plain_keys
    assert all(k.startswith("module.") for k in torch.load(prefixed, weights_only=True))

    args = load_model_configs(TINY_CONFIG)
    torch.manual_seed(1)
    images = torch.randn(4, 3, args.input_size, args.input_size)
    tokens = torch.randint(1, 1000, (4, args.ctx_len))
    with torch.no_grad():
        want_img, want_txt = adapted.encode_image(images), adapted.encode_text(tokens)
        base = tiny_model().eval()
        base.load_state_dict(torch.load(base_weights, weights_only=True))
        base_img = base.encode_image(images)
        from rwkv_clip.eval.distributed import current
        from rwkv_clip.eval.runner import build_eval_model, options
        evaluated = build_eval_model(options(model_weight=ckpt), torch.device("cpu"),
                                     current())[0]
        for path in (exported, prefixed):
            merged = create_RWKV_Model(args, model_weight_path=path).eval()
            for model in (merged, evaluated):
                img, txt = model.encode_image(images), model.encode_text(tokens)
                assert (img - want_img).abs().max() < 1e-5 * want_img.abs().max()
                assert (txt - want_txt).abs().max() < 1e-5 * want_txt.abs().max()
    assert (base_img - want_img).abs().max() > 1e-3 * want_img.abs().max()  # the adapters act


def test_merge_is_peft_s_merge():
    """merge_state_dict (no peft) equals peft's own merge of the same adapters."""
    model = tiny_model()
    settings = LoraSettings(rank=3, alpha=5.0, targets=("att.gate", "ffn.receptance"))
    add_adapters(model, settings)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    merged = merge_state_dict(model.state_dict(), settings)
    from peft.tuners.lora import LoraLayer
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            module.merge()
            assert torch.allclose(merged[name + ".weight"], module.get_base_layer().weight,
                                  atol=1e-7)


@pytest.mark.slow
def test_lora_resume_is_exact(tmp_path, tiny_rec, base_weights):
    extra = ["--pretrained", base_weights, "--epochs", "2", "--max-steps", "4",
             "--save-every-steps", "2",
             "--gradient-acc", "2", "--batch-size", "4", "--lora-rank", "4",
             "--lora-dropout", "0.2", "--seed", "3"]
    full = main(parse_args(tiny_argv(tmp_path / "full", tiny_rec, *extra)))
    step2 = tmp_path / "full" / "checkpoints" / "step_2.pt"
    resumed_args = [a for a in extra if a not in ("--pretrained", base_weights)]
    resumed = main(parse_args(tiny_argv(tmp_path / "resumed", tiny_rec, *resumed_args,
                                        "--resume", str(step2))))
    a, b = _weights(full["model"]), _weights(resumed["model"])
    assert a.keys() == b.keys() and any(_is_adapter(k) for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0
    early = torch.load(step2, weights_only=True)["state_dict"]
    assert max((early[k] - a[k]).abs().max().item() for k in a) > 1e-4  # it did train on


def test_resume_takes_the_lora_settings_from_the_checkpoint(tmp_path, tiny_rec, base_weights):
    run = tmp_path / "run"
    main(parse_args(tiny_argv(run, tiny_rec, "--pretrained", base_weights, "--max-steps", "1",
                              "--lora-rank", "2")))
    again = main(parse_args(tiny_argv(run, tiny_rec, "--resume", "latest", "--max-steps", "2",
                                      "--resume-allow-changes")))
    assert again["steps"] == 2 and any(_is_adapter(k) for k in again["model"].state_dict())
    with pytest.raises(Exception, match="--lora-rank 8 contradicts the checkpoint's 2"):
        main(parse_args(tiny_argv(run, tiny_rec, "--resume", "latest", "--lora-rank", "8")))


def _exit_status(argv):
    try:  # flag errors exit while parsing, the others return from train.py's cli
        return cli(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("flags, culprit", [
    (["--lora-rank", "-1"], "--lora-rank"),
    (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha"),
    (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout"),
    (["--lora-rank", "4", "--lora-base-precision", "bf16"], "--lora-base-precision bf16"),
    (["--lora-rank", "4", "--lora-targets", "att.nope"], "'att.nope'"),
])
def test_bad_lora_flags_are_one_line(tmp_path, tiny_rec, capsys, flags, culprit):
    assert _exit_status(tiny_argv(tmp_path / "run", tiny_rec, *flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error:") and culprit in err[0], err


def test_missing_peft_is_one_line(tmp_path, tiny_rec, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    assert _exit_status(tiny_argv(tmp_path / "run", tiny_rec, "--lora-rank", "4")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--lora-rank needs the peft package" in err[0], err
    assert parse_args(tiny_argv(tmp_path / "run", tiny_rec)).lora_rank == 0  # not needed


def test_lora_checkpoint_without_settings_is_refused(tmp_path):
    model = tiny_model()
    add_adapters(model, LoraSettings(rank=2, alpha=4.0))
    path = tmp_path / "bare.pt"
    torch.save(model.state_dict(), path)
    with pytest.raises(CheckpointError, match="holds LoRA adapter weights but not their settings"):
        read_state_dict(path)


@pytest.mark.slow
def test_lora_ddp_two_processes(tmp_path, tiny_rec, base_weights):
    """torchrun, 2 CPU processes (gloo), accumulation 2: the adapters train, both ranks
    agree (DDP reduces only their gradients), the base stays as loaded."""
    import os
    import subprocess

    from train_util import REPO
    out_dir = tmp_path / "out"
    argv = tiny_argv(out_dir, tiny_rec, "--pretrained", base_weights, "--batch-size", "4",
                     "--gradient-acc", "2", "--epochs", "2", "--max-steps", "2",
                     "--lora-rank", "4")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                          "2", "--master-port", str(29500 + os.getpid() % 1000 + 1),
                          str(REPO / "train.py"), *argv], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Traceback" not in run.stdout + run.stderr
    log = (out_dir / "training.log").read_text()
    assert "backend gloo" in log and "adapted layers" in log
    state = torch.load(out_dir / "checkpoints" / "epoch_latest.pt", weights_only=True)
    assert state["step"] == 2
    weights = state["state_dict"]
    base = torch.load(base_weights, weights_only=True)
    assert all(torch.equal(v, base[k.replace(".base_layer.", ".")])
               for k, v in weights.items() if not _is_adapter(k))
    assert all(v.abs().max() > 0 for k, v in weights.items() if ".lora_B." in k)


@pytest.mark.slow
def test_compiled_lora_step_matches_eager(tmp_path, tiny_rec, base_weights):
    common = ("--pretrained", base_weights, "--max-steps", "1", "--lr-scheduler", "linear",
              "--lora-rank", "4", "--lr", "1e-2")
    eager = main(parse_args(tiny_argv(tmp_path / "eager", tiny_rec, *common)))
    compiled = main(parse_args(tiny_argv(tmp_path / "compiled", tiny_rec, *common,
                                         "--torchcompile")))
    state = torch.load(tmp_path / "compiled" / "checkpoints" / "epoch_latest.pt",
                       weights_only=True)["state_dict"]
    assert not any("_orig_mod." in k for k in state) and any(_is_adapter(k) for k in state)
    a, b = _weights(eager["model"]), _weights(compiled["model"])
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert max(b[k].abs().max().item() for k in b if ".lora_B." in k) > 1e-4
