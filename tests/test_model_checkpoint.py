"""Loading weights: the original's file layouts, safety, and clear errors."""
import pickle

import pytest
import torch

from rwkv_clip import CheckpointError, create_RWKV_Model, load_model_configs


@pytest.fixture(scope="module")
def tiny_args():
    return load_model_configs("RWKV_CLIP_tiny")


@pytest.fixture(scope="module")
def trained_state(tiny_args):
    torch.manual_seed(3)
    model = create_RWKV_Model(tiny_args)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p.float()).to(p.dtype))
    return model.state_dict()


def _assert_same(model, state):
    for key, value in model.state_dict().items():
        assert value.dtype == state[key].dtype, key
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("prefix", ["", "module.", "module._orig_mod.", "_orig_mod."])
def test_round_trip_with_prefixes(tmp_path, tiny_args, trained_state, prefix):
    path = tmp_path / "ckpt.pt"
    torch.save({prefix + k: v for k, v in trained_state.items()}, path)
    model = create_RWKV_Model(tiny_args, model_weight_path=path)
    _assert_same(model, trained_state)


def test_training_checkpoint_dict_is_accepted(tmp_path, tiny_args, trained_state):
    path = tmp_path / "epoch_1.pt"
    torch.save({"state_dict": trained_state, "step": 7}, path)
    _assert_same(create_RWKV_Model(tiny_args, model_weight_path=path), trained_state)


def test_mismatched_checkpoint_names_the_keys(tmp_path, tiny_args, trained_state):
    state = dict(trained_state)
    state.pop("text_model.ln_out.bias")
    state["image_model.extra.weight"] = torch.zeros(1)
    state["image_model.pos_embed"] = torch.zeros(1, 5, 64)  # no square grid: not resizable
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError) as err:
        create_RWKV_Model(tiny_args, model_weight_path=path)
    message = str(err.value)
    assert "text_model.ln_out.bias" in message
    assert "image_model.extra.weight" in message
    assert "image_model.pos_embed" in message and "input_size" in message


def test_checkpoint_of_other_config_is_refused(tmp_path, trained_state):
    args = load_model_configs("RWKV_CLIP_small")
    path = tmp_path / "tiny.pt"
    torch.save(trained_state, path)
    with pytest.raises(CheckpointError, match="does not fit this model config"):
        create_RWKV_Model(args, model_weight_path=path)


def test_missing_file(tmp_path, tiny_args):
    with pytest.raises(CheckpointError, match="does not exist"):
        create_RWKV_Model(tiny_args, model_weight_path=tmp_path / "nope.pt")


class _Payload:
    def __reduce__(self):
        return (print, ("code ran while loading",))


def test_code_in_checkpoint_is_refused(tmp_path, tiny_args):
    path = tmp_path / "evil.pt"
    torch.save({"x": _Payload()}, path, pickle_module=pickle)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        create_RWKV_Model(tiny_args, model_weight_path=path)


def test_not_a_torch_file(tmp_path, tiny_args):
    path = tmp_path / "garbage.pt"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="garbage.pt"):
        create_RWKV_Model(tiny_args, model_weight_path=path)
