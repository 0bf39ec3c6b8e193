"""Model configuration: the original's JSON files <-> a typed, validated :class:`ModelArgs`.

``ModelArgs`` keeps the original's attribute access (``args.image_embed_dims``), one typed
field per published key. Nothing here sets environment variables: kernel sizes come from
the tensors.
"""
from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .precision import PRECISIONS

# Where the published and small configs live: the source checkout's model_config/,
# shipped inside the wheel as the package rwkv_clip.model_config.
_CHECKOUT_CONFIG_DIR = Path(__file__).resolve().parents[1] / "model_config"

# The original train.py's --data-type choices (it validated the value and ignored it).
DATA_TYPES = ("utf-8", "utf-16le", "numpy", "binidx", "dummy", "uint16")

# The activation-memory policy's scope (config key rebuild, train.py --rebuild): auto
# (large branches), always, never (rwkv_clip.activation_memory.rebuilds).
REBUILD_CHOICES = ("auto", "always", "never")

# The config used when none is given (train.py, zero_shot.py without weights).
DEFAULT_CONFIG = "RWKV_CLIP_small"

# Model keys that have a command-line flag of the same name (--input-size -> input_size).
TOWER_KEYS = (
    "input_size", "image_depth", "image_embed_dims", "image_patch_size", "image_hidden_rate",
    "image_num_heads", "image_output_cls_token", "image_with_cls_token", "drop_path_rate",
    "ctx_len", "vocab_size", "text_initialization", "head_size", "text_num_head", "pos_emb",
    "head_size_divisor", "n_layer", "n_embd", "dim_att", "dim_ffn", "head_qk", "tiny_att_dim",
    "tiny_att_layer",
)

# input_size's flag and open_clip's names for it (train.py, zero_shot.py, the planner).
INPUT_SIZE_FLAGS = ("--input-size", "--force-image-size", "--image-size")

_NO_DEFAULT = object()


def _key(kind: str, default: Any = _NO_DEFAULT, *, low: float | None = None,
         below: float | None = None, choices: tuple[str, ...] | None = None,
         optional: bool = False) -> Any:
    """A config field: its JSON type (``int``, ``float``, ``bool``, ``str``) and range.

    ``low`` is inclusive, ``below`` exclusive; ``optional`` allows None (an image field
    of a text-only config).
    """
    meta = {"kind": kind, "low": low, "below": below, "choices": choices,
            "optional": optional}
    if default is _NO_DEFAULT:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


def _expectation(meta: Mapping[str, Any]) -> str:
    kind = meta["kind"]
    if kind == "bool":
        return "a JSON boolean (true or false)"
    if meta["choices"] is not None:
        return "one of " + ", ".join(meta["choices"])
    noun = "an integer" if kind == "int" else "a number"
    low, below = meta["low"], meta["below"]
    if low is not None and below is not None:
        return f"{noun} in [{low:g}, {below:g})"
    if low is not None:
        return f"{noun} >= {low:g}"
    return noun


