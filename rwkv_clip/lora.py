"""LoRA fine-tuning: low-rank adapters (``peft``) on the towers' linear layers.

``train.py --lora-rank R`` adapts the time and channel mixes (:func:`add_adapters`) and
trains only the adapters; :func:`merge_state_dict` folds them back into plain weights
without peft, so evaluation and export read a LoRA checkpoint as an ordinary one.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError, TrainArgsError

# Every linear layer of both mixes, in both towers (their module names in Image_RWKV's
# VRWKV_SpatialMix_V6 / VRWKV_ChannelMix_V6 and Text_RWKV's RWKV_Tmix_V6 / RWKV_CMix_V6).
DEFAULT_TARGETS = ("att.receptance", "att.key", "att.value", "att.gate", "att.output",
                   "ffn.key", "ffn.value", "ffn.receptance")
BASE_PRECISIONS = ("fp32", "bf16")
TOWERS = ("image_model", "text_model")
ADAPTER_NAME = "default"  # peft's; part of the state-dict keys
LORA_MARKERS = (".lora_A.", ".lora_B.", ".base_layer.")
# Frozen modules whose weights --lora-base-precision bf16 stores in bf16: the matrices.
# Norms, the time-mix vectors and their small internal projections, the position
# embedding and logit_scale stay fp32 (under 5% of B/32's parameters).
_MATRIX_MODULES = (nn.Linear, nn.Embedding, nn.Conv2d)


@dataclass(frozen=True)
class LoraSettings:
    """What ``--lora-*`` asked for; ``scaling`` multiplies ``B A`` (peft's alpha / r)."""
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    base_precision: str = "fp32"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_args(cls, args: Any) -> LoraSettings | None:
        """The settings of a ``train.py`` namespace or a checkpoint's saved ``args``
        dict; None when ``lora_rank`` is unset or 0. Raises :class:`TrainArgsError`
        naming the flag for a bad value."""
        get = args.get if isinstance(args, Mapping) else lambda k, d=None: getattr(args, k, d)
        rank = get("lora_rank")
        if not rank:
            return None
        if int(rank) < 1:
            raise TrainArgsError(f"--lora-rank must be >= 1 (0: no LoRA), got {rank}")
        alpha = get("lora_alpha")
        alpha = 2.0 * int(rank) if alpha is None else float(alpha)
        dropout = float(get("lora_dropout") or 0.0)
        targets = parse_targets(get("lora_targets"))
        base = get("lora_base_precision") or "fp32"
        if alpha <= 0:
            raise TrainArgsError(f"--lora-alpha must be > 0, got {alpha:g}")
        if not 0.0 <= dropout < 1.0:
            raise TrainArgsError(f"--lora-dropout must be in [0, 1), got {dropout:g}")
        if base not in BASE_PRECISIONS:
            raise TrainArgsError(f"--lora-base-precision must be one of {BASE_PRECISIONS}, "
                                 f"got {base!r}")
        return cls(int(rank), alpha, dropout, targets, base)

    def describe(self) -> str:
        return (f"LoRA r={self.rank} alpha={self.alpha:g} (scaling {self.scaling:g}), "
                f"dropout {self.dropout:g}, base weights {self.base_precision}, targets "
                + ",".join(self.targets))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "targets": list(self.targets)}


def parse_targets(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return DEFAULT_TARGETS
    items = value.split(",") if isinstance(value, str) else list(value)
    targets = tuple(t.strip().strip(".") for t in items if t.strip())
    if not targets:
        raise TrainArgsError("--lora-targets is empty: name linear layers such as "
                             + ",".join(DEFAULT_TARGETS))
    return targets


# ----------------------------------------------------------------------------- train.py flags

def add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA fine-tuning (low-rank adapters, peft)")
    g.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help="train rank-R adapters on the linear layers of --lora-targets "
                        "instead of the weights, which stay frozen (0: off). Start from "
                        "--pretrained weights; a locked tower gets no adapters")
    g.add_argument("--lora-alpha", type=float, default=None,
                   help="adapter scale numerator: the update is (alpha / R) B A "
                        "(default: 2 x R)")
    g.add_argument("--lora-dropout", type=float, default=0.0,
                   help="dropout on the adapters' input")
    g.add_argument("--lora-targets", default=",".join(DEFAULT_TARGETS), metavar="NAMES",
                   help="comma-separated module names (suffixes of the qualified names, "
                        "e.g. att.key or image_model.layers.0.ffn.value) of the linear "
                        "layers to adapt; default: every time-mix and channel-mix linear")
    g.add_argument("--lora-base-precision", choices=BASE_PRECISIONS, default="fp32",
                   help="storage of the frozen base matrices (linear, embedding, patch "
                        "convolution weights); bf16 halves their memory and needs "
                        "--precision bf16 or fp16")


def check_lora_args(args: argparse.Namespace) -> LoraSettings | None:
    """Validate the ``--lora-*`` flags against the rest (after the precision is known)."""
    settings = LoraSettings.from_args(args)
    if settings is None:
        return None
    if settings.base_precision == "bf16" and args.precision not in ("bf16", "fp16"):
        raise TrainArgsError(f"--lora-base-precision bf16 needs an autocast --precision "
                             f"(bf16 or fp16) to compute with the bf16 weights, got "
                             f"{args.precision}")
    require_peft()
    return settings


