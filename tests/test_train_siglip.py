"""SigLIP training: the model's logit_bias (and a CLIP model without one), loading SigLIP
weights everywhere, exact accumulation with the sigmoid loss, sigmoid probabilities, and
short --siglip runs (resume, --pretrained, learning on the built-in set)."""
import copy
import math

import numpy as np
import pytest
import torch
from PIL import Image
from train_util import TINY_CONFIG, make_tiny_rec, record_step_grads, tiny_argv, tiny_model

from rwkv_clip import create_RWKV_Model, load_model_configs
from rwkv_clip.errors import ResumeError
from rwkv_clip.eval.zeroshot import LOGIT_SCALE, class_probabilities
from rwkv_clip.loss import SigLipLoss
from rwkv_clip.train import checkpoint as ckpt_io
from rwkv_clip.train import main, parse_args
from rwkv_clip.train.accumulation import caption_generator, make_micro_batches, train_step


def _siglip_model(**overrides):
    model = tiny_model(**overrides)
    model.init_siglip()
    return model


def test_clip_keeps_the_original_keys_and_siglip_adds_logit_bias():
    clip = tiny_model()
    keys = list(clip.state_dict())
    assert "logit_bias" not in keys and clip.logit_bias is None
    assert len(clip(torch.zeros(1, 3, 16, 16), torch.ones(1, 77, dtype=torch.long))) == 3
    siglip = copy.deepcopy(clip)
    siglip.init_siglip()
    # beside logit_scale, as open_clip's SigLIP models
    assert list(siglip.state_dict()) == ["logit_scale", "logit_bias"] + keys[1:]
    assert siglip.logit_scale.item() == pytest.approx(math.log(10))
    assert siglip.logit_bias.item() == -10.0
    image_f, text_f, scale, bias = siglip(torch.zeros(1, 3, 16, 16),
                                          torch.ones(1, 77, dtype=torch.long))
    assert float(scale) == pytest.approx(10.0) and bias is siglip.logit_bias
    # the towers are untouched: same features as the CLIP model's
    torch.testing.assert_close(image_f, clip.encode_image(torch.zeros(1, 3, 16, 16)))
    siglip.set_logit_bias(None)
    assert list(siglip.state_dict()) == keys


def test_siglip_weights_load_infer_and_export(tmp_path):
    from rwkv_clip.export import export_state_dict
    from rwkv_clip.factory import create_model, infer_config

    siglip = _siglip_model()
    with torch.no_grad():
        siglip.logit_bias.fill_(-7.5)
    path = tmp_path / "siglip.pt"
    torch.save(siglip.state_dict(), path)
    state = torch.load(path, weights_only=True)
    assert infer_config(state) == "RWKV_CLIP_tiny"
    for model in (create_RWKV_Model(load_model_configs(TINY_CONFIG), model_weight_path=path),
                  create_model("RWKV_CLIP_tiny", pretrained=str(path))):
        assert model.logit_bias.item() == -7.5
        assert model.logit_scale.item() == pytest.approx(math.log(10))
    result = export_state_dict(path)
    exported = result.state
    assert result.config == "RWKV_CLIP_tiny" and float(exported["logit_bias"]) == -7.5
    assert list(exported) == list(siglip.state_dict())
    assert list(exported)[:2] == ["logit_scale", "logit_bias"]
    # CLIP weights still load into a CLIP model, which stays without a bias
    clip_path = tmp_path / "clip.pt"
    torch.save(tiny_model().state_dict(), clip_path)
    clip = create_RWKV_Model(load_model_configs(TINY_CONFIG), model_weight_path=clip_path)
    assert clip.logit_bias is None


def _batch(n=8, size=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, size, size, generator=g)
    tokens = torch.randint(1, 2000, (n, 231), generator=g)
    for c in range(3):
        tokens[:, c * 77 + 12:(c + 1) * 77] = 0
    return images, tokens


def _grads(base, images, tokens, k, mode="exact"):
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = record_step_grads(model, opt)
    m = images.shape[0] // k
    mbs = make_micro_batches(list(images.split(m)), list(tokens.split(m)),
                             caption_generator(0, 0, 0, 0), torch.device("cpu"),
                             caption_weights=[1.0, 2.0, 0.5])
    result = train_step(model, mbs, SigLipLoss(), opt, mode=mode, clip_grad_norm=None)
    return result, grads


