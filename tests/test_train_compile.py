"""--torchcompile (open_clip's flag): the step runs compiled, checkpoints stay plain."""
import pytest
import torch
from train_util import TINY_CONFIG, make_tiny_rec, tiny_argv, tiny_model

from rwkv_clip import create_RWKV_Model, load_model_configs
from rwkv_clip.train import checkpoint as ckpt_io
from rwkv_clip.train import main, parse_args


def test_flag_defaults_off():
    assert parse_args([]).torchcompile is False
    assert parse_args(["--torchcompile"]).torchcompile is True


def test_checkpoint_of_a_compiled_model_has_plain_keys(tmp_path):
    model = tiny_model()
    compiled = torch.compile(model)  # lazy: nothing compiles until it is called
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())  # what we avoid
    opt = torch.optim.AdamW(model.parameters())
    ckpt = ckpt_io.build_checkpoint(compiled, opt, None, step=0, epoch=0, batch_in_epoch=0,
                                    args={}, rng=[], total_steps=1)
    assert list(ckpt["state_dict"]) == list(model.state_dict())
    path = ckpt_io.save_checkpoint(ckpt, tmp_path, "step_0.pt")
    fresh = create_RWKV_Model(load_model_configs(TINY_CONFIG))
    fresh.load_state_dict(torch.load(path, weights_only=True)["state_dict"], strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


@pytest.mark.slow
def test_compiled_training_step_matches_eager_and_saves_plain_weights(tmp_path):
    rec = make_tiny_rec(tmp_path / "data", n=8)
    common = ("--max-steps", "1", "--lr-scheduler", "linear", "--drop-path-rate", "0",
              "--dropout", "0")
    eager = main(parse_args(tiny_argv(tmp_path / "eager", rec, *common)))
    compiled = main(parse_args(tiny_argv(tmp_path / "compiled", rec, *common,
                                         "--torchcompile")))
    state = torch.load(tmp_path / "compiled" / "checkpoints" / ckpt_io.LATEST,
                       weights_only=True)["state_dict"]
    assert not any("_orig_mod." in k or k.startswith("module.") for k in state)
    reloaded = create_RWKV_Model(load_model_configs(TINY_CONFIG))
    reloaded.load_state_dict(state, strict=True)
    trained, reference, init = (compiled["model"].state_dict(), eager["model"].state_dict(),
                                tiny_model().state_dict())
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, trained[k]), k
    diff = max((trained[k].double() - reference[k].double()).abs().max().item() for k in trained)
    moved = max((trained[k].double() - init[k].double()).abs().max().item() for k in trained)
    assert diff < 1e-5 and moved > 1e-4  # the compiled step is the eager step, and it stepped
