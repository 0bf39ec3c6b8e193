"""Initialisation formulas, config handling and model features beyond the golden run."""
import math

import pytest
import torch

from rwkv_clip import ConfigError, Image_RWKV, create_RWKV_Model, load_model_configs
from rwkv_clip.config import ModelArgs


def _tiny(**overrides):
    args = load_model_configs("RWKV_CLIP_tiny")
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_fancy_init_formulas():
    args = _tiny(precision="fp32")
    torch.manual_seed(0)
    model = create_RWKV_Model(args)
    C, L = args.n_embd, args.n_layer
    for layer_id, block in enumerate(model.text_model.blocks):
        ratio = layer_id / (L - 1)
        n = torch.arange(C, dtype=torch.float64)
        decay = -6 + 5 * (n / (C - 1)) ** (0.7 + 1.3 * ratio)
        assert block.att.time_decay.dtype == torch.bfloat16
        torch.testing.assert_close(block.att.time_decay.double().flatten(),
                                   decay.to(torch.bfloat16).double(), atol=0, rtol=0)
        assert torch.all(block.att.output.weight == 0)
        assert torch.all(block.ffn.value.weight == 0)
        assert torch.all(block.att.time_maa_w1 == 0)
        expected_lnx = ((1 + layer_id) / L) ** 0.7
        torch.testing.assert_close(block.att.ln_x.weight, torch.full((C,), expected_lnx))
        # orthogonal rows with gain 0.1 for the attention key
        key = block.att.key.weight.double()
        torch.testing.assert_close(key @ key.T, 0.01 * torch.eye(C, dtype=torch.float64),
                                   atol=1e-6, rtol=0)
        ddd = torch.arange(C) / C
        torch.testing.assert_close(block.ffn.time_maa_k.flatten(),
                                   1 - ddd ** (1 - layer_id / L))
    for layer_id, layer in enumerate(model.image_model.layers):
        ratio = layer_id / (args.image_depth - 1)
        n = torch.arange(C, dtype=torch.float64)
        zigzag = ((n + 1) % 3 - 1) * 0.1
        bonus = ratio * (1 - n / (C - 1)) + zigzag
        torch.testing.assert_close(layer.att.time_faaaa.double().flatten(), bonus,
                                   atol=1e-7, rtol=0)
        assert layer.att.time_maa_w1.abs().max() <= 1e-4


def test_bf16_precision_rounds_text_init():
    torch.manual_seed(0)
    model = create_RWKV_Model(_tiny(precision="bf16"))
    for name, p in model.text_model.named_parameters():
        assert torch.equal(p, p.to(torch.bfloat16).to(p.dtype)), name


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="image_embed_dims"):
        create_RWKV_Model(_tiny(image_embed_dims=96))
    with pytest.raises(ConfigError, match="not found"):
        load_model_configs(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_configs(bad)
    with pytest.raises(ConfigError, match="missing required"):
        ModelArgs.from_dict({"n_embd": 64})


def test_resized_pos_embed_and_other_image_sizes():
    torch.manual_seed(0)
    model = create_RWKV_Model(_tiny()).eval()
    with torch.no_grad():
        model.image_model.pos_embed.normal_()
        features = model.encode_image(torch.randn(2, 3, 24, 24))  # 6x6 grid from a 4x4 table
    assert features.shape == (2, 64) and torch.isfinite(features).all()


def test_cls_token_is_used_when_enabled():
    torch.manual_seed(0)
    model = create_RWKV_Model(_tiny(image_with_cls_token=True, image_output_cls_token=True))
    assert "image_model.cls_token" in model.state_dict()
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        model.image_model.cls_token.normal_()  # a constant token is zeroed by ln0
    feats = model.encode_image(images)
    pooled = model.image_model(images)[-1][0].mean(dim=(2, 3))
    assert feats.abs().sum() > 0 and not torch.allclose(feats, pooled)
    with torch.no_grad():
        model.image_model.cls_token.normal_()
    assert not torch.allclose(feats, model.encode_image(images))


def test_grad_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    args = _tiny()
    model = create_RWKV_Model(args)
    images, text = torch.randn(2, 3, 16, 16), torch.randint(1, 1000, (2, 77))

    def grads():
        model.zero_grad()
        fi, ft, s = model(images, text)
        (fi.square().sum() + ft.square().sum() * s).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.set_grad_checkpointing(True)
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(plain[name], checkpointed[name], atol=1e-6, rtol=1e-5)


def test_bf16_autocast_on_cpu():
    torch.manual_seed(0)
    model = create_RWKV_Model(_tiny())
    images, text = torch.randn(2, 3, 16, 16), torch.randint(1, 1000, (2, 77))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fi, ft, _ = model(images, text)
    ref_i, ref_t, _ = model(images, text)
    assert torch.isfinite(fi).all() and torch.isfinite(ft).all()
    assert torch.nn.functional.cosine_similarity(fi.float(), ref_i, dim=-1).min() > 0.99
    assert torch.nn.functional.cosine_similarity(ft.float(), ref_t, dim=-1).min() > 0.99


def test_text_longer_than_ctx_len_is_rejected():
    model = create_RWKV_Model(_tiny())
    with pytest.raises(ValueError, match="ctx_len"):
        model.encode_text(torch.ones(1, 78, dtype=torch.long))


def test_image_tower_standalone_signature():
    tower = Image_RWKV(img_size=32, patch_size=8, embed_dims=160, num_heads=2, depth=2,
                       hidden_rate=1)  # head size 80, like the published image tower
    out = tower(torch.randn(1, 3, 32, 32))
    assert len(out) == 1 and out[0].shape == (1, 160, 4, 4)
    assert math.isclose(tower.layers[1].att.time_faaaa.flatten()[0].item(), 1.0 + 0.0, abs_tol=1e-6)


def test_input_size_not_a_multiple_of_the_patch_is_padded():
    torch.manual_seed(0)
    model = create_RWKV_Model(_tiny(input_size=18)).eval()  # 18 = 4 x 4 + 2: a 5x5 grid
    assert model.image_model.pos_embed.shape == (1, 25, 64)
    images = torch.randn(1, 3, 18, 18)
    padded = torch.nn.functional.pad(images, [0, 2, 0, 2])
    with torch.no_grad():
        tokens, grid = model.image_model.patch_embed(images)
        expected = model.image_model.patch_embed.projection(padded).flatten(2).transpose(1, 2)
    assert grid == (5, 5)
    torch.testing.assert_close(tokens, expected)
    assert torch.isfinite(model.encode_image(images)).all()
