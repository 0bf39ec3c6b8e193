"""Weights by name, open_clip's way: the published RWKV-CLIP checkpoints, where they live on
the Hugging Face Hub, and one resolver from what a user types to a local file.

A name is a model tag, ``NAME:TAG``, a local file or ``hf-hub:OWNER/REPO[/FILE]``, with
optional ``@REVISION``; downloads use ``huggingface_hub``'s cache (docs/pretrained.md).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint_files import StateDict, read_checkpoint
from .errors import CheckpointError, ConfigError

HF_HUB_PREFIX = "hf-hub:"
DEFAULT_HUB_FILE = "model_31.pt"  # what the original's trainer writes after its 32 epochs
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")

# Model names (open_clip style) -> the shipped config that builds them.
MODEL_CONFIGS = {"RWKV-CLIP-B32": "RWKV_CLIP_B32", "RWKV-CLIP-B16": "RWKV_CLIP_B16"}


@dataclass(frozen=True)
class PretrainedCfg:
    """One published checkpoint: ``torch.save(ddp_model.state_dict())`` (``module.`` keys)."""

    model_name: str
    tag: str
    hf_repo: str
    filename: str = DEFAULT_HUB_FILE
    revision: str | None = None  # None: the repository's default branch

    @property
    def config(self) -> str:
        return MODEL_CONFIGS[self.model_name]


PRETRAINED = (
    PretrainedCfg("RWKV-CLIP-B32", "yfcc15m", "Kaichengalex/RWKV-CLIP-B32-YFCC15M"),
    PretrainedCfg("RWKV-CLIP-B32", "laion10m", "Kaichengalex/RWKV-CLIP-B32-LAION10M"),
    PretrainedCfg("RWKV-CLIP-B32", "laion30m", "Kaichengalex/RWKV-CLIP-B32-LAION30M"),
    PretrainedCfg("RWKV-CLIP-B16", "laion10m", "Kaichengalex/RWKV-CLIP-B16-LAION10M"),
)


def list_pretrained() -> list[tuple[str, str]]:
    """``[(model_name, tag), ...]`` of the published checkpoints."""
    return [(p.model_name, p.tag) for p in PRETRAINED]


def list_models() -> list[str]:
    """Model names :func:`create_model_and_transforms` accepts besides config paths."""
    from .config import available_configs

    return list(MODEL_CONFIGS) + available_configs()


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def model_config(model_name: str | os.PathLike) -> str:
    """The config (shipped name or JSON path) of ``model_name``: a model name
    (``RWKV-CLIP-B32``), a shipped config name (``RWKV_CLIP_B32``) or a config path."""
    from .config import available_configs, resolve_config_path

    text = str(model_name)
    for name, config in MODEL_CONFIGS.items():
        if _norm(text) == _norm(name):
            return config
    for config in available_configs():
        if _norm(text) == _norm(config):
            return config
    try:
        return str(resolve_config_path(text))
    except ConfigError:
        raise ConfigError(f"unknown model {text!r}: expected one of {list_models()} or a "
                          "model-config JSON path") from None


def get_pretrained_cfg(model_name: str, tag: str) -> PretrainedCfg:
    """The registry entry of ``model_name`` (model or config name) and ``tag``."""
    config = model_config(model_name)
    for p in PRETRAINED:
        if p.config == config and _norm(p.tag) == _norm(tag):
            return p
    tags = [p.tag for p in PRETRAINED if p.config == config]
    known = f"its tags: {', '.join(tags)}" if tags else "it has no published weights"
    raise CheckpointError(f"no pretrained weights {tag!r} for model {model_name!r} ({known}; "
                          f"all: {', '.join(f'{m}:{t}' for m, t in list_pretrained())})")


@dataclass(frozen=True)
class ResolvedWeights:
    """A weights file on disk, the config it was published for (None: unknown) and a
    label for result files (the name the user gave)."""

    path: Path
    config: str | None
    label: str


def _split_revision(text: str) -> tuple[str, str | None]:
    if "@" in text:
        head, rev = text.rsplit("@", 1)
        if rev:
            return head, rev
    return text, None


def _looks_like_path(text: str) -> bool:
    return text.lower().endswith(WEIGHT_SUFFIXES) or os.sep in text or "/" in text


def is_weights_name(pretrained: str | os.PathLike) -> bool:
    """True for a name (``NAME:TAG``, ``hf-hub:...``), False for a local file's path."""
    text = str(pretrained).strip()
    if text.startswith(HF_HUB_PREFIX):
        return True
    return not Path(text).is_file() and not _looks_like_path(_split_revision(text)[0])


