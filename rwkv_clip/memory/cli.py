"""``python -m rwkv_clip.memory``: the planner's command line (docs/training.md).

The flags mean what train.py's do (``--batch-size`` per GPU, ``--gradient-acc K``
micro-batches per step), so a training command's values can be copied. User errors are
one line ``error: ...`` and exit status 2 (:func:`rwkv_clip.errors.run_cli`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from ..config import INPUT_SIZE_FLAGS, TOWER_KEYS, str2bool
from ..errors import OneLineArgumentParser, TrainArgsError, run_cli
from ..lora import BASE_PRECISIONS, DEFAULT_TARGETS, parse_targets
from ..precision import canonical_precision
from .estimate import (
    CARD_RESERVE_GIB,
    CARD_USABLE_FRACTION,
    CARDS,
    GiB,
    MiB,
    card_capacity,
    estimate,
    max_batch,
)
from .finetune import FineTune
from .walk import parameter_table

COMPARED_RANK = 16  # the LoRA rank of the comparison table without --lora-rank

PROG = "python -m rwkv_clip.memory"
# train.py's tower flags other than --input-size (above), each overriding its config key
_BOOL_KEYS = ("image_output_cls_token", "image_with_cls_token", "text_initialization")
CONFIG_KEYS = tuple(key for key in TOWER_KEYS if key != "input_size")


class _Parser(OneLineArgumentParser):
    """argparse whose usage errors are the package's error (one line through run_cli)."""

    def error(self, message: str) -> NoReturn:
        raise TrainArgsError(self.one_line(message))


def build_planner_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="Memory planner: what a training step or inference "
                                        "of RWKV-CLIP needs, per GPU. The flags mean what "
                                        "train.py's do, so a training command's values can "
                                        "be copied here.")
    ap.add_argument("--config", default=None, help="model config JSON (default: B/32)")
    ap.add_argument(*INPUT_SIZE_FLAGS, dest="input_size",
                    type=int, default=None, metavar="PIXELS",
                    help="image side in pixels (train.py's --input-size; default: the "
                         "config's): the image tower sees (side / patch)^2 tokens")
    ap.add_argument("--batch-size", type=int, default=256,
                    help="micro-batch per GPU, one forward/backward (train.py's --batch-size)")
    ap.add_argument("--precision", default="bf16", help="fp32, tf32, bf16 or fp16")
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    ap.add_argument("--gradient-acc", type=int, default=1, metavar="K",
                    help="micro-batches per optimizer step (train.py's --gradient-acc): the "
                         "gradients stay alive across them and the loss scores all K x "
                         "batch-size pairs per GPU")
    ap.add_argument("--gpus", type=int, default=1, help="data-parallel world size")
    ap.add_argument("--local-loss", action="store_true", help="ClipLoss local_loss logits")
    ap.add_argument("--inference-batch", type=int, default=None,
                    help="batch for the inference figures (default: --batch-size)")
    ap.add_argument("--mode", choices=["train", "inference"], default="train",
                    help="what --measure runs")
    ap.add_argument("--measure", action="store_true", help="also run one real step and measure")
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"],
                    help="device for --measure and the estimate's autocast rules")
    ap.add_argument("--wkv-backend", default=None, help="force a WKV backend for --measure")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    g = ap.add_argument_group("fine-tuning (train.py's flags; default: every parameter trains)")
    g.add_argument("--lock-image", action="store_true", help="the image tower frozen")
    g.add_argument("--lock-text", action="store_true", help="the text tower frozen")
    g.add_argument("--lora-rank", type=int, default=0, metavar="R",
                   help="LoRA adapters of rank R, every other weight frozen (0: off)")
    g.add_argument("--lora-targets", default=",".join(DEFAULT_TARGETS), metavar="NAMES",
                   help="the adapted linear layers, as train.py's --lora-targets")
    g.add_argument("--lora-base-precision", choices=BASE_PRECISIONS, default="fp32",
                   help="storage of the frozen base matrices")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters")
    g = ap.add_argument_group("model config (train.py's tower flags; default: the config's)")
    for key in CONFIG_KEYS:
        typ = str2bool if key in _BOOL_KEYS else float if key == "drop_path_rate" else int
        g.add_argument("--" + key.replace("_", "-"), dest=key, type=typ, default=None,
                       metavar="BOOL" if typ is str2bool else "N",
                       help="text tokens per caption (train.py's --ctx-len)"
                       if key == "ctx_len" else argparse.SUPPRESS)
    return ap


