"""A checkpoint trained at a context length and image size other than its config's
(RWKV_CLIP_tiny: 77 tokens, 16 px; here ``--ctx-len 24 --input-size 24``) evaluates,
retrieves, exports (ONNX, Hub folder, safetensors) and loads in Python at those settings
without flags, and says so; an explicit flag that contradicts it is used and said."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
CTX, SIZE = 24, 24  # what the checkpoint is trained at (RWKV_CLIP_tiny: 77, 16)
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``train.py --config RWKV_CLIP_tiny --ctx-len 24 --input-size 24`` for a few steps,
    and a JSONL retrieval set of three coloured squares."""
    sys.path.insert(0, str(REPO / "tests"))
    from train_util import make_tiny_rec, tiny_argv

    from rwkv_clip.train import main, parse_args

    root = tmp_path_factory.mktemp("settings")
    rec = make_tiny_rec(root / "data", n=16)
    result = main(parse_args(tiny_argv(root / "run", rec, "--ctx-len", str(CTX),
                                       "--input-size", str(SIZE), "--max-steps", "1")))
    (root / "images").mkdir()
    with open(root / "pairs.jsonl", "w") as f:
        for name, colour in COLOURS.items():
            Image.fromarray(np.full((20, 20, 3), colour, np.uint8)).save(root / "images" /
                                                                         f"{name}.png")
            f.write(json.dumps({"image": f"images/{name}.png",
                                "captions": [f"a {name} square", f"{name} on white"]}) + "\n")
    return {"checkpoint": Path(result["checkpoint"]), "jsonl": root / "pairs.jsonl",
            "root": root, "rec": rec}


def zero_shot(*args):
    from rwkv_clip.eval.cli import zero_shot_main

    return zero_shot_main([str(a) for a in args])


def retrieval_argv(trained, out, *extra):
    return ["--model-weight", trained["checkpoint"], "--task", "zeroshot_retrieval",
            "--retrieval-file", trained["jsonl"], "--device", "cpu", "--workers", "0",
            "--output-dir", out, *extra]


def test_the_checkpoint_records_its_settings(trained):
    from rwkv_clip.checkpoint_files import read_checkpoint

    weights = read_checkpoint(trained["checkpoint"])
    assert weights.settings["ctx_len"] == CTX and weights.settings["input_size"] == SIZE
    assert "precision" not in weights.settings  # a run setting, not the model's
    assert weights.run_args["ctx_len"] == CTX


def test_evaluation_runs_at_the_trained_settings_and_says_so(trained, tmp_path, capsys):
    assert zero_shot(*retrieval_argv(trained, tmp_path / "a")) == 0
    out = capsys.readouterr().out
    assert "config: RWKV_CLIP_tiny (nearest the checkpoint's saved settings)" in out
    assert (f"model settings: input_size {SIZE}, ctx_len {CTX} from the checkpoint "
            f"{trained['checkpoint']} (RWKV_CLIP_tiny has input_size 16, ctx_len 77)") in out
    assert f"context {CTX} tokens, images {SIZE} px" in out
    record = json.loads((tmp_path / "a" / "jsonl_zeroshot_retrieval.json").read_text())
    assert (record["ctx_len"], record["input_size"]) == (CTX, SIZE)
    # the flags that say the same give the same figures, and no contradiction line
    assert zero_shot(*retrieval_argv(trained, tmp_path / "b", "--ctx-len", CTX,
                                     "--input-size", SIZE)) == 0
    assert "overrides" not in capsys.readouterr().out
    again = json.loads((tmp_path / "b" / "jsonl_zeroshot_retrieval.json").read_text())
    assert again["metrics"] == record["metrics"]


def test_a_contradicting_flag_is_used_and_said(trained, tmp_path, capsys):
    assert zero_shot(*retrieval_argv(trained, tmp_path, "--ctx-len", 77)) == 0
    out = capsys.readouterr().out
    assert (f"--ctx-len 77 overrides the checkpoint's ctx_len {CTX} (the weights were trained "
            "at the checkpoint's)") in out
    record = json.loads((tmp_path / "jsonl_zeroshot_retrieval.json").read_text())
    assert (record["ctx_len"], record["input_size"]) == (77, SIZE)


