"""Image sizes other than the config's: pos_embed resizing, long token sequences through
the model, and the memory planner at those sizes."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from train_util import TINY_CONFIG, make_tiny_rec, tiny_argv

from rwkv_clip import create_RWKV_Model, load_model_configs
from rwkv_clip.checkpoint_files import StateDict, load_checked
from rwkv_clip.layers.pos_embed import fit_pos_embed, resize_pos_embed

# Bicubic (a = -0.75), half-pixel centres, edge samples repeated: [0, 1] at 4 samples.
# Sample x = 0.25 (t = 0.25 between samples 0 and 1; taps at -1, 0, 1, 2 clamped):
#   W(1.75) * 1 + W(0.75) * 1 = -0.03515625 + 0.26171875 = 0.2265625
# Sample x = -0.25 (t = 0.75 after sample -1; only the tap at 1 sees a 1): W(1.25) = -0.10546875
HAND_1D = [-0.10546875, 0.2265625, 0.7734375, 1.10546875]


def test_resize_pos_embed_equals_the_hand_computation():
    ramp = torch.tensor([0.0, 1.0]).view(1, 2, 1)
    assert resize_pos_embed(ramp, (1, 2), (1, 4)).flatten().tolist() == HAND_1D
    # separable: a grid g(a) h(b) becomes the outer product of the 1-D results
    g, h = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 1.0])
    grid = torch.outer(g, h).reshape(1, 4, 1)
    expected = torch.outer(1 + torch.tensor(HAND_1D), torch.tensor(HAND_1D))
    got = resize_pos_embed(grid, (2, 2), (4, 4)).view(4, 4)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert resize_pos_embed(grid, (2, 2), (2, 2)) is grid
    assert fit_pos_embed(torch.zeros(1, 5, 3), (2, 2)) is None  # 5 tokens: no square grid


def _tiny(input_size=None, **overrides):
    args = load_model_configs(TINY_CONFIG)
    if input_size is not None:
        args = dataclasses.replace(args, input_size=input_size)
    for key, value in overrides.items():
        setattr(args, key, value)
    torch.manual_seed(0)
    return create_RWKV_Model(args).eval()


def test_weights_of_another_image_size_load_resized():
    """Weights trained at 16 px (4x4 patches) into a 32 px model (8x8): pos_embed resized
    bicubic, and the model computes what the 16 px model computes on 32 px images (the
    original resizes in its forward)."""
    small = _tiny()
    with torch.no_grad():
        small.image_model.pos_embed.normal_()
    state = {k: v.clone() for k, v in small.state_dict().items()}
    big = load_checked(_tiny(32), StateDict(state, "a 16 px checkpoint"))
    assert big.image_model.pos_embed.shape == (1, 64, 64)
    torch.testing.assert_close(big.image_model.pos_embed.data,
                               resize_pos_embed(state["image_model.pos_embed"], (4, 4), (8, 8)))
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = small.encode_image(images), big.encode_image(images)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_config_inferred_for_weights_of_another_image_size():
    """Weights without a config (zero_shot.py --model-weight) evaluated at another
    --input-size: the config is inferred with the pos_embed to be resized, and only then."""
    from rwkv_clip.factory import choose_model_args, infer_config
    state = _tiny().state_dict()
    assert infer_config(state, {"input_size": 32}) == "RWKV_CLIP_tiny"
    assert infer_config({**state, "image_model.pos_embed": torch.zeros(1, 64, 64)}) is None
    args, name = choose_model_args(None, StateDict(state, "a 16 px checkpoint"),
                                   {"input_size": 32})
    assert (name, args.input_size) == ("RWKV_CLIP_tiny", 32)


@pytest.mark.parametrize("flag", ["--input-size", "--force-image-size", "--image-size"])
def test_every_image_size_tool_takes_open_clips_flag_names(flag):
    from rwkv_clip.eval.cli import build_eval_parser
    from rwkv_clip.memory.cli import build_planner_parser
    from rwkv_clip.train.args import build_train_parser
    for parser in (build_train_parser(), build_planner_parser(), build_eval_parser(),
                   build_eval_parser(retrieval=True)):
        assert parser.parse_args([flag, "448"]).input_size == 448


def test_forward_and_backward_of_4624_image_tokens_on_cpu():
    """272 px at patch 4: 68 x 68 = 4624 image tokens, more than 1024 px at patch 16 gives."""
    model = _tiny(272).train()
    images = torch.randn(1, 3, 272, 272, generator=torch.Generator().manual_seed(0))
    features = model.encode_image(images)
    features.square().sum().backward()
    grad = model.image_model.pos_embed.grad
    assert grad is not None and grad.shape == (1, 4624, 64)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    decay = [p.grad for n, p in model.image_model.named_parameters() if "time_decay" in n]
    assert decay and all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in decay)


def test_planner_takes_the_image_size(capsys):
    from rwkv_clip.memory.cli import run
    peaks = {}
    for size in (16, 448, 896):
        assert run(["--config", "RWKV_CLIP_tiny", "--image-size", str(size), "--batch-size",
                    "2", "--precision", "fp32", "--device", "cpu", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        peaks[size] = out["estimate"]["training_peak_bytes"]
    # activations grow with the tokens: four times the pixels, about four times the bytes
    growth = (peaks[896] - peaks[16]) / (peaks[448] - peaks[16])
    assert 3.5 < growth < 4.5, peaks
    assert run(["--config", "RWKV_CLIP_tiny", "--input-size", "0"]) == 2


@pytest.mark.slow
def test_planner_within_15_percent_of_measured_at_448_px(capsys):
    from rwkv_clip.memory.cli import run
    assert run(["--config", "RWKV_CLIP_tiny", "--input-size", "448", "--batch-size", "2",
                "--precision", "fp32", "--device", "cpu", "--measure", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["measured"]
    assert abs(measured["ratio_estimate_to_measured"] - 1) < 0.15, measured


@pytest.mark.slow
def test_training_at_896_px_from_weights_trained_at_16_px(tmp_path):
    """train.py --force-image-size 896 (open_clip's flag; --input-size is the original's)
    with --pretrained weights of the config's 16 px: 50176 image tokens per sample."""
    from rwkv_clip.train import main, parse_args
    weights = tmp_path / "tiny16.pt"
    torch.save(_tiny().state_dict(), weights)
    data = make_tiny_rec(tmp_path / "data", n=4)
    result = main(parse_args(tiny_argv(tmp_path / "run", data, "--force-image-size", "896",
                                       "--pretrained", str(weights), "--batch-size", "2",
                                       "--max-steps", "1")))
    assert result["steps"] == 1 and torch.isfinite(torch.tensor(result["last_loss"]))
    pos_embed = result["model"].image_model.pos_embed
    assert pos_embed.shape == (1, 224 * 224, 64)
    start = resize_pos_embed(torch.load(weights)["image_model.pos_embed"], (4, 4), (224, 224))
    assert not torch.equal(pos_embed.detach(), start)  # trained from the resized weights
    assert (pos_embed.detach() - start).abs().max() < 0.1
