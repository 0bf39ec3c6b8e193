"""Models by name, open_clip's way, and the one path every tool builds a model by: choose
the config, build, check the weights against it, load them strictly."""
from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .checkpoint_files import StateDict, fit_image_size, load_checked
from .config import (
    DEFAULT_CONFIG,
    ModelArgs,
    apply_overrides,
    available_configs,
    differing_keys,
    load_model_configs,
    overriding_note,
    read_config_json,
    with_checkpoint_settings,
)
from .errors import CheckpointError, ConfigError
from .model import create_RWKV_Model, get_model
from .pretrained import load_weights, model_config


def build_model(args: Any, weights: StateDict | None = None, *, seed: int | None = None,
                wkv_backend: str | None = None,
                device: str | torch.device | None = None) -> get_model:
    """RWKV-CLIP from ``args`` (a ``ModelArgs``, namespace or dict of config keys), with
    ``weights`` loaded strictly if given; ``seed`` seeds torch's generator before the random
    initialisation."""
    if seed is not None:
        torch.manual_seed(seed)
    model = create_RWKV_Model(args)
    if weights is not None:
        load_checked(model, weights, hint=lambda: fitting_config_hint(weights.tensors))
    if wkv_backend is not None:
        model.set_wkv_backend(wkv_backend)
    if device is not None:
        model = model.to(device)
    return model


