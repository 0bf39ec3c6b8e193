"""Strict model configs: unknown keys, wrong types and impossible values are one clear
ConfigError; loading keeps every published value; complete_args builds a new object once
per model; train.py's flags override the chosen config (default: the small one)."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from train_util import REPO, TINY_CONFIG

import rwkv_clip.model
import rwkv_clip.text_rwkv
from rwkv_clip import (
    ClipLoss,
    ConfigError,
    ModelArgs,
    Text_RWKV,
    create_RWKV_Model,
    load_model_configs,
)
from rwkv_clip.config import available_configs, complete_args, config_dir, read_config_json
from rwkv_clip.train.args import build_train_parser, parse_args, resolve_model_config


def _tiny_params() -> dict:
    return json.loads((REPO / "model_config" / "RWKV_CLIP_tiny.json").read_text())


def _write(tmp_path, params: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(params))
    return path


# ----------------------------------------------------------------- published configs

@pytest.mark.parametrize("name", available_configs())
def test_shipped_configs_load_with_every_value_kept(name):
    raw, _ = read_config_json(name)
    loaded = load_model_configs(name).to_dict()
    assert {k: loaded[k] for k in raw} == raw


def test_published_b32_and_b16_values():
    b32, b16 = load_model_configs("RWKV_CLIP_B32"), load_model_configs("RWKV_CLIP_B16")
    assert (b32.image_embed_dims, b32.n_embd, b32.image_depth, b32.n_layer) == (640, 640, 12, 6)
    assert (b32.image_patch_size, b16.image_patch_size) == (32, 16)
    assert (b32.dim_att, b32.dim_ffn, b32.image_hidden_rate) == (640, 2240, 5)
    assert b32.drop_path_rate == 0.3 and b32.precision == "bf16" and b32.with_cp is False


def test_round_trip_through_json(tmp_path):
    args = load_model_configs("RWKV_CLIP_B32")
    path = _write(tmp_path, args.to_dict())
    again = load_model_configs(path)
    assert again == args and again is not args
    # derived keys written out explicitly read back to the same model
    small = load_model_configs("RWKV_CLIP_small")
    assert load_model_configs(_write(tmp_path, small.to_dict())) == small


# ----------------------------------------------------------------- unknown keys

def test_unknown_key_names_it_and_the_closest_known_key(tmp_path):
    params = {**_tiny_params(), "image_embed_dim": 96}  # beside image_embed_dims: 64
    path = _write(tmp_path, params)
    with pytest.raises(ConfigError) as exc:
        load_model_configs(path)
    assert str(exc.value) == (f"unknown key 'image_embed_dim' in model config {path}; "
                              "did you mean 'image_embed_dims'?")


def test_unknown_key_without_a_close_match_lists_the_known_keys(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'zzz'.*known keys: n_layer, n_embd"):
        load_model_configs(_write(tmp_path, {**_tiny_params(), "zzz": 1}))


def test_unknown_attribute_of_a_namespace_is_refused():
    ns = SimpleNamespace(**_tiny_params(), n_layers=4)
    with pytest.raises(ConfigError, match="unknown key 'n_layers'.*did you mean 'n_layer'"):
        create_RWKV_Model(ns)


# ----------------------------------------------------------------- types and values

@pytest.mark.parametrize("key,value,expected", [
    ("image_depth", "twelve", "an integer >= 1"),
    ("n_layer", 2.5, "an integer >= 1"),
    ("n_embd", True, "an integer >= 1"),  # a JSON boolean is not a width
    ("vocab_size", None, "an integer >= 1"),
    ("drop_path_rate", "0.1", "a number in [0, 1)"),
    ("image_with_cls_token", "yes", "a JSON boolean (true or false)"),
    ("text_initialization", 1, "a JSON boolean (true or false)"),
    ("precision", "fp8", "one of fp32, tf32, bf16, fp16"),
    ("data_type", "ascii", "one of utf-8"),
    ("tiny_att_layer", "last", "an integer"),
])
def test_wrong_types_name_key_value_and_expectation(tmp_path, key, value, expected):
    path = _write(tmp_path, {**_tiny_params(), key: value})
    with pytest.raises(ConfigError) as exc:
        load_model_configs(path)
    assert str(exc.value).startswith(f"model config {path}: {key} = {value!r}: expected "
                                     f"{expected}")


@pytest.mark.parametrize("key,value,expected", [
    ("n_layer", 0, "expected an integer >= 1"),
    ("image_depth", 0, "expected an integer >= 1"),
    ("input_size", -16, "expected an integer >= 1"),
    ("image_patch_size", 0, "expected an integer >= 1"),
    ("image_num_heads", 0, "expected an integer >= 1"),
    ("ctx_len", 0, "expected an integer >= 1"),
    ("workers", -1, "expected an integer >= 0"),
    ("dim_ffn", -32, "expected an integer >= 0"),
    ("drop_path_rate", -0.5, "expected a number in [0, 1)"),
    ("drop_path_rate", 1.0, "expected a number in [0, 1)"),
    ("dropout", 1.5, "expected a number in [0, 1)"),
])
def test_impossible_values_name_key_value_and_expectation(tmp_path, key, value, expected):
    with pytest.raises(ConfigError) as exc:
        load_model_configs(_write(tmp_path, {**_tiny_params(), key: value}))
    assert f": {key} = {value!r}: {expected}" in str(exc.value)


@pytest.mark.parametrize("overrides,words", [
    ({"image_embed_dims": 96}, ["image_embed_dims = 96 must equal n_embd = 64"]),
    ({"image_num_heads": 3}, ["image_embed_dims = 64", "divisible by image_num_heads = 3"]),
    ({"image_num_heads": 32}, ["image head size 2", "multiple of 4"]),
    ({"text_num_head": 3}, ["n_embd = 64", "divisible by text_num_head = 3"]),
    ({"head_size": 24}, ["dim_att = 64", "divisible by head_size = 24"]),
    ({"head_size": 2, "dim_att": 64}, ["head_size = 2", "multiple of 4"]),
    ({"dim_att": 48}, ["dim_att = 48", "multiple of 32"]),
    ({"tiny_att_dim": 16}, ["tiny_att_layer = -999", "[0, 2)"]),
    ({"image_output_cls_token": True}, ["image_output_cls_token", "image_with_cls_token"]),
])
def test_inconsistent_configs_name_the_keys(tmp_path, overrides, words):
    path = _write(tmp_path, {**_tiny_params(), **overrides})
    with pytest.raises(ConfigError) as exc:
        load_model_configs(path)
    message = str(exc.value)
    assert message.startswith(f"model config {path}: ")
    for word in words:
        assert word in message


def test_missing_required_keys(tmp_path):
    params = _tiny_params()
    del params["n_layer"], params["image_depth"]
    with pytest.raises(ConfigError, match=r"missing required key\(s\) \['n_layer'\]"):
        load_model_configs(_write(tmp_path, params))
    params["n_layer"] = 2
    with pytest.raises(ConfigError, match=r"missing required key\(s\) \['image_depth'\]"):
        load_model_configs(_write(tmp_path, params))


def test_derived_defaults_follow_the_original():
    args = ModelArgs(n_layer=2, n_embd=128, input_size=32, image_depth=2,
                     image_embed_dims=128, image_patch_size=4, image_num_heads=2,
                     text_num_head=4)
    assert (args.dim_att, args.dim_ffn, args.head_size) == (128, 448, 32)
    assert isinstance(ModelArgs.from_dict({**_tiny_params(), "dropout": 0}).dropout, float)


# ----------------------------------------------------------------- complete_args

def test_complete_args_returns_a_new_object_and_leaves_its_input():
    ns = SimpleNamespace(**{**_tiny_params(), "dim_att": 0, "dim_ffn": 0})
    before = dict(vars(ns))
    done = complete_args(ns)
    assert isinstance(done, ModelArgs) and (done.dim_att, done.dim_ffn) == (64, 224)
    assert vars(ns) == before
    params = {**_tiny_params(), "dim_att": 0}
    complete_args(params)
    assert params["dim_att"] == 0
    args = load_model_configs(TINY_CONFIG)
    assert complete_args(args) == args and complete_args(args) is not args


def test_a_build_validates_once_and_never_touches_the_callers_args(monkeypatch):
    calls = []
    real = complete_args

    def counting(*a, **kw):
        calls.append(kw.get("source"))
        return real(*a, **kw)

    monkeypatch.setattr(rwkv_clip.model, "complete_args", counting)
    monkeypatch.setattr(rwkv_clip.text_rwkv, "complete_args", counting)
    args = load_model_configs(TINY_CONFIG)
    with torch.device("meta"):
        model = create_RWKV_Model(args)
    assert len(calls) == 1
    model.set_grad_checkpointing(True)
    assert args.with_cp is False and model.text_model.args.with_cp is True
    # edits made after loading are validated by the build
    args.image_embed_dims = 96
    with pytest.raises(ConfigError, match="image_embed_dims = 96 must equal n_embd = 64"):
        create_RWKV_Model(args)


def test_text_tower_alone_needs_only_text_keys():
    ns = SimpleNamespace(n_layer=1, n_embd=64, head_size=32, vocab_size=256, ctx_len=8)
    tower = Text_RWKV(ns)
    assert tower.args.dim_ffn == 224 and not hasattr(ns, "dim_ffn")
    for module in tower.modules():
        if hasattr(module, "wkv_backend"):
            module.wkv_backend = "reference"
    assert tower(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 64)
    with pytest.raises(ConfigError, match="missing required key"):
        create_RWKV_Model(ns)


# ----------------------------------------------------------------- head_qk under DDP

def test_head_qk_model_trains_under_ddp_without_unused_parameters(tmp_path):
    """head_qk > 0 adds the original's head_q/head_k, which the CLIP feature never uses;
    DDP with find_unused_parameters=False (as the trainer) must still run two steps."""
    import torch.distributed as dist

    args = load_model_configs(TINY_CONFIG)
    args.head_qk = 8
    torch.manual_seed(0)
    model = create_RWKV_Model(args)
    model.set_wkv_backend("reference")
    assert "text_model.head_q.weight" in model.state_dict()  # original checkpoints load
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        images, tokens = torch.randn(2, 3, 16, 16), torch.randint(0, 100, (2, 77))
        for _ in range(2):  # an unreduced parameter fails at the second forward
            image_features, text_features, scale = ddp(images, tokens)
            loss = ClipLoss()(F.normalize(image_features, dim=-1),
                              F.normalize(text_features, dim=-1), scale)
            opt.zero_grad()
            loss.backward()
            opt.step()
        del ddp  # the gloo exit trap: no DDP reducer may outlive its process group
    finally:
        dist.destroy_process_group()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------- train.py resolution

def test_a_single_tower_flag_overrides_the_small_default():
    small = parse_args([])
    args = parse_args(["--drop-path-rate", "0", "--max-steps", "1"])
    assert args.model_config == small.model_config  # the small model, not 224 px / 384 wide
    shipped = load_model_configs("RWKV_CLIP_small")
    assert (args.n_embd, args.input_size, args.image_depth) == (
        shipped.n_embd, shipped.input_size, shipped.image_depth)
    assert args.input_size < 224 and args.n_embd < 384
    assert args.config_source == (f"{config_dir() / 'RWKV_CLIP_small.json'} overridden by "
                                  "--drop-path-rate")
    with torch.device("meta"):
        n_params = sum(p.numel() for p in create_RWKV_Model(args.model_config).parameters())
    assert n_params < 10_000_000


def test_tower_flags_override_the_chosen_config():
    ns = build_train_parser().parse_args(["--config", "RWKV_CLIP_B32", "--n-layer", "3",
                                    "--image-depth", "4", "--drop-path-rate", "0.1"])
    model, source = resolve_model_config(ns)
    b32 = load_model_configs("RWKV_CLIP_B32")
    assert (model.n_layer, model.image_depth, model.drop_path_rate) == (3, 4, 0.1)
    assert {k: v for k, v in model.to_dict().items()
            if k not in ("n_layer", "image_depth", "drop_path_rate")} == \
        {k: v for k, v in b32.to_dict().items()
         if k not in ("n_layer", "image_depth", "drop_path_rate")}
    assert source == (f"{config_dir() / 'RWKV_CLIP_B32.json'} overridden by --image-depth, "
                      "--drop-path-rate, --n-layer")


def test_a_bad_tower_flag_value_is_a_config_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--drop-path-rate", "1.5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("train.py: error: model config ") and "\n" not in err
    assert "--drop-path-rate: drop_path_rate = 1.5: expected a number in [0, 1)" in err


def test_train_py_with_a_bad_config_prints_one_line_and_exits_2(tmp_path):
    path = _write(tmp_path, {**_tiny_params(), "image_embed_dim": 96})
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"train.py: error: unknown key 'image_embed_dim' in model config {path}; "
        "did you mean 'image_embed_dims'?"]


def test_an_argparse_namespace_contributes_only_its_config_keys():
    """The original's train.py passes its whole command line to create_RWKV_Model."""
    import argparse

    from rwkv_clip.config import complete_args, load_model_configs

    base = load_model_configs("RWKV_CLIP_tiny")
    ns = argparse.Namespace(**base.to_dict(), lr=0.1, batch_size=3)
    assert complete_args(ns).to_dict() == complete_args(base).to_dict()