def published_config(pretrained: str | os.PathLike) -> str | None:
    """The shipped config a published name was trained with, without downloading: the
    registry's for ``NAME:TAG`` and a known ``hf-hub:`` repository; None for a local file
    or another repository. An unknown ``NAME:TAG`` raises :class:`CheckpointError`."""
    text = str(pretrained).strip()
    if text.startswith(HF_HUB_PREFIX):
        spec = _split_revision(text[len(HF_HUB_PREFIX):])[0]
        repo = "/".join(spec.strip("/").split("/")[:2]).lower()
        known = next((p for p in PRETRAINED if p.hf_repo.lower() == repo), None)
        return known.config if known else None
    spec = _split_revision(text)[0]
    if not is_weights_name(text) or ":" not in spec:
        return None
    name, tag = spec.split(":", 1)
    return get_pretrained_cfg(name, tag).config


def resolve_pretrained(pretrained: str | os.PathLike, model_name: str | None = None, *,
                       revision: str | None = None,
                       cache_dir: str | os.PathLike | None = None) -> ResolvedWeights:
    """What a user typed -> a local weights file (downloaded into the Hub cache if it is a
    name and not cached yet). See the module docstring for the accepted forms."""
    text = str(pretrained).strip()
    if text.startswith(HF_HUB_PREFIX):
        spec, rev = _split_revision(text[len(HF_HUB_PREFIX):])
        parts = spec.strip("/").split("/")
        if len(parts) < 2 or not all(parts):
            raise CheckpointError(f"pretrained {text!r}: expected hf-hub:OWNER/REPO[/FILE]"
                                  "[@REVISION]")
        repo, filename = "/".join(parts[:2]), "/".join(parts[2:]) or None
        known = next((p for p in PRETRAINED if p.hf_repo.lower() == repo.lower()), None)
        filename = filename or (known.filename if known else DEFAULT_HUB_FILE)
        rev = revision or rev or (known.revision if known else None)
        path = download_from_hub(repo, filename, revision=rev, cache_dir=cache_dir)
        return ResolvedWeights(path, known.config if known else None, text)
    if Path(text).is_file():
        return ResolvedWeights(Path(text), None, text)
    spec, rev = _split_revision(text)
    if ":" in spec and not _looks_like_path(spec):
        name, tag = spec.split(":", 1)
    elif model_name is not None and not _looks_like_path(spec):
        name, tag = model_name, spec
    elif _looks_like_path(text):
        raise CheckpointError(f"checkpoint {text} does not exist")
    else:
        raise CheckpointError(
            f"pretrained {text!r}: expected a weights file (.pt or .safetensors), NAME:TAG "
            f"({', '.join(f'{m}:{t}' for m, t in list_pretrained())}) or "
            "hf-hub:OWNER/REPO[/FILE]")
    cfg = get_pretrained_cfg(name, tag)
    path = download_from_hub(cfg.hf_repo, cfg.filename, revision=revision or rev or cfg.revision,
                             cache_dir=cache_dir)
    return ResolvedWeights(path, cfg.config, f"{cfg.model_name}:{cfg.tag}")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir() -> str:
    """The Hub cache as ``huggingface_hub`` finds it, read now (not at its import time):
    ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else its default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


HUB_PROBE_TIMEOUT = 5.0  # seconds the one reachability try may take (HF_HUB_ETAG_TIMEOUT if lower)


def _network_failure(exc: BaseException) -> bool:
    """A connection that could not be made (refused, no route, DNS, timeout), whichever
    HTTP library huggingface_hub uses."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return isinstance(exc, (OSError, TimeoutError)) or bool(
        names & {"TransportError", "TimeoutException", "ConnectionError", "OfflineModeIsEnabled"})