def config_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    """The config keys given on the command line (--ctx-len 248 -> {"ctx_len": 248})."""
    keys = ("input_size", *CONFIG_KEYS)
    return {k: getattr(ns, k) for k in keys if getattr(ns, k, None) is not None}


def finetune_of(ns: argparse.Namespace) -> FineTune | None:
    """The fine-tuning mode the flags ask for (None: full training)."""
    ft = FineTune(ns.lock_image, ns.lock_text, ns.lora_rank, parse_targets(ns.lora_targets),
                  ns.lora_base_precision, ns.lora_dropout)
    return None if ft.label == "full" else ft


def comparison_modes(ns: argparse.Namespace) -> list[FineTune]:
    """Full, each tower locked, LoRA (rank --lora-rank, else 16) on an fp32 and a bf16 base."""
    rank = ns.lora_rank or COMPARED_RANK
    targets = parse_targets(ns.lora_targets)
    return [FineTune(), FineTune(lock_image=True), FineTune(lock_text=True),
            FineTune(lora_rank=rank, lora_targets=targets),
            FineTune(lora_rank=rank, lora_targets=targets, lora_base_precision="bf16")]


def _check(ns: argparse.Namespace) -> None:
    for flag, value in (("--batch-size", ns.batch_size), ("--gradient-acc", ns.gradient_acc),
                        ("--input-size", ns.input_size),
                        ("--gpus", ns.gpus), ("--inference-batch", ns.inference_batch)):
        if value is not None and value < 1:
            raise TrainArgsError(f"{flag} must be >= 1, got {value}")
    if ns.lora_rank < 0:
        raise TrainArgsError(f"--lora-rank must be >= 0 (0: off), got {ns.lora_rank}")
    if ns.lock_image and ns.lock_text:
        raise TrainArgsError("--lock-image and --lock-text together leave only logit_scale "
                             "to train; unlock one tower")
    if ns.measure and (ns.gradient_acc != 1 or ns.gpus != 1):
        raise TrainArgsError("--measure runs one single-process step: it needs "
                             "--gradient-acc 1 and --gpus 1")


def _fmt(b: int) -> str:
    return f"{b / GiB:8.3f} GiB" if b >= GiB else f"{b / MiB:8.1f} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_planner_parser().parse_args(argv)
    _check(ns)
    precision = canonical_precision(ns.precision)
    from ..config import ModelArgs, load_model_configs, resolve_config_path
    config = str(resolve_config_path(ns.config or "RWKV_CLIP_B32"))
    args = load_model_configs(config)
    overrides = config_overrides(ns)
    if overrides:  # validated as train.py's (a bad value names its key)
        args = ModelArgs.from_dict(dataclasses.asdict(args) | overrides, source="the flags")
    if ns.measure:
        from ..distributed import pick_device
        device = pick_device(ns.device or "auto").type
    else:
        # the autocast rules of a GPU (what the planner is for) unless told otherwise
        device = ns.device or "cuda"
    inf_batch = ns.inference_batch if ns.inference_batch is not None else ns.batch_size
    ft = finetune_of(ns)
    # the estimate's batch is what one GPU sees per optimizer step (K micro-batches)
    est = estimate(args, ns.batch_size * ns.gradient_acc, precision, ns.checkpointing,
                   ns.gradient_acc, ns.gpus, device, Path(config).name, inf_batch, finetune=ft)
    by_mode = {m.label: max_batch_per_card(args, precision, ns.checkpointing, ns.gradient_acc,
                                           ns.gpus, m)
               for m in comparison_modes(ns)}
    out: dict[str, Any] = {"estimate": asdict(est), "finetune": ft.label if ft else "full",
                           "max_batch_by_mode": by_mode}
    if ns.measure:
        from .measure import measure
        m = measure(config, ns.batch_size if ns.mode == "train" else inf_batch, precision,
                    ns.checkpointing, device, ns.mode, ns.wkv_backend, finetune=ft,
                    input_size=ns.input_size)
        est_b = est.training_peak_bytes if ns.mode == "train" else est.inference_peak_bytes
        m["estimated_peak_bytes"] = est_b
        m["mode"] = ns.mode
        m["ratio_estimate_to_measured"] = est_b / max(1, m["measured_peak_bytes"])
        out["measured"] = m
    if ns.json:
        print(json.dumps(out))
        return 0
    _print_report(est, device, out.get("measured"), out["finetune"])
    _print_modes(by_mode, precision, ns.checkpointing)
    return 0


