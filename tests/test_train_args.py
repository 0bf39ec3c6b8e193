"""train.py's command line: the original's flags, config resolution, bad flags and data."""
import subprocess
import sys

import pytest
from train_util import REPO, TINY_CONFIG

from rwkv_clip import load_model_configs
from rwkv_clip.train.args import parse_args, str2bool

# shell/train_RWKV_CLIP_B32_YFCC15M.sh, its train.py arguments with the values filled in
ORIGINAL_B32_SCRIPT = [
    "--drop-path-rate", "0.3", "--image-num-heads", "8", "--input-size", "224",
    "--dropout", "0.0", "--precision", "bf16", "--image-depth", "12",
    "--image-embed-dims", "640", "--image-patch-size", "32", "--image-hidden-rate", "5",
    "--ctx-len", "77", "--vocab-size", "49408", "--head-size", "64",
    "--head-size-divisor", "8", "--n-embd", "640", "--n-layer", "6",
    "--text-initialization", "True", "--batch-size", "512", "--epochs", "32",
    "--lr", "0.001", "--optimizer", "adamw", "--output", "OUT",
    "--train-data", "/data/YFCC15M", "--train-num-samples", "15061515",
    "--weight-decay", "0.2",
]


def test_original_launch_script_flags_mean_the_b32_model():
    args = parse_args(ORIGINAL_B32_SCRIPT)
    import json
    b32 = json.loads((REPO / "model_config" / "RWKV_CLIP_B32.json").read_text())
    for key in ("input_size", "image_depth", "image_embed_dims", "image_patch_size",
                "image_hidden_rate", "image_num_heads", "drop_path_rate", "ctx_len",
                "vocab_size", "head_size", "head_size_divisor", "n_layer", "n_embd",
                "dim_att", "dim_ffn", "image_output_cls_token", "image_with_cls_token"):
        assert getattr(args, key) == b32[key], key
    assert args.model_config == {k: v for k, v in load_model_configs("RWKV_CLIP_B32").to_dict()
                                 .items() if k not in ("workers", "data_type")}
    assert (args.batch_size, args.epochs, args.lr, args.weight_decay) == (512, 32, 1e-3, 0.2)
    assert (args.beta1, args.beta2, args.optimizer, args.lr_scheduler) == (0.9, 0.98, "adamw",
                                                                          "cosine")
    assert args.precision == "bf16" and args.open_checkpoint is False
    assert args.data_format == "rec" and args.train_num_samples == 15061515
    assert args.local_loss is False and args.gather_with_grad is False


def test_no_arguments_means_small_config_on_builtin_data():
    args = parse_args([])
    assert args.data_format == "builtin" and args.train_data is None
    assert args.config_source.endswith("RWKV_CLIP_small.json")
    assert (args.n_embd, args.input_size, args.precision) == (128, 32, "fp32")
    assert (args.epochs, args.lr, args.batch_size, args.log_format) == (2, 1.5e-3, 32, "plain")