def _rel_err(a, b):
    """Norm of the difference over the norm of the reference (one number per tensor)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_exact_accumulation_with_siglip_equals_one_batch():
    base = _siglip_model(dropout=0.0, drop_path_rate=0.0)
    with torch.no_grad():  # mid-training values, where the negatives weigh (not -10)
        base.logit_bias.fill_(-1.0)
    images, tokens = _batch()
    ref, ref_grads = _grads(base, images, tokens, 1)
    for k in (2, 4):
        result, grads = _grads(base, images, tokens, k)
        assert result.loss == pytest.approx(ref.loss, rel=1e-6)
        assert grads.keys() == ref_grads.keys()
        errors = {name: _rel_err(grad, ref_grads[name]) for name, grad in grads.items()}
        worst = max(errors, key=errors.get)  # logit_scale and logit_bias counted once
        assert errors[worst] < 2e-5, (k, worst, errors[worst])
    # teeth: averaging per-micro-batch losses is another loss with other gradients
    mean, mean_grads = _grads(base, images, tokens, 4, mode="mean")
    assert abs(mean.loss - ref.loss) > 1e-2
    assert _rel_err(mean_grads["logit_bias"], ref_grads["logit_bias"]) > 1e-2


def test_class_probabilities_softmax_for_clip_sigmoid_for_siglip():
    cosine = torch.tensor([[0.9, 0.1, -0.2], [0.3, 0.5, 0.0]])
    logits = LOGIT_SCALE * cosine
    clip_probs = class_probabilities(tiny_model(), logits)
    torch.testing.assert_close(clip_probs, logits.softmax(dim=-1))
    siglip = _siglip_model()
    with torch.no_grad():
        siglip.logit_bias.fill_(-2.0)
    probs = class_probabilities(siglip, logits)
    torch.testing.assert_close(probs, torch.sigmoid(10.0 * cosine - 2.0))
    assert not torch.allclose(probs.sum(dim=-1), torch.ones(2))  # pairwise, not a softmax
    assert torch.equal(probs.argmax(dim=-1), clip_probs.argmax(dim=-1))


def _image_folder(root, size=16):
    colours = {"red": (220, 30, 30), "blue": (30, 40, 220)}
    for name, colour in colours.items():
        (root / name).mkdir(parents=True)
        for i in range(2):
            img = np.full((size, size, 3), 128, np.uint8)
            img[2 + i:10 + i, 3:11] = colour
            Image.fromarray(img).save(root / name / f"{i}.png")
    return root


def test_report_predictions_of_a_siglip_checkpoint_are_sigmoids(tmp_path):
    from rwkv_clip.report import predictions_from_checkpoint

    siglip = _siglip_model()
    with torch.no_grad():
        siglip.logit_bias.fill_(0.0)  # probabilities that 4 decimals show
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": siglip.state_dict()},
               tmp_path / "run" / "checkpoints" / ckpt_io.LATEST)
    result = predictions_from_checkpoint(tmp_path / "run", str(_image_folder(tmp_path / "f")))
    assert len(result["samples"]) == 4
    for sample in result["samples"]:
        # one sigmoid per class: two classes' probabilities do not add up to 1 (softmax's do)
        assert all(0 < p < 1 for p in sample["top3_prob"]), sample
        assert abs(sum(sample["top3_prob"]) - 1) > 1e-3, sample


def test_resume_takes_siglip_and_caption_weights_from_the_checkpoint(tmp_path):
    saved = parse_args(["--siglip", "--siglip-dist-impl", "gather",
                        "--caption-weights", "1,0,0"])
    ckpt = {"args": ckpt_io._json_safe(vars(saved)), "model_config": saved.model_config}
    again = parse_args(["--resume", "latest"])
    taken = ckpt_io.take_run_settings(ckpt, again, "ckpt.pt")
    assert taken == {"siglip": True, "siglip_dist_impl": "gather",
                     "caption_weights": [1.0, 0.0, 0.0]}
    assert again.siglip and again.caption_weights == [1.0, 0.0, 0.0]
    with pytest.raises(ResumeError, match=r"--caption-weights \[0.0, 1.0, 0.0\] contradicts "
                                          r"the checkpoint's \[1.0, 0.0, 0.0\]"):
        ckpt_io.take_run_settings(ckpt, parse_args(["--resume", "latest", "--caption-weights",
                                                    "0,1,0"]), "ckpt.pt")


@pytest.fixture(scope="module")
def tiny_rec(tmp_path_factory):
    return make_tiny_rec(tmp_path_factory.mktemp("data"), n=16)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.slow
def test_siglip_run_resumes_exactly_and_starts_from_clip_weights(tmp_path, tiny_rec):
    """Exact accumulation, dropout, skewed caption weights: a run resumed from its step-2
    checkpoint ends with the weights of the uninterrupted run (the same caption draws),
    logit_bias included; CLIP weights start a --siglip run with bias -10."""
    base = ["--siglip", "--gradient-acc", "2", "--batch-size", "4", "--dropout", "0.1",
            "--save-every-steps", "2", "--seed", "3", "--lr", "1e-3", "--epochs", "2"]
    extra = [*base, "--caption-weights", "0.2,0.3,0.5"]
    full = main(parse_args(tiny_argv(tmp_path / "full", tiny_rec, *extra)))
    assert full["steps"] == 4  # 16 pairs / (4 x 2): 2 steps per epoch
    step_2 = tmp_path / "full" / "checkpoints" / "step_2.pt"
    state = torch.load(step_2, weights_only=True)
    assert state["args"]["siglip"] is True
    assert state["args"]["caption_weights"] == [0.2, 0.3, 0.5]
    assert "logit_bias" in state["state_dict"]
    resumed = main(parse_args(tiny_argv(tmp_path / "resumed", tiny_rec, *extra,
                                        "--resume", str(step_2))))
    assert resumed["steps"] == full["steps"]
    assert _max_diff(_weights(resumed["model"]), _weights(full["model"])) < 1e-6
    assert _max_diff(state["state_dict"], _weights(full["model"])) > 1e-4
    # other caption weights draw other captions: other weights after the same steps
    other = main(parse_args(tiny_argv(tmp_path / "other", tiny_rec, *base,
                                      "--caption-weights", "1,0,0")))
    assert _max_diff(_weights(other["model"]), _weights(full["model"])) > 1e-6

    clip = main(parse_args(tiny_argv(tmp_path / "clip", tiny_rec, "--max-steps", "1")))
    assert "logit_bias" not in _weights(clip["model"])
    clip_ckpt = tmp_path / "clip" / "checkpoints" / ckpt_io.LATEST
    tuned = main(parse_args(tiny_argv(tmp_path / "tuned", tiny_rec, "--max-steps", "1",
                                      "--siglip", "--pretrained", str(clip_ckpt),
                                      "--lr", "1e-9")))
    assert tuned["model"].logit_bias.item() == pytest.approx(-10.0, abs=1e-3)
    assert tuned["model"].logit_scale.item() == pytest.approx(
        clip["model"].logit_scale.item(), abs=1e-3)  # the CLIP weights' scale, not ln 10


@pytest.mark.slow
def test_siglip_learns_on_the_builtin_set(tmp_path):
    """A short --siglip run on the built-in set (30 classes, chance 3.3%): held-out
    zero-shot top-1 at least 10%, three times chance (the measured figures are in
    docs/results/losses_builtin.json)."""
    result = main(parse_args(["--siglip", "--max-steps", "80", "--output", str(tmp_path),
                              "--device", "cpu", "--progress", "False",
                              "--tensorboard", "False", "--zero-shot-every", "0"]))
    assert result["zero_shot"]["acc1"] >= 0.10, result["zero_shot"]
    assert result["model"].logit_bias.item() != -10.0


def test_the_commands_of_docs_losses_parse(repo_root):
    """Every train.py command docs/losses.md shows is a valid command line (the runs
    themselves are the slow tests above and the main job)."""
    import re
    import shlex

    page = (repo_root / "docs" / "losses.md").read_text()
    lines = [line.split("#")[0].strip()
             for block in re.findall(r"^```bash\n(.*?)^```", page, flags=re.S | re.M)
             for line in block.splitlines()]
    commands = [shlex.split(line)[2:] for line in lines if line.startswith("python train.py")]
    assert len(commands) >= 4
    for argv in commands:
        parse_args(argv)
