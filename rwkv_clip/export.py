"""``python -m rwkv_clip.export CHECKPOINT OUT.pt|OUT.safetensors``: the plain model state
dict people publish, from a training checkpoint or any weights file we can load.

Keys, order and dtypes are the original's, checked against the config before anything is
written; ``--format onnx|hub`` writes :mod:`rwkv_clip.onnx_export` / :mod:`rwkv_clip.hub`.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint_files import save_state_dict
from .config import INPUT_SIZE_FLAGS, MODEL_KEYS, ModelArgs, differing_keys, read_config_json
from .errors import CheckpointError, OneLineArgumentParser, run_cli


@dataclass(frozen=True)
class ExportedWeights:
    """What is exported: the state dict (the model's key order and dtypes), the model
    settings it is exported at, the config they were chosen from (name or path) and the
    training arguments a training checkpoint holds."""

    state: dict[str, torch.Tensor]
    args: ModelArgs
    config: str
    run_args: dict[str, Any] | None = None


def export_state_dict(checkpoint: str | os.PathLike, config: str | None = None,
                      merge_lora: bool = False, overrides: Mapping[str, Any] | None = None,
                      log: Callable[[str], None] | None = None) -> ExportedWeights:
    """The weights of ``checkpoint`` (a file or a pretrained name) and their settings: the
    config ``config``, else the one inferred from the parameter shapes, with a training
    checkpoint's saved model settings and then ``overrides`` on top
    (:func:`rwkv_clip.factory.choose_model_args`, which says through ``log`` where they
    differ). A LoRA checkpoint needs ``merge_lora`` (its adapters folded into the
    weights, :func:`rwkv_clip.lora.merge_state_dict`)."""
    from .checkpoint_files import check_state_dict, fit_image_size
    from .factory import choose_model_args, fitting_config_hint
    from .model import create_RWKV_Model
    from .pretrained import load_weights, model_config

    weights = load_weights(checkpoint, merge_lora=merge_lora)
    args, name = choose_model_args(model_config(config) if config is not None else None,
                                   weights, overrides, log)
    with torch.device("meta"):  # names, shapes and dtypes only; no memory, no init cost
        model = create_RWKV_Model(args)
    state = fit_image_size(model, weights.tensors)
    check_state_dict(model, state, weights.label,
                     hint=lambda: fitting_config_hint(weights.tensors))
    expected = model.state_dict()
    state = {k: state[k].detach().to(expected[k].dtype).contiguous() for k in expected}
    return ExportedWeights(state, args, model_config(config) if config is not None else name,
                           weights.run_args)


FORMATS = ("pt", "safetensors", "onnx", "hub")


def build_export_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="python -m rwkv_clip.export",
        description="Write the model's plain state dict (the original's key names and "
                    "dtypes) from a training checkpoint or any loadable weights file, or "
                    "its encoders as ONNX, or a Hugging Face Hub folder with a model card.")
    p.add_argument("checkpoint", help="our training checkpoint (epoch_N.pt), a state dict "
                                      "(.pt/.safetensors) or a pretrained name (NAME:TAG, "
                                      "hf-hub:OWNER/REPO[/FILE])")
    p.add_argument("out", nargs="?", default=None,
                   help="output file: OUT.pt (torch.save) or OUT.safetensors")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="pt / safetensors: one state-dict file (default: from OUT's suffix); "
                        "onnx: image_encoder.onnx + text_encoder.onnx + configs in --output; "
                        "hub: model.safetensors + configs + model card README.md in --output")
    p.add_argument("--output", default=None, metavar="DIR|FILE",
                   help="output folder (onnx, hub) or file (pt, safetensors; same as OUT)")
    p.add_argument("--ddp-prefix", action="store_true",
                   help="prefix every key with 'module.', as the original's "
                        "torch.save(ddp_model.state_dict()) (what its loader expects)")
    p.add_argument("--merge-lora", action="store_true",
                   help="a LoRA training checkpoint (train.py --lora-rank): write the "
                        "weights with its adapters merged in (W + alpha/r B A)")
    p.add_argument("--config", default=None, metavar="JSON|NAME",
                   help="model config the weights must fit (default: inferred from the "
                        "parameter shapes among the shipped configs); a training "
                        "checkpoint's saved model settings (context length, image size, "
                        "...) override its keys")
    p.add_argument("--ctx-len", type=int, default=None, metavar="TOKENS",
                   help="context length to export at (the ONNX text encoder's input "
                        "length, the folder's config; default: the checkpoint's, else the "
                        "config's)")
    p.add_argument(*INPUT_SIZE_FLAGS, dest="input_size", type=int, default=None,
                   metavar="PX", help="image size to export at (the position embedding "
                                      "is resized; default: the checkpoint's, else the "
                                      "config's)")
    g = p.add_argument_group("onnx")
    g.add_argument("--normalize", action="store_true",
                   help="the encoders output L2-normalised features (default: raw, as "
                        "encode_image / encode_text)")
    g.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip running the exported encoders with onnxruntime against PyTorch "
                        "at batch 1 and 7")
    g = p.add_argument_group("hub")
    g.add_argument("--eval-json", action="append", default=None, metavar="JSON|DIR",
                   help="zero_shot.py result record(s) for the model card's figures "
                        "(repeatable; default: *_zeroshot_*.json beside the checkpoint, in "
                        "its run folder or in the run's eval_results/)")
    g.add_argument("--name", default=None, help="model name in the card (default: the "
                                                "output folder's name)")
    g.add_argument("--repo-id", default=None, metavar="ORG/NAME",
                   help="Hub repository the folder is meant for (the card's loading snippet)")
    g.add_argument("--license", default="mit", help="license in the card (default: mit, the "
                                                    "original's)")
    g.add_argument("--dataset", dest="datasets", action="append", default=None,
                   metavar="NAME", help="training dataset for the card's metadata (repeatable)")
    return p


def output_format(opts: argparse.Namespace) -> tuple[str, Path]:
    """(format, output path) from --format, --output and OUT."""
    if opts.out and opts.output and opts.out != opts.output:
        raise CheckpointError(f"output given twice ({opts.out} and --output {opts.output}): "
                              "give one")
    target = opts.output or opts.out
    if target is None:
        raise CheckpointError("no output: give OUT.pt / OUT.safetensors, or --format onnx|hub "
                              "--output DIR")
    out = Path(target)
    fmt = opts.format
    if fmt is None:
        suffix = out.suffix.lower()
        if suffix not in (".pt", ".pth", ".safetensors"):
            raise CheckpointError(f"output {out}: expected a .pt or .safetensors file name, or "
                                  "--format onnx|hub for a folder")
        fmt = "safetensors" if suffix == ".safetensors" else "pt"
    elif fmt in ("pt", "safetensors"):
        expected = (".safetensors",) if fmt == "safetensors" else (".pt", ".pth")
        if out.suffix.lower() not in expected:
            raise CheckpointError(f"output {out}: --format {fmt} writes a {expected[0]} file")
    elif out.suffix.lower() in (".pt", ".pth", ".safetensors", ".onnx") or out.is_file():
        raise CheckpointError(f"--format {fmt} writes a folder: --output {out} looks like a file")
    return fmt, out


def main(argv: Sequence[str] | None = None) -> int:
    opts = build_export_parser().parse_args(argv)
    fmt, out = output_format(opts)
    records = None
    if fmt == "onnx":  # a missing exporter package fails before any work
        from .onnx_export import require_exporter

        require_exporter()
    if fmt == "hub":  # read the figures first: a bad results file fails before any work
        from .hub import card_records

        records = card_records(opts.checkpoint, opts.eval_json)
    overrides = {k: getattr(opts, k) for k in ("ctx_len", "input_size")
                 if getattr(opts, k) is not None}
    exported = export_state_dict(opts.checkpoint, opts.config, opts.merge_lora, overrides,
                                 log=lambda msg: print(msg, flush=True))
    state, config, args = exported.state, exported.config, exported.args
    count = sum(v.numel() for v in state.values())
    if fmt == "onnx":
        from .onnx_export import export_onnx_folder

        return export_onnx_folder(state, args, config, out, opts.normalize, opts.verify)
    if fmt == "hub":
        from .hub import export_hub_folder

        return export_hub_folder(exported, out, opts, records or [])
    # a .safetensors records the settings in its header; a .pt is the bare state dict
    changed = changed_settings(args, config)
    sha = save_state_dict(state, out, opts.ddp_prefix,
                          settings={k: getattr(args, k) for k in MODEL_KEYS})
    print(f"wrote {out}: {count:,} parameters in {len(state)} tensors (config {config}"
          f", context {args.ctx_len} tokens, images {args.input_size} px"
          f"{', module. prefix' if opts.ddp_prefix else ''})\nsha256 {sha}", flush=True)
    if changed and fmt == "pt":
        flags = " ".join(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in changed)
        print(f"{out} holds the weights only: load it with {flags} (or a config with "
              f"those keys), as {config} has other values", flush=True)
    return 0


def changed_settings(args: ModelArgs, config: str) -> list[str]:
    """The model keys where ``args`` differs from the config ``config``."""
    params = read_config_json(config)[0]
    return differing_keys(args, ModelArgs.from_dict(params, source=f"model config {config}"))


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="rwkv_clip.export"))