def test_config_then_flags_override():
    args = parse_args(["--config", TINY_CONFIG, "--n-layer", "3", "--precision", "bf16",
                       "--open-checkpoint", "1", "--dropout", "0.1"])
    assert args.n_layer == 3 and args.n_embd == 64 and args.precision == "bf16"
    assert args.with_cp is True and args.model_config["with_cp"] is True
    assert args.dropout == 0.1
    # a new width re-derives dim_att / dim_ffn unless they are given
    args = parse_args(["--config", TINY_CONFIG, "--n-embd", "128", "--image-embed-dims", "128"])
    assert args.dim_att == 128 and args.dim_ffn == int(128 * 3.5 // 32 * 32)


def test_rebuild_flag_overrides_the_config_key(tmp_path):
    """--rebuild sets the config key rebuild (the activation-memory policy's scope); a
    config may carry it; the default is auto."""
    assert parse_args(["--config", TINY_CONFIG]).rebuild == "auto"
    args = parse_args(["--config", TINY_CONFIG, "--rebuild", "never"])
    assert args.rebuild == "never" and args.model_config["rebuild"] == "never"
    import json
    config = json.loads((REPO / "model_config" / "RWKV_CLIP_tiny.json").read_text())
    path = tmp_path / "tiny_always.json"
    path.write_text(json.dumps({**config, "rebuild": "always"}))
    assert parse_args(["--config", str(path)]).rebuild == "always"
    assert parse_args(["--config", str(path), "--rebuild", "auto"]).rebuild == "auto"


@pytest.mark.parametrize("text,value", [("True", True), ("true", True), ("1", True),
                                        ("False", False), ("0", False), ("no", False)])
def test_booleans(text, value):
    assert str2bool(text) is value
    args = parse_args(["--config", TINY_CONFIG, "--local-loss", text,
                       "--gather-with-grad", text, "--image-with-cls-token", text])
    assert args.local_loss is value and args.gather_with_grad is value
    assert args.image_with_cls_token is value


def test_bare_boolean_flag_means_true():
    args = parse_args(["--config", TINY_CONFIG, "--local-loss", "--lock-text"])
    assert args.local_loss is True and args.lock_text is True


@pytest.mark.parametrize("argv,message", [
    (["--precision", "fp8"], "--precision"),
    (["--local-loss", "maybe"], "boolean"),
    (["--gradient-acc", "0"], "--gradient-acc must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--horovod"], "horovod is not supported"),
    (["--data-format", "rec"], "needs --train-data"),
    (["--n-embd", "256"], "must equal n_embd"),
    (["--config", "no_such_config.json"], "not found"),
    (["--lock-image", "--lock-text"], "unlock one tower"),
    (["--resume", "latest", "--pretrained", "x.pt"], "exclude each other"),
    (["--warmup", "1.5"], "--warmup"),
    (["--rebuild", "sometimes"], "invalid choice"),
    (["--image-output-cls-token", "True"], "image_with_cls_token"),
])
def test_bad_flags_exit_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--gradient-acc", "--open-checkpoint", "--resume", "--accum-mode",
                 "--zero-shot-every", "--lock-image", "--data-format", "--save-every-steps"):
        assert flag in out.stdout
    # every option line has a help text (argparse prints it after the metavar)
    from rwkv_clip.train.args import build_train_parser
    assert all(a.help for a in build_train_parser()._actions)


def _run_train(argv, tmp_path):
    return subprocess.run([sys.executable, str(REPO / "train.py"), *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})