def require_peft():
    try:
        import peft
    except ImportError:
        raise TrainArgsError("--lora-rank needs the peft package: pip install "
                             "'rwkv-clip[lora]' (or pip install peft)") from None
    return peft


# ----------------------------------------------------------------------------- the model

def target_names(model: nn.Module, targets: tuple[str, ...],
                 towers: tuple[str, ...] = TOWERS) -> list[str]:
    """Qualified names of the linear layers in ``towers`` that end with a target."""
    linears = [name for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.startswith(tuple(t + "." for t in towers))]
    chosen: list[str] = []
    for target in targets:
        hits = [n for n in linears if n == target or n.endswith("." + target)]
        if not hits:
            kinds = sorted({".".join(n.split(".")[-2:]) for n in linears})
            raise TrainArgsError(f"--lora-targets: {target!r} names no linear layer of "
                                 f"{'/'.join(towers)}; expected one of {', '.join(kinds)} "
                                 "(or a longer suffix of a qualified name)")
        chosen += [n for n in hits if n not in chosen]
    return chosen


def add_adapters(model: nn.Module, settings: LoraSettings,
                 towers: tuple[str, ...] = TOWERS) -> list[str]:
    """Inject peft LoRA layers (fp32) into ``model`` in place and freeze every other
    parameter; with ``base_precision`` bf16 the frozen matrices are stored in bf16.
    Returns the adapted layers' names. The adapters' random init draws from torch's
    global generator (seed it for the same adapters on every rank)."""
    peft = require_peft()
    names = target_names(model, settings.targets, towers)
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                             lora_dropout=settings.dropout, target_modules=names, bias="none")
    model.requires_grad_(False)
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    from peft.tuners.lora import LoraLayer
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            # under autocast the input already has the autocast dtype: no fp32 round trip
            module.cast_input_dtype_enabled = False
        elif (settings.base_precision == "bf16" and isinstance(module, _MATRIX_MODULES)
              and ".lora_" not in name):
            module.to(torch.bfloat16)
    for name, param in model.named_parameters():
        is_adapter = ".lora_A." in name or ".lora_B." in name
        param.requires_grad_(is_adapter)
        if is_adapter:
            param.data = param.data.float()
    return names


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


# ----------------------------------------------------------------------------- checkpoints

def has_adapters(state_dict: Mapping[str, Any]) -> bool:
    return any(marker in key for key in state_dict for marker in LORA_MARKERS)


def merge_state_dict(state_dict: Mapping[str, torch.Tensor], settings: LoraSettings,
                     source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """A LoRA state dict as plain weights: ``W = W_base + scaling * B @ A`` (in fp32,
    then the base weight's stored dtype is dropped: the model's loader casts), every
    ``.base_layer.`` name back to the module's own, the adapter tensors removed."""
    suffix_a = f".lora_A.{ADAPTER_NAME}.weight"
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if ".lora_A." in key or ".lora_B." in key:
            if not key.endswith(f".{ADAPTER_NAME}.weight"):
                raise CheckpointError(f"{source}: unexpected adapter tensor {key}")
            continue
        out[key.replace(".base_layer.", ".")] = value
    for key_a, a in state_dict.items():
        if not key_a.endswith(suffix_a):
            continue
        prefix = key_a[:-len(suffix_a)]
        key_b = f"{prefix}.lora_B.{ADAPTER_NAME}.weight"
        weight_key = prefix + ".weight"
        if key_b not in state_dict or weight_key not in out:
            raise CheckpointError(f"{source}: adapter {prefix} is incomplete (needs "
                                  f"{key_b} and {prefix}.base_layer.weight)")
        b, w = state_dict[key_b], out[weight_key]
        if a.shape[0] != settings.rank or b.shape != (w.shape[0], a.shape[0]) \
                or a.shape[1] != w.shape[1]:
            raise CheckpointError(f"{source}: adapter {prefix} has shapes A {tuple(a.shape)}, "
                                  f"B {tuple(b.shape)} for a weight {tuple(w.shape)} and rank "
                                  f"{settings.rank}")
        out[weight_key] = w.float() + settings.scaling * (b.float() @ a.float())
    return out


def settings_from_args(saved: Mapping[str, Any] | None, source: str) -> LoraSettings:
    """The LoRA settings of a training checkpoint's saved ``args``
    (:func:`rwkv_clip.checkpoint_files.saved_run_args`)."""
    settings = None
    if isinstance(saved, Mapping):
        try:
            settings = LoraSettings.from_args(saved)
        except TrainArgsError as exc:
            raise CheckpointError(f"{source}: bad LoRA settings ({exc})") from None
    if settings is None:
        raise CheckpointError(f"{source} holds LoRA adapter weights but not their settings "
                              "(lora_rank, lora_alpha): expected a training checkpoint of "
                              "train.py --lora-rank")
    return settings