def max_batch_per_card(args: Any, precision: str, checkpointing: bool, gradient_acc: int,
                       gpus: int, ft: FineTune) -> dict[str, int]:
    table = parameter_table(args, ft)
    return {card: max_batch(args, card_capacity(gib), precision, checkpointing, gradient_acc,
                            gpus, "cuda", params=table) for card, gib in CARDS.items()}


def _print_modes(by_mode: dict[str, dict[str, int]], precision: str,
                 checkpointing: bool) -> None:
    labels = list(by_mode)
    print(f"largest per-GPU training batch by way of fine-tuning ({precision}, checkpointing "
          f"{'on' if checkpointing else 'off'}):")
    width = max(len(label) for label in labels) + 2
    print(f"  {'':<12}" + "".join(f"{label:>{width}}" for label in labels))
    for card in next(iter(by_mode.values())):
        print(f"  {card:<12}" + "".join(f"{by_mode[label][card]:>{width}}" for label in labels))


def _print_report(e: Any, device: str, m: dict | None, finetune: str = "full") -> None:
    print(f"{e.config}: --batch-size {e.micro_batch} (micro-batch per GPU) x --gradient-acc "
          f"{e.gradient_acc} x {e.gpus} GPU(s) = {e.batch_size * e.gpus} pairs per optimizer "
          f"step, {e.precision}, checkpointing {'on' if e.checkpointing else 'off'}, "
          f"autocast rules of {device}, {finetune} fine-tune")
    print(f"  parameters        {e.parameters:,}")
    print("training (steady state):")
    for label, b in (("parameters", e.parameter_bytes), ("gradients", e.gradient_bytes),
                     ("optimizer (AdamW)", e.optimizer_bytes), ("DDP buckets", e.ddp_bucket_bytes),
                     ("inputs", e.input_bytes), ("activations", e.activation_bytes),
                     ("workspace", e.workspace_bytes)):
        print(f"  {label:<18}{_fmt(b)}")
    print(f"  {'total (peak)':<18}{_fmt(e.training_peak_bytes)}   at {e.training_peak_phase}")
    print(f"inference (batch {e.inference_batch}, no grad):")
    print(f"  {'parameters':<18}{_fmt(e.parameter_bytes)}")
    print(f"  {'activations':<18}{_fmt(e.inference_activation_bytes)}")
    print(f"  {'total (peak)':<18}{_fmt(e.inference_peak_bytes)}")
    print("largest --batch-size that fits (micro-batch per GPU; same precision, "
          "checkpointing, --gradient-acc and --gpus):")
    for card, b in e.max_batch.items():
        print(f"  {card:<12}{b // max(1, e.gradient_acc):>8}")
    print(f"  (card memory x {CARD_USABLE_FRACTION} - {CARD_RESERVE_GIB} GiB for the CUDA "
          "context and fragmentation)")
    if m is not None:
        print(f"measured ({m['mode']}, {device}, {m['method']}): {_fmt(m['measured_peak_bytes'])}"
              f"  estimate {_fmt(m['estimated_peak_bytes'])}  "
              f"estimate/measured {m['ratio_estimate_to_measured']:.3f}")


def run(argv: Sequence[str] | None = None) -> int:
    """:func:`main` with user errors as one line and exit status 2."""
    return run_cli(lambda: main(argv), prog=PROG)