def infer_config(state_dict: Mapping[str, torch.Tensor],
                 overrides: Mapping[str, Any] | None = None) -> str | None:
    """The shipped config whose model (with ``overrides`` applied to its keys) has exactly
    the parameter names and shapes of ``state_dict``; None if none has. When several fit
    (B/16 with ``image_patch_size=32`` is B/32), the one the overrides change least wins.
    With ``input_size`` among the overrides, a ``pos_embed`` of another square grid fits
    too, as loading resizes it (:func:`rwkv_clip.checkpoint_files.fit_image_size`)."""
    overrides = dict(overrides or {})
    matches = []
    for name in available_configs():
        params = read_config_json(name)[0]
        try:
            base = ModelArgs.from_dict(params, source=f"model config {name}")
            args = ModelArgs.from_dict(apply_overrides(params, overrides),
                                       source=f"model config {name}")
            with torch.device("meta"):
                model = create_RWKV_Model(args)
        except ConfigError:  # the overrides do not fit this config: it does not match
            continue
        tensors = dict(state_dict)
        if "input_size" in overrides:
            tensors = fit_image_size(model, tensors)
        # SigLIP's logit_bias is the same for every config (check_state_dict adds it)
        shapes = {k: tuple(v.shape) for k, v in tensors.items() if k != "logit_bias"}
        if {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes:
            changed = len(differing_keys(args, base, tuple(overrides)))
            matches.append((changed, name))
    return min(matches)[1] if matches else None


def fitting_config_hint(state_dict: Mapping[str, torch.Tensor]) -> str:
    """The fix for weights that do not fit the chosen config: the shipped config they fit."""
    fits = infer_config(state_dict)
    if not fits:
        return ""
    return (f"; its shapes fit model_config/{fits}.json (pass --config {fits}, or "
            f"load_model_configs({fits!r}) in Python)")


def choose_model_args(config: str | os.PathLike | None, weights: StateDict | None = None,
                      overrides: Mapping[str, Any] | None = None,
                      log: Callable[[str], None] | None = None) -> tuple[ModelArgs, str]:
    """The model settings and their config's name: ``config`` if given, else the config the
    published ``weights`` name, else the shipped config whose model fits the weights'
    parameter shapes (and the settings they were trained with), else the default.

    The model settings a training checkpoint records (``weights.settings``: its context
    length, image size, every model key) override the config's keys, with one line
    through ``log`` when they differ from them; ``overrides`` (config keys, the user's
    flags) apply last, with one line for each that contradicts the checkpoint."""
    overrides = dict(overrides or {})
    saved = dict(weights.settings or {}) if weights is not None else {}
    if config:
        params, path = read_config_json(str(config))
        name = Path(path).stem
    elif weights is not None and weights.config is not None:
        name = weights.config
        params = read_config_json(name)[0]
    elif weights is not None:
        inferred = infer_config(weights.tensors, {**saved, **overrides})
        if inferred is None:
            flags = " with the given architecture flags" if overrides else ""
            raise ConfigError(f"checkpoint {weights.label} matches none of the shipped configs "
                              f"{available_configs()}{flags}: pass --config path/to/config.json")
        name = inferred
        if log is not None:
            how = "nearest the checkpoint's saved settings" if saved else \
                "inferred from the checkpoint's parameter shapes"
            log(f"config: {name} ({how})")
        params = read_config_json(name)[0]
    else:
        name = DEFAULT_CONFIG
        params = read_config_json(name)[0]
    trained = with_checkpoint_settings(
        ModelArgs.from_dict(params, source=f"model config {name}"), weights, name, log)
    source = f"model config {name}" + (" with the architecture flags" if overrides else "")
    args = ModelArgs.from_dict(apply_overrides(trained.to_dict(), overrides), source=source)
    note = overriding_note(args, trained, [k for k in overrides if k in saved], as_flags=True)
    if note and log is not None:
        log(note)
    return args, name


def _say(msg: str) -> None:
    print(msg, flush=True)


def create_model(model_name: str, pretrained: str | os.PathLike | None = None,
                 device: str | torch.device | None = None, *, wkv_backend: str | None = None,
                 revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                 seed: int | None = None) -> get_model:
    """RWKV-CLIP ``model_name`` (model name, config name or config path), with the
    ``pretrained`` weights if given (tag, file or hf-hub name), on ``device``. A training
    checkpoint's model settings (context length, image size, ...) replace the config's,
    with one printed line when they differ."""
    config = model_config(model_name)
    args = load_model_configs(config)
    weights = None
    if pretrained is not None:
        weights = load_weights(pretrained, model_name, revision=revision, cache_dir=cache_dir)
        args = with_checkpoint_settings(args, weights, Path(config).stem, _say)
    return build_model(args, weights, seed=seed, wkv_backend=wkv_backend, device=device)


def create_model_and_transforms(model_name: str, pretrained: str | os.PathLike | None = None,
                                device: str | torch.device | None = None, *,
                                wkv_backend: str | None = None, revision: str | None = None,
                                cache_dir: str | os.PathLike | None = None,
                                seed: int | None = None) -> tuple[get_model, Any, Any]:
    """``(model, preprocess_train, preprocess_val)`` as open_clip's function of that name.

    ``model_name`` may also be an exported folder (``python -m rwkv_clip.export ...
    --format hub``): ``hf-hub:ORG/NAME[@REVISION]`` through the Hub cache or
    ``local-dir:DIR`` from disk; its own weights load unless ``pretrained`` is given.
    ``preprocess_val`` is open_clip's eval transform (what the original used for every set
    but ImageNet); ``rwkv_clip.eval.eval_transform("imagenet", size)`` gives the ImageNet
    protocol. The model is returned in train mode, as open_clip's: call ``.eval()``.
    """
    from .hub import is_folder_spec
    from .transform import image_transform

    if is_folder_spec(model_name):  # an exported folder: its config, weights, preprocessing
        return create_from_folder(str(model_name), pretrained, device, wkv_backend=wkv_backend,
                                  revision=revision, cache_dir=cache_dir)
    model = create_model(model_name, pretrained, device, wkv_backend=wkv_backend,
                         revision=revision, cache_dir=cache_dir, seed=seed)
    size = int(model.text_model.args.input_size or 0)  # the checkpoint's, if it records one
    return model, image_transform(size, is_train=True), image_transform(size, is_train=False)


def create_from_folder(spec: str, pretrained: str | os.PathLike | None = None,
                       device: str | torch.device | None = None, *,
                       wkv_backend: str | None = None, revision: str | None = None,
                       cache_dir: str | os.PathLike | None = None
                       ) -> tuple[get_model, Any, Any]:
    """``(model, preprocess_train, preprocess_val)`` of an exported folder (its weights,
    or ``pretrained`` if given)."""
    from .hub import (
        MODEL_CONFIG_FILE,
        PREPROCESS_CONFIG_FILE,
        WEIGHTS_FILE,
        folder_file,
        known_hub_repo,
        read_folder_json,
    )
    from .transform import image_transform

    known = known_hub_repo(spec)
    if known is not None:
        return create_model_and_transforms(known.config, pretrained or spec, device,
                                           wkv_backend=wkv_backend, revision=revision,
                                           cache_dir=cache_dir)
    config_path = folder_file(spec, MODEL_CONFIG_FILE, revision=revision, cache_dir=cache_dir)
    cfg = read_folder_json(spec, PREPROCESS_CONFIG_FILE, revision=revision, cache_dir=cache_dir)
    if not isinstance(cfg.get("size"), int):
        raise CheckpointError(f"{spec}: {PREPROCESS_CONFIG_FILE} has no integer size")
    weights = pretrained or folder_file(spec, WEIGHTS_FILE, revision=revision,
                                        cache_dir=cache_dir)
    model = create_model(str(config_path), weights, device, wkv_backend=wkv_backend,
                         revision=revision, cache_dir=cache_dir)
    kwargs = {k: cfg[k] for k in ("resize_mode", "interpolation") if cfg.get(k)}
    mean, std, size = cfg.get("mean"), cfg.get("std"), cfg["size"]
    return (model, image_transform(size, is_train=True, mean=mean, std=std),
            image_transform(size, is_train=False, mean=mean, std=std, **kwargs))


def get_tokenizer(model_name: str) -> Callable[[str | list[str]], torch.Tensor]:
    """``texts -> (N, ctx_len)`` token ids for ``model_name`` (a model or config name, or an
    exported folder ``hf-hub:ORG/NAME`` / ``local-dir:DIR``; CLIP's BPE, zero padded)."""
    from .hub import folder_context_length, is_folder_spec
    from .tokenizer import tokenize

    if is_folder_spec(model_name):
        ctx_len = folder_context_length(model_name)
    else:
        ctx_len = int(read_config_json(model_config(model_name))[0].get("ctx_len", 77))
    return functools.partial(tokenize, context_length=ctx_len)


__all__ = ["build_model", "infer_config", "choose_model_args", "create_model",
           "create_model_and_transforms", "create_from_folder", "get_tokenizer"]