def test_text_image_retrieval_uses_the_trained_settings(trained, tmp_path, capsys):
    from rwkv_clip.eval.cli import retrieval_main

    argv = ["--model-weight", trained["checkpoint"], "--dataset", "jsonl", "--retrieval-file",
            trained["jsonl"], "--device", "cpu", "--workers", "0", "--output-dir", tmp_path]
    assert retrieval_main([str(a) for a in argv]) == 0
    assert f"context {CTX} tokens, images {SIZE} px" in capsys.readouterr().out
    record = json.loads((tmp_path / "jsonl_zeroshot_retrieval.json").read_text())
    assert (record["ctx_len"], record["input_size"]) == (CTX, SIZE)


@pytest.mark.slow
def test_onnx_export_takes_the_trained_context_length(trained, tmp_path, capsys):
    from rwkv_clip.export import main
    from rwkv_clip.onnx import OnnxCLIP

    assert main([str(trained["checkpoint"]), "--format", "onnx", "--output",
                 str(tmp_path / "onnx"), "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert f"model settings: input_size {SIZE}, ctx_len {CTX} from the checkpoint" in out
    assert f"text input [batch, {CTX}], image input [batch, 3, {SIZE}, {SIZE}]" in out
    info = json.loads((tmp_path / "onnx" / "onnx_config.json").read_text())
    assert info["text_input"]["shape"] == ["batch", CTX]
    assert info["image_input"]["shape"] == ["batch", 3, SIZE, SIZE]
    config = json.loads((tmp_path / "onnx" / "model_config.json").read_text())
    assert (config["ctx_len"], config["input_size"]) == (CTX, SIZE)
    clip = OnnxCLIP(tmp_path / "onnx")
    assert clip.context_length == CTX
    assert clip.encode_text(np.ones((2, CTX), np.int64)).shape == (2, 64)


def test_hub_folder_holds_the_trained_settings(trained, tmp_path, capsys):
    import rwkv_clip
    from rwkv_clip.export import main

    out = tmp_path / "hub"
    assert main([str(trained["checkpoint"]), "--format", "hub", "--output", str(out)]) == 0
    assert f"context {CTX} tokens, images {SIZE} px" in capsys.readouterr().out
    config = json.loads((out / "model_config.json").read_text())
    tiny = json.loads((REPO / "model_config" / "RWKV_CLIP_tiny.json").read_text())
    assert config == {**tiny, "ctx_len": CTX, "input_size": SIZE}
    assert json.loads((out / "preprocess_config.json").read_text())["size"] == SIZE
    card = (out / "README.md").read_text()
    assert f"context {CTX} tokens" in card and f"input {SIZE} px" in card
    assert "Trained with `train.py`" in card  # the run's arguments, from the checkpoint
    tokens = rwkv_clip.get_tokenizer(f"local-dir:{out}")(["a red square"])
    assert tokens.shape == (1, CTX)
    model, _, preprocess = rwkv_clip.create_model_and_transforms(f"local-dir:{out}")
    assert "model settings" not in capsys.readouterr().out  # the folder agrees with itself
    assert model.text_model.args.ctx_len == CTX
    assert preprocess(Image.new("RGB", (40, 30))).shape == (3, SIZE, SIZE)


def test_safetensors_export_records_the_settings_and_pt_says_what_it_lacks(trained, tmp_path,
                                                                           capsys):
    from rwkv_clip.checkpoint_files import read_checkpoint
    from rwkv_clip.export import main

    assert main([str(trained["checkpoint"]), str(tmp_path / "w.safetensors")]) == 0
    assert f"context {CTX} tokens, images {SIZE} px" in capsys.readouterr().out
    assert read_checkpoint(tmp_path / "w.safetensors").settings["ctx_len"] == CTX
    # the exported file alone evaluates at the trained settings
    assert zero_shot("--model-weight", tmp_path / "w.safetensors", "--task",
                     "zeroshot_retrieval", "--retrieval-file", trained["jsonl"], "--device",
                     "cpu", "--workers", "0", "--output-dir", tmp_path / "eval") == 0
    record = json.loads((tmp_path / "eval" / "jsonl_zeroshot_retrieval.json").read_text())
    assert (record["ctx_len"], record["input_size"]) == (CTX, SIZE)
    capsys.readouterr()
    assert main([str(trained["checkpoint"]), str(tmp_path / "w.pt")]) == 0
    assert (f"holds the weights only: load it with --input-size {SIZE} --ctx-len {CTX}"
            in capsys.readouterr().out)
    assert read_checkpoint(tmp_path / "w.pt").settings is None


def test_python_loaders_use_the_trained_settings(trained, capsys):
    import rwkv_clip
    from rwkv_clip import create_RWKV_Model, load_model_configs

    args = load_model_configs("RWKV_CLIP_tiny")
    model = create_RWKV_Model(args, trained["checkpoint"])
    assert (model.text_model.args.ctx_len, model.text_model.args.input_size) == (CTX, SIZE)
    assert f"model settings: input_size {SIZE}, ctx_len {CTX} from the checkpoint" in \
        capsys.readouterr().out
    assert args.ctx_len == 77  # the caller's object is left as it was
    kept = create_RWKV_Model(args, trained["checkpoint"], checkpoint_settings=False)
    assert kept.text_model.args.ctx_len == 77
    assert "ctx_len 77 overrides the checkpoint's ctx_len 24" in capsys.readouterr().out
    model, _, preprocess = rwkv_clip.create_model_and_transforms(
        "RWKV_CLIP_tiny", pretrained=str(trained["checkpoint"]))
    assert model.text_model.args.ctx_len == CTX
    assert preprocess(Image.new("RGB", (40, 30))).shape == (3, SIZE, SIZE)


def test_loading_into_a_built_model_keeps_it_and_says_so(trained, capsys):
    import rwkv_clip

    sys.path.insert(0, str(REPO / "tests"))
    from train_util import tiny_model

    model = rwkv_clip.load_model_weight(tiny_model(), trained["checkpoint"])
    assert model.text_model.args.ctx_len == 77
    assert (f"input_size 16 overrides the checkpoint's input_size {SIZE}; ctx_len 77 "
            f"overrides the checkpoint's ctx_len {CTX}") in capsys.readouterr().out


def test_fine_tuning_at_another_length_says_so(trained, tmp_path):
    """train.py --pretrained CHECKPOINT --ctx-len 32: the weights' 24 tokens are named."""
    from train_util import tiny_argv

    from rwkv_clip.train import main, parse_args

    main(parse_args(tiny_argv(tmp_path / "run", trained["rec"], "--pretrained",
                              str(trained["checkpoint"]), "--ctx-len", "32", "--input-size",
                              str(SIZE), "--max-steps", "1")))
    log = (tmp_path / "run" / "training.log").read_text()
    assert f"ctx_len 32 overrides the checkpoint's ctx_len {CTX}" in log
    assert "input_size" not in log.split("overrides")[1].splitlines()[0]  # the same size


def test_a_bare_state_dict_behaves_as_before(tmp_path, capsys):
    from rwkv_clip.factory import create_model

    sys.path.insert(0, str(REPO / "tests"))
    from train_util import tiny_model

    torch.save(tiny_model().state_dict(), tmp_path / "bare.pt")
    model = create_model("RWKV_CLIP_tiny", str(tmp_path / "bare.pt"))
    assert model.text_model.args.ctx_len == 77
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("config, needle", [
    ({"ctx_len": "long"}, "ctx_len = 'long': expected an integer >= 1"),
    ({"ctx_lenght": 24}, "unknown key 'ctx_lenght'"),
])
def test_bad_saved_settings_are_one_line(tmp_path, capsys, config, needle):
    sys.path.insert(0, str(REPO / "tests"))
    from train_util import tiny_model

    path = tmp_path / "bad.pt"
    torch.save({"state_dict": tiny_model().state_dict(), "model_config": config,
                "args": {}}, path)
    assert zero_shot("--model-weight", path, "--device", "cpu", "--workers", "0",
                     "--output-dir", tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zero_shot.py: error:")
    assert needle in err[0] and str(path) in err[0]