def hub_reachable(repo: str, filename: str, revision: str | None = None) -> bool:
    """One try at the file's metadata, with a short timeout and no retry: False when the
    Hub cannot be reached, so a machine without network falls back to the cache at once
    instead of huggingface_hub's retries (about 30 s). Any answer from the Hub (the file,
    or an error of its own such as a missing repository) is True: the download reports it."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

    timeout = min(HUB_PROBE_TIMEOUT, float(constants.HF_HUB_ETAG_TIMEOUT))
    try:
        get_hf_file_metadata(hf_hub_url(repo, filename, revision=revision), timeout=timeout)
    except Exception as exc:  # a network failure, or the Hub's own answer
        return not _network_failure(exc)
    return True


def download_from_hub(repo: str, filename: str, revision: str | None = None,
                      cache_dir: str | os.PathLike | None = None) -> Path:
    """``filename`` of the Hub repository ``repo`` in the local cache (fetched if missing,
    unless ``HF_HUB_OFFLINE`` is set)."""
    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise CheckpointError("weights by name need huggingface_hub: pip install "
                              "huggingface_hub (or pass a local .pt/.safetensors file)") from None
    cache = str(cache_dir) if cache_dir is not None else hub_cache_dir()
    offline = bool(constants.HF_HUB_OFFLINE) or _env_true("HF_HUB_OFFLINE")
    fetch = f"hf download {repo} {filename}" + (f" --revision {revision}" if revision else "")
    where = f"{repo}/{filename}" + (f"@{revision}" if revision else "")
    # an unreachable Hub: the cache alone, then the hint (no retry loop)
    cache_only = offline or not hub_reachable(repo, filename, revision)
    try:
        return Path(hf_hub_download(repo, filename, revision=revision, cache_dir=cache,
                                    local_files_only=cache_only))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise CheckpointError(f"file {filename} of Hub repository {repo}"
                              f"{f' (revision {revision})' if revision else ''} is not in the "
                              f"cache {cache} and {why}; fetch it with: {fetch} (or pass a "
                              "local .pt/.safetensors file)") from None
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as exc:
        raise CheckpointError(f"cannot download {where}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0]}") from None
    except (HfHubHTTPError, OSError) as exc:
        raise CheckpointError(f"cannot download {where}: {type(exc).__name__}: {exc}; fetch "
                              f"it with: {fetch}") from None


def load_weights(pretrained: str | os.PathLike, model_name: str | None = None, *,
                 revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                 map_location: str | torch.device | None = None,
                 merge_lora: bool = True) -> StateDict:
    """The state dict of what a user typed (file, tag or hf-hub name), read safely (a LoRA
    checkpoint merged, unless ``merge_lora`` is False: then it is an error), with the
    model settings a training checkpoint records."""
    weights = resolve_pretrained(pretrained, model_name, revision=revision, cache_dir=cache_dir)
    read = read_checkpoint(weights.path, map_location=map_location, merge_lora=merge_lora,
                           label=weights.label)
    return dataclasses.replace(read, config=weights.config)


def load_config_input_size(model_name: str) -> int:
    """The image size (``input_size``) of ``model_name``'s config."""
    from .config import read_config_json

    return int(read_config_json(model_config(model_name))[0]["input_size"])


__all__ = ["PRETRAINED", "PretrainedCfg", "ResolvedWeights", "list_pretrained", "list_models",
           "model_config", "get_pretrained_cfg", "resolve_pretrained", "download_from_hub",
           "hub_cache_dir", "load_weights", "load_config_input_size"]
