"""Model configuration: the original's JSON files <-> an attribute namespace, validated.

The original passes one ``args`` object around (argparse or ``load_model_configs``),
and ``Text_RWKV(args)`` reads its fields directly. We keep that contract: a config is
a plain attribute namespace (:class:`ModelArgs`) holding exactly the JSON keys, plus
derived defaults the original fills in (``dim_att``, ``dim_ffn``, ``with_cp``...).
Unlike the original, loading a config sets no environment variables: kernel sizes
come from the tensors at call time.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from .errors import ConfigError

# Where the published and small configs live: the source checkout's model_config/,
# shipped inside the wheel as the package rwkv_clip.model_config.
_CHECKOUT_CONFIG_DIR = Path(__file__).resolve().parents[1] / "model_config"

# Fields every model needs, with the original train.py defaults for the optional ones.
DEFAULTS: dict[str, Any] = {
    "precision": "bf16",
    "dropout": 0.0,
    "image_hidden_rate": 4,
    "image_output_cls_token": False,
    "image_with_cls_token": False,
    "drop_path_rate": 0.0,
    "ctx_len": 77,
    "vocab_size": 49408,
    "text_initialization": True,
    "head_size": 64,
    "text_num_head": 0,
    "pos_emb": 0,
    "head_size_divisor": 8,
    "dim_att": 0,
    "dim_ffn": 0,
    "head_qk": 0,
    "tiny_att_dim": 0,
    "tiny_att_layer": -999,
    "with_cp": False,
}
IMAGE_REQUIRED = ("input_size", "image_depth", "image_embed_dims", "image_patch_size",
                  "image_num_heads")
TEXT_REQUIRED = ("n_layer", "n_embd")


class ModelArgs(SimpleNamespace):
    """Attribute namespace for model settings (what the original calls ``args``)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def config_dir() -> Path:
    """Folder of the shipped model configs (checkout first, then installed package)."""
    if _CHECKOUT_CONFIG_DIR.is_dir():
        return _CHECKOUT_CONFIG_DIR
    from importlib.resources import files
    return Path(str(files("rwkv_clip.model_config")))


def available_configs() -> list[str]:
    return sorted(p.stem for p in config_dir().glob("*.json"))


def resolve_config_path(path_or_name: str | Path) -> Path:
    """Accept a JSON path or a shipped config name such as ``RWKV_CLIP_B32``."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    shipped = config_dir() / (path.name if path.suffix == ".json" else path.name + ".json")
    if shipped.is_file() and path.parent == Path("."):
        return shipped
    raise ConfigError(f"model config {str(path_or_name)!r} not found: expected a JSON file "
                      f"or one of the shipped configs {available_configs()}")


TRUE_WORDS = ("true", "1", "yes", "y", "on")
FALSE_WORDS = ("false", "0", "no", "n", "off")


def parse_bool(value: Any) -> bool | None:
    """True/False/1/0 (also yes/no, on/off) the way the original's scripts pass booleans;
    None for anything else."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return True if text in TRUE_WORDS else False if text in FALSE_WORDS else None


def _as_bool(name: str, value: Any) -> bool:
    parsed = parse_bool(value)
    if parsed is None:
        raise ConfigError(f"config field {name!r} must be a boolean (True/False/1/0), got {value!r}")
    return parsed


def complete_args(args: Any, source: str = "config", with_image: bool = True) -> Any:
    """Fill the original's derived defaults into ``args`` in place and validate it.

    ``with_image=False`` checks only the text fields (for a bare ``Text_RWKV(args)``).
    """
    for key, value in DEFAULTS.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    required = TEXT_REQUIRED + (IMAGE_REQUIRED if with_image else ())
    missing = [k for k in required if not hasattr(args, k)]
    if missing:
        raise ConfigError(f"{source}: missing required field(s) {missing}")
    for key in ("image_output_cls_token", "image_with_cls_token", "text_initialization", "with_cp"):
        setattr(args, key, _as_bool(key, getattr(args, key)))
    if not args.dim_att or args.dim_att <= 0:
        args.dim_att = args.n_embd
    if not args.dim_ffn or args.dim_ffn <= 0:
        args.dim_ffn = int((args.n_embd * 3.5) // 32 * 32)
    if args.text_num_head:
        if args.n_embd % args.text_num_head:
            raise ConfigError(f"{source}: n_embd {args.n_embd} not divisible by text_num_head "
                              f"{args.text_num_head}")
        args.head_size = args.n_embd // args.text_num_head
    validate_text_args(args, source)
    if with_image:
        validate_image_args(args, source)
    return args


def validate_image_args(args: Any, source: str = "config") -> None:
    """Check the constraints the image tower and the CLIP head rely on."""
    def fail(msg: str):
        raise ConfigError(f"{source}: {msg}")

    if args.image_embed_dims != args.n_embd:
        fail(f"image_embed_dims ({args.image_embed_dims}) must equal n_embd ({args.n_embd}): "
             "RWKV-CLIP has no projection layers, so both towers share one width")
    if args.image_embed_dims % args.image_num_heads:
        fail(f"image_embed_dims {args.image_embed_dims} not divisible by image_num_heads "
             f"{args.image_num_heads}")
    image_head = args.image_embed_dims // args.image_num_heads
    if image_head % 4:
        fail(f"image head size {image_head} (image_embed_dims / image_num_heads) must be a "
             "multiple of 4 (the q-shift splits each head into quarters)")
    # input_size need not be a multiple of image_patch_size: the patch embedding pads
    # the bottom/right edge as the original's (mmcv "corner" adaptive padding).
    if args.image_output_cls_token and not args.image_with_cls_token:
        fail("image_output_cls_token needs image_with_cls_token")


def validate_text_args(args: Any, source: str = "config") -> None:
    """Check the constraints the text tower relies on, naming the offending field."""
    def fail(msg: str):
        raise ConfigError(f"{source}: {msg}")

    for key in ("n_embd", "dim_att", "dim_ffn"):
        if getattr(args, key) % 32:
            fail(f"{key} = {getattr(args, key)} must be a multiple of 32")
    if args.dim_att % args.head_size:
        fail(f"dim_att {args.dim_att} not divisible by head_size {args.head_size}")
    if args.head_size % 4:
        fail(f"text head_size {args.head_size} must be a multiple of 4")
    if args.precision not in ("fp32", "tf32", "fp16", "bf16"):
        fail(f"precision {args.precision!r} must be one of fp32, tf32, fp16, bf16")


def read_config_json(config_path: str | Path) -> tuple[dict[str, Any], Path]:
    """The raw settings of a model-config JSON (path or shipped name) and its path."""
    path = resolve_config_path(config_path)
    try:
        params = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model config {path}: not valid JSON ({exc})") from None
    if not isinstance(params, dict):
        raise ConfigError(f"model config {path}: expected a JSON object of settings")
    return params, path


def load_model_configs(config_path: str | Path) -> ModelArgs:
    """Read a model-config JSON (path or shipped name) into a validated ``ModelArgs``."""
    params, path = read_config_json(config_path)
    return complete_args(ModelArgs(**params), source=f"model config {path}")


def model_args_from_dict(params: dict[str, Any], source: str = "config") -> ModelArgs:
    return complete_args(ModelArgs(**params), source=source)
