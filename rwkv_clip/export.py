"""``python -m rwkv_clip.export CHECKPOINT OUT.pt|OUT.safetensors``: the plain model state
dict people publish, from a training checkpoint or any weights file we can load.

Keys, order and dtypes are the original's, checked against the config before anything is
written; ``--format onnx|hub`` writes :mod:`rwkv_clip.onnx_export` / :mod:`rwkv_clip.hub`.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .checkpoint_files import save_state_dict
from .errors import CheckpointError, ConfigError, OneLineArgumentParser, run_cli


def export_state_dict(checkpoint: str | os.PathLike, config: str | None = None,
                      merge_lora: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """``(state dict in the model's key order and dtypes, config name or path)`` of
    ``checkpoint`` (a file or a pretrained name); the config is inferred from the
    parameter shapes unless given. A LoRA checkpoint needs ``merge_lora`` (its adapters
    folded into the weights, :func:`rwkv_clip.lora.merge_state_dict`)."""
    from .checkpoint_files import check_state_dict
    from .config import load_model_configs
    from .factory import fitting_config_hint, infer_config
    from .model import create_RWKV_Model
    from .pretrained import load_weights, model_config

    weights = load_weights(checkpoint, merge_lora=merge_lora)
    state = weights.tensors
    if config is not None:
        config = model_config(config)
    else:
        config = weights.config or infer_config(state)
    if config is None:
        raise ConfigError(f"checkpoint {weights.label} matches none of the shipped configs: "
                          "pass --config path/to/config.json")
    with torch.device("meta"):  # names, shapes and dtypes only; no memory, no init cost
        model = create_RWKV_Model(load_model_configs(config))
    check_state_dict(model, state, weights.label, hint=lambda: fitting_config_hint(state))
    expected = model.state_dict()
    return {k: state[k].detach().to(expected[k].dtype).contiguous() for k in expected}, config


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
                        "parameter shapes among the shipped configs)")
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
    state, config = export_state_dict(opts.checkpoint, opts.config, opts.merge_lora)
    count = sum(v.numel() for v in state.values())
    if fmt == "onnx":
        from .onnx_export import export_onnx_folder

        return export_onnx_folder(state, config, out, opts.normalize, opts.verify)
    if fmt == "hub":
        from .hub import export_hub_folder

        return export_hub_folder(state, config, out, opts.checkpoint, opts, records or [])
    sha = save_state_dict(state, out, opts.ddp_prefix)
    print(f"wrote {out}: {count:,} parameters in {len(state)} tensors (config {config}"
          f"{', module. prefix' if opts.ddp_prefix else ''})\nsha256 {sha}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="rwkv_clip.export"))