def _check_value(name: str, value: Any, meta: Mapping[str, Any], source: str) -> Any:
    """``value`` if it fits ``meta`` (ints given for floats become floats), else raise."""
    if value is None and meta["optional"]:
        return None
    kind = meta["kind"]
    # bool is a subclass of int in Python; a JSON true is never a width or a rate.
    ok = {"bool": isinstance(value, bool),
          "int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "str": isinstance(value, str)}[kind]
    if ok and meta["choices"] is not None:
        ok = value in meta["choices"]
    if ok and kind in ("int", "float"):
        ok = ((meta["low"] is None or value >= meta["low"])
              and (meta["below"] is None or value < meta["below"]))
    if not ok:
        raise ConfigError(f"{source}: {name} = {value!r}: expected {_expectation(meta)}")
    return float(value) if kind == "float" else value


@dataclass
class ModelArgs:
    """The settings of one RWKV-CLIP model (what the original calls ``args``).

    Field names, meanings and defaults are the original's (its train.py flags and the
    keys of model_config/*.json). Constructing one validates it; ``source`` (the file or
    flag set it came from) only labels error messages, and ``with_image=False`` accepts a
    text-only config (for a bare ``Text_RWKV``).

    Building one fills in the derived defaults (``dim_att``, ``dim_ffn``, ``head_size``),
    then rejects unknown keys (naming the closest known one), wrong types and ranges, and
    broken cross-field rules.
    """

    # text tower (required)
    n_layer: int = _key("int", low=1)
    n_embd: int = _key("int", low=1)
    # image tower (required for the CLIP model)
    input_size: int | None = _key("int", None, low=1, optional=True)
    image_depth: int | None = _key("int", None, low=1, optional=True)
    image_embed_dims: int | None = _key("int", None, low=1, optional=True)
    image_patch_size: int | None = _key("int", None, low=1, optional=True)
    image_num_heads: int | None = _key("int", None, low=1, optional=True)
    image_hidden_rate: int = _key("int", 4, low=1)
    image_output_cls_token: bool = _key("bool", False)
    image_with_cls_token: bool = _key("bool", False)
    drop_path_rate: float = _key("float", 0.0, low=0, below=1)
    # text tower
    ctx_len: int = _key("int", 77, low=1)
    vocab_size: int = _key("int", 49408, low=1)
    text_initialization: bool = _key("bool", True)
    head_size: int = _key("int", 64, low=1)
    text_num_head: int = _key("int", 0, low=0)  # > 0: head_size = n_embd / text_num_head
    pos_emb: int = _key("int", 0, low=0)
    head_size_divisor: int = _key("int", 8, low=1)
    dim_att: int = _key("int", 0, low=0)  # 0: n_embd
    dim_ffn: int = _key("int", 0, low=0)  # 0: 3.5 x n_embd rounded down to 32
    head_qk: int = _key("int", 0, low=0)
    tiny_att_dim: int = _key("int", 0, low=0)
    tiny_att_layer: int = _key("int", -999)
    dropout: float = _key("float", 0.0, low=0, below=1)
    # run settings the JSONs carry (train.py's flags fall back to them)
    precision: str = _key("str", "bf16", choices=PRECISIONS)
    with_cp: bool = _key("bool", False)  # activation checkpointing in both towers
    # where a residual branch keeps only the activation-memory policy's tensors
    # (rwkv_clip.activation_memory.rebuilds)
    rebuild: str = _key("str", "auto", choices=REBUILD_CHOICES)
    # the dispatch table's choices for the run: "" (auto), "op=name[,op=name]" pins, or a
    # run's dispatch.json to repeat (rwkv_clip.ops.dispatch.apply_setting)
    dispatch: str = _key("str", "")
    workers: int = _key("int", 10, low=0)
    data_type: str = _key("str", "utf-8", choices=DATA_TYPES)

    source: InitVar[str] = "model config"
    with_image: InitVar[bool] = True

    def __post_init__(self, source: str, with_image: bool) -> None:
        for f in fields(self):
            setattr(self, f.name, _check_value(f.name, getattr(self, f.name), f.metadata,
                                               source))
        # the original's derived defaults
        if self.dim_att == 0:
            self.dim_att = self.n_embd
        if self.dim_ffn == 0:
            self.dim_ffn = int((self.n_embd * 3.5) // 32 * 32)
        if self.text_num_head:
            _require(self.n_embd % self.text_num_head == 0, source,
                     f"n_embd = {self.n_embd} must be divisible by text_num_head = "
                     f"{self.text_num_head}")
            self.head_size = self.n_embd // self.text_num_head
        _validate_text(self, source)
        missing = [k for k in IMAGE_REQUIRED if getattr(self, k) is None]
        if with_image and missing:
            raise ConfigError(f"{source}: missing required key(s) {missing}")
        if not missing:
            _validate_image(self, source)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (JSON-safe: ints, floats, bools, strings, None)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, params: Mapping[str, Any], source: str = "model config",
                  with_image: bool = True) -> ModelArgs:
        """Validate ``params`` (JSON keys -> values) into a new ``ModelArgs``."""
        unknown = [k for k in params if k not in KEYS]
        if unknown:
            raise ConfigError(_unknown_key_message(unknown[0], source))
        missing = [k for k in TEXT_REQUIRED if k not in params]
        if missing:
            raise ConfigError(f"{source}: missing required key(s) {missing}")
        return cls(**params, source=source, with_image=with_image)


KEYS = tuple(f.name for f in fields(ModelArgs))
# Keys that say how a run computes rather than what the model is (a checkpoint's are the
# run's; evaluation and export choose their own).
RUN_KEYS = ("precision", "with_cp", "rebuild", "dispatch", "workers", "data_type")
# The model settings a checkpoint carries to evaluation and export (every other key).
MODEL_KEYS = tuple(k for k in KEYS if k not in RUN_KEYS)
TEXT_REQUIRED = ("n_layer", "n_embd")
IMAGE_REQUIRED = ("input_size", "image_depth", "image_embed_dims", "image_patch_size",
                  "image_num_heads")


def _unknown_key_message(key: str, source: str) -> str:
    close = difflib.get_close_matches(str(key), KEYS, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(KEYS)}"
    return f"unknown key {key!r} in {source}; {hint}"


def _require(condition: bool, source: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{source}: {message}")


def _validate_text(args: ModelArgs, source: str) -> None:
    """The constraints the text tower relies on, naming the offending keys."""
    for key in ("n_embd", "dim_att", "dim_ffn"):
        value = getattr(args, key)
        _require(value % 32 == 0, source, f"{key} = {value}: expected a multiple of 32")
    _require(args.dim_att % args.head_size == 0, source,
             f"dim_att = {args.dim_att} must be divisible by head_size = {args.head_size}")
    _require(args.head_size % 4 == 0, source,
             f"head_size = {args.head_size}: expected a multiple of 4 (the token shift "
             "splits each head into quarters)")
    if args.tiny_att_dim > 0:
        _require(0 <= args.tiny_att_layer < args.n_layer, source,
                 f"tiny_att_layer = {args.tiny_att_layer}: with tiny_att_dim > 0 expected a "
                 f"text block index in [0, {args.n_layer}) (else no block has the attention)")


def _validate_image(args: ModelArgs, source: str) -> None:
    """The constraints the image tower and the CLIP head rely on."""
    # the field-level checks ran first: with an image tower these are set
    assert args.image_embed_dims is not None and args.image_num_heads is not None
    _require(args.image_embed_dims == args.n_embd, source,
             f"image_embed_dims = {args.image_embed_dims} must equal n_embd = {args.n_embd}: "
             "RWKV-CLIP has no projection layers, so both towers share one width")
    _require(args.image_embed_dims % args.image_num_heads == 0, source,
             f"image_embed_dims = {args.image_embed_dims} must be divisible by "
             f"image_num_heads = {args.image_num_heads}")
    image_head = args.image_embed_dims // args.image_num_heads
    _require(image_head % 4 == 0, source,
             f"image head size {image_head} (image_embed_dims / image_num_heads): expected a "
             "multiple of 4 (the q-shift splits each head into quarters)")
    # input_size need not be a multiple of image_patch_size: the patch embedding pads
    # the bottom/right edge as the original's (mmcv "corner" adaptive padding).
    _require(args.image_with_cls_token or not args.image_output_cls_token, source,
             "image_output_cls_token = true needs image_with_cls_token = true")


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
    """True/False/1/0 (also yes/no, on/off) the way the original's launch scripts pass
    boolean flags; None for anything else. (Config files take JSON booleans only: the
    published ones use them.)"""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return True if text in TRUE_WORDS else False if text in FALSE_WORDS else None


def str2bool(value: Any) -> bool:
    """argparse type for booleans: True/False, 1/0 (also yes/no), as the original's scripts."""
    parsed = parse_bool(value)
    if parsed is None:
        raise argparse.ArgumentTypeError(f"expected a boolean (True/False/1/0), got {value!r}")
    return parsed


def apply_overrides(params: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Config keys with ``overrides`` on top; a new ``n_embd`` re-derives ``dim_att`` and
    ``dim_ffn`` unless those are overridden too."""
    out = dict(params)
    out.update(overrides)
    if "n_embd" in overrides:
        for key in ("dim_att", "dim_ffn"):
            if key not in overrides:
                out[key] = 0
    return out


def complete_args(args: Any, source: str = "model args", with_image: bool = True) -> ModelArgs:
    """A new validated :class:`ModelArgs` from ``args`` (a ``ModelArgs``, any attribute
    namespace such as argparse's or ``SimpleNamespace``, or a dict), with the original's
    derived defaults filled in; ``args`` itself is left as it was.

    ``with_image=False`` accepts a text-only config (for a bare ``Text_RWKV(args)``).
    An ``argparse.Namespace`` (the original's scripts pass their whole command line)
    contributes only the config keys it holds; a dict or other namespace must hold config
    keys only.
    """
    if isinstance(args, Mapping):
        params = dict(args)
    elif isinstance(args, argparse.Namespace):
        known = {f.name for f in fields(ModelArgs)}
        params = {k: v for k, v in vars(args).items() if k in known}
    else:
        try:
            params = dict(vars(args))  # a ModelArgs too: its fields and any attribute set
        except TypeError:
            raise ConfigError(f"{source}: expected a model config (ModelArgs, a namespace "
                              f"or a dict), got {type(args).__name__}") from None
    return ModelArgs.from_dict(params, source=source, with_image=with_image)


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


def check_fields(params: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``params`` with every key known and every value of its field's type and range
    (floats for ints where the field is a float); a partial set is fine, the cross-field
    rules are :class:`ModelArgs`'s."""
    metas = {f.name: f.metadata for f in fields(ModelArgs)}
    out = {}
    for key, value in params.items():
        if key not in metas:
            raise ConfigError(_unknown_key_message(key, source))
        out[key] = _check_value(key, value, metas[key], source)
    return out


def differing_keys(args: ModelArgs, other: ModelArgs,
                   keys: tuple[str, ...] = MODEL_KEYS) -> list[str]:
    """The ``keys`` whose values differ between two validated configs, in field order."""
    return [k for k in keys if getattr(args, k) != getattr(other, k)]


def describe_settings(args: ModelArgs, keys: list[str]) -> str:
    """``ctx_len 192, input_size 24``."""
    return ", ".join(f"{k} {getattr(args, k)}" for k in keys)


def with_checkpoint_settings(args: ModelArgs, weights: Any, name: str,
                             log: Callable[[str], None] | None = None) -> ModelArgs:
    """``args`` (of the config ``name``) with the model settings ``weights`` (a
    :class:`rwkv_clip.checkpoint_files.StateDict`, or None) were trained with on top; one
    line through ``log`` names those that differ from ``name``'s."""
    saved = dict(getattr(weights, "settings", None) or {})
    if not saved:
        return args
    merged = ModelArgs.from_dict(apply_overrides(args.to_dict(), saved),
                                 source=f"the model settings saved in {weights.label}")
    differ = differing_keys(merged, args, tuple(saved))
    if differ and log is not None:
        log(f"model settings: {describe_settings(merged, differ)} from the checkpoint "
            f"{weights.label} ({name} has {describe_settings(args, differ)})")
    return merged


def overriding_note(args: ModelArgs, trained: ModelArgs, keys: list[str],
                    as_flags: bool = False) -> str | None:
    """One line for the ``keys`` where ``args`` (what the user asked for) contradicts the
    settings the weights were trained with (``trained``); None when none does."""
    differ = [k for k in differing_keys(args, trained) if k in keys]
    if not differ:
        return None
    name = (lambda k: "--" + k.replace("_", "-")) if as_flags else (lambda k: k)
    return ("; ".join(f"{name(k)} {getattr(args, k)} overrides the checkpoint's {k} "
                      f"{getattr(trained, k)}" for k in differ)
            + " (the weights were trained at the checkpoint's)")


def kept_settings_note(args: ModelArgs, weights: Any) -> str | None:
    """One line for the settings of a model built at ``args`` that contradict those
    ``weights`` were trained with (:func:`overriding_note`); None when none does."""
    saved = list(getattr(weights, "settings", None) or ())
    return overriding_note(args, with_checkpoint_settings(args, weights, ""), saved)


def folder_config(args: ModelArgs, config: str | Path) -> dict[str, Any]:
    """The model config an exported folder holds: ``config``'s JSON (its key order and
    run keys) with every model key where ``args`` differs from it set to ``args``'
    value."""
    params = read_config_json(config)[0]
    base = ModelArgs.from_dict(params, source=f"model config {config}")
    out = dict(params)
    out.update({k: getattr(args, k) for k in differing_keys(args, base)})
    return out


def load_model_configs(config_path: str | Path) -> ModelArgs:
    """Read a model-config JSON (path or shipped name) into a validated ``ModelArgs``."""
    params, path = read_config_json(config_path)
    return ModelArgs.from_dict(params, source=f"model config {path}")