@pytest.mark.slow
def test_missing_data_gives_a_clear_error(tmp_path):
    from train_util import tiny_argv
    out = _run_train(tiny_argv(tmp_path / "out", str(tmp_path / "nowhere")), tmp_path)
    assert out.returncode == 2
    assert "train.py: error: record file not found" in out.stderr and "nowhere" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_corrupt_data_gives_a_clear_error(tmp_path):
    from train_util import make_tiny_rec, tiny_argv
    prefix = make_tiny_rec(tmp_path, n=16)
    rec = tmp_path / "tiny.rec"
    data = bytearray(rec.read_bytes())
    rec.write_bytes(bytes(data[: len(data) // 2]))  # truncated file
    out = _run_train(tiny_argv(tmp_path / "out", prefix), tmp_path)
    assert out.returncode == 2
    assert "train.py: error: " in out.stderr and "tiny.rec" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("argv,message", [
    (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["--batch-size", "x"], "argument --batch-size: invalid int value: 'x'"),
])
def test_argparse_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "usage:" not in err
    assert err.startswith(f"train.py: error: {message}")


def test_negative_keep_checkpoints_is_refused(tmp_path):
    from rwkv_clip.errors import TrainArgsError
    from rwkv_clip.train import main
    with pytest.raises(TrainArgsError, match="--keep-checkpoints must be >= 0"):
        main(parse_args(["--config", TINY_CONFIG, "--output", str(tmp_path),
                         "--keep-checkpoints", "-1"]))


# ---- a step batch larger than the training data

def _tiny_parquet(folder, usable: int):
    """img2dataset-style parquet with one failed row more than ``usable`` rows."""
    from test_data_parquet import write_img2dataset
    write_img2dataset(folder, n=usable + 1, failed={1})
    return str(folder)


@pytest.mark.parametrize("fmt", ["rec", "parquet"])
def test_batch_larger_than_the_data_is_one_line_error(tmp_path, capsys, fmt):
    from train_util import make_tiny_rec, tiny_argv

    from rwkv_clip.train import cli
    if fmt == "rec":
        data, name = make_tiny_rec(tmp_path / "data", n=6), str(tmp_path / "data" / "tiny.rec")
    else:  # 6 usable rows: the failed download does not count
        data = name = _tiny_parquet(tmp_path / "data", usable=6)
    argv = tiny_argv(tmp_path / "out", data, "--data-format", fmt)  # --batch-size 8
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"train.py: error: --batch-size 8 x 1 rank(s) needs at least 8 training "
                   f"pairs per rank, got 6 in {name}; lower --batch-size to 6 or less"]
    assert not list((tmp_path / "out").rglob("*.pt"))  # refused before any step


def test_accumulated_batch_larger_than_the_data_is_refused(tmp_path):
    """14 pairs make 4 batches of 4 (the last padded), enough for one step of
    --gradient-acc 4 by count, but the step would see 2 duplicates."""
    from train_util import make_tiny_rec, tiny_argv

    from rwkv_clip.errors import TrainArgsError
    from rwkv_clip.train import main
    data = make_tiny_rec(tmp_path / "data", n=14)
    argv = tiny_argv(tmp_path / "out", data, "--batch-size", "4", "--gradient-acc", "4")
    with pytest.raises(TrainArgsError, match=r"^--batch-size 4 x --gradient-acc 4 x 1 rank\(s\) "
                       r"needs at least 16 training pairs per rank, got 14 in .*tiny\.rec; "
                       r"lower --batch-size to 3 or less or --gradient-acc$"):
        main(parse_args(argv))


def test_batch_against_a_rank_share(tmp_path):
    """Two ranks of a 10-pair set have 5 pairs each: batch 5 fits, batch 6 does not (every
    loader says how many pairs it has)."""
    from types import SimpleNamespace

    from train_util import make_tiny_rec

    from rwkv_clip.data import build_train_loader
    from rwkv_clip.data.dali_pipeline import dali_available
    from rwkv_clip.distributed import DistInfo
    from rwkv_clip.errors import TrainArgsError
    from rwkv_clip.train.loop import check_batch_fits
    data = make_tiny_rec(tmp_path / "data", n=10)
    info = DistInfo(rank=1, world_size=2)
    kinds = ["torch"] + (["dali"] if dali_available() else [])
    for kind, bs in [(kind, bs) for kind in kinds for bs in (5, 6)]:
        args = SimpleNamespace(train_data=data, batch_size=bs, gradient_acc=1, workers=1,
                               input_size=24, device="cpu", rank=1, world_size=2,
                               loader=kind, train_num_samples=None)
        loader = build_train_loader(args, log=None)
        assert loader.num_samples == 10
        if bs == 5:
            check_batch_fits(loader, args, info, "tiny.rec")
            continue
        with pytest.raises(TrainArgsError, match=r"needs at least 6 training pairs per rank, "
                           r"got 5 \(10 over 2 ranks\) in tiny\.rec; lower --batch-size to 5 "
                           r"or less or use fewer ranks$"):
            check_batch_fits(loader, args, info, "tiny.rec")


def test_batch_equal_to_the_data_trains(tmp_path):
    from train_util import make_tiny_rec, tiny_argv

    from rwkv_clip.train import main
    data = make_tiny_rec(tmp_path / "data", n=8)
    summary = main(parse_args(tiny_argv(tmp_path / "out", data, "--max-steps", "1")))
    assert summary["steps"] == 1


@pytest.mark.parametrize("argv,suggestion", [
    (["--bach-size", "4"], "; did you mean --batch-size?"),
    (["--bach-size=4", "--epocs", "2"], "; did you mean --batch-size for --bach-size, "
                                        "--epochs for --epocs?"),
    (["--lr-scheduler", "cosin"], "; did you mean cosine?"),
    (["--zzzz"], " (train.py --help"),  # nothing close: no suggestion
])
def test_mistyped_flags_get_a_did_you_mean(argv, suggestion, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert suggestion in err and (suggestion != " (train.py --help" or "did you" not in err)


def test_a_small_set_under_the_default_batch_names_the_default_and_a_batch_that_fits(
        tmp_path, capsys):
    """docs/own-data.md's case: a set smaller than the default batch of 32, --batch-size
    never typed: the message says the 32 is the default and which value fits."""
    from train_util import make_tiny_rec, tiny_argv

    from rwkv_clip.train import cli
    data = make_tiny_rec(tmp_path / "data", n=6)
    argv = tiny_argv(tmp_path / "out", data)
    i = argv.index("--batch-size")
    del argv[i:i + 2]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "train.py: error: --batch-size 32 (the default) x 1 rank(s) needs at least 32 "), err
    assert err[0].endswith("got 6 in " + str(tmp_path / "data" / "tiny.rec")
                           + "; lower --batch-size to 6 or less"), err



def test_exclude_decay_defaults_to_the_original_on_your_data(tmp_path):
    """--exclude-decay: on for the built-in dataset (the main job), off on other data (the
    original decays every parameter), whatever is typed wins."""
    from train_util import make_tiny_rec
    data = make_tiny_rec(tmp_path / "data", n=6)
    assert parse_args([]).exclude_decay is True
    assert parse_args(["--exclude-decay", "false"]).exclude_decay is False
    assert parse_args(["--train-data", str(data)]).exclude_decay is False
    assert parse_args(["--train-data", str(data), "--exclude-decay"]).exclude_decay is True
