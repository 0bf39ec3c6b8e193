"""``python -m rwkv_clip.export CHECKPOINT OUT.pt|OUT.safetensors [--ddp-prefix]``: the plain
model state dict people publish, from one of our training checkpoints (which also hold
optimizer and schedule state, about 3x the size) or any weights file we can load; a LoRA
checkpoint with ``--merge-lora`` (its adapters merged into the weights).

The keys are the original's names (``--ddp-prefix``: with the ``module.`` prefix its
loader expects, as its ``torch.save(ddp_model.state_dict())`` wrote them), in the model's
order and dtypes (the text blocks' ``time_decay``/``time_faaaa`` in bfloat16, everything
else float32), checked against the model config before anything is written. Prints the
parameter count and the sha256 of the written file.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from .errors import CheckpointError, ConfigError, run_cli

DDP_PREFIX = "module."


def export_state_dict(checkpoint: str | os.PathLike, config: str | None = None,
                      merge_lora: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """``(state dict in the model's key order and dtypes, config name or path)`` of
    ``checkpoint`` (a file or a pretrained name); the config is inferred from the
    parameter shapes unless given. A LoRA checkpoint needs ``merge_lora`` (its adapters
    folded into the weights, :func:`rwkv_clip.lora.merge_state_dict`)."""
    from .config import load_model_configs
    from .model import check_state_dict, create_RWKV_Model, read_state_dict
    from .pretrained import infer_config, model_config, resolve_pretrained

    weights = resolve_pretrained(checkpoint)
    state = read_state_dict(weights.path, merge_lora=merge_lora)
    if config is not None:
        config = model_config(config)
    else:
        config = weights.config or infer_config(state)
    if config is None:
        raise ConfigError(f"checkpoint {weights.label} matches none of the shipped configs: "
                          "pass --config path/to/config.json")
    with torch.device("meta"):  # names, shapes and dtypes only; no memory, no init cost
        model = create_RWKV_Model(load_model_configs(config))
    check_state_dict(model, state, weights.label)
    expected = model.state_dict()
    return {k: state[k].detach().to(expected[k].dtype).contiguous() for k in expected}, config


def save_state_dict(state: dict[str, torch.Tensor], out: str | os.PathLike,
                    ddp_prefix: bool = False) -> str:
    """Write ``state`` to ``out`` (``.safetensors`` or a ``torch.save`` file); returns
    the file's sha256."""
    out = Path(out)
    if ddp_prefix:
        state = {DDP_PREFIX + k: v for k, v in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if out.suffix.lower() == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CheckpointError("writing .safetensors needs the safetensors package "
                                  "(pip install safetensors)") from None
        # safetensors refuses tensors that share storage: give each its own
        save_file({k: v.clone() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(state, tmp)
    os.replace(tmp, out)
    return file_sha256(out)


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rwkv_clip.export",
        description="Write the model's plain state dict (the original's key names and "
                    "dtypes) from a training checkpoint or any loadable weights file.")
    p.add_argument("checkpoint", help="our training checkpoint (epoch_N.pt), a state dict "
                                      "(.pt/.safetensors) or a pretrained name (NAME:TAG, "
                                      "hf-hub:OWNER/REPO[/FILE])")
    p.add_argument("out", help="output file: OUT.pt (torch.save) or OUT.safetensors")
    p.add_argument("--ddp-prefix", action="store_true",
                   help="prefix every key with 'module.', as the original's "
                        "torch.save(ddp_model.state_dict()) (what its loader expects)")
    p.add_argument("--merge-lora", action="store_true",
                   help="a LoRA training checkpoint (train.py --lora-rank): write the "
                        "weights with its adapters merged in (W + alpha/r B A)")
    p.add_argument("--config", default=None, metavar="JSON|NAME",
                   help="model config the weights must fit (default: inferred from the "
                        "parameter shapes among the shipped configs)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    out = Path(opts.out)
    if out.suffix.lower() not in (".pt", ".pth", ".safetensors"):
        raise CheckpointError(f"output {out}: expected a .pt or .safetensors file name")
    state, config = export_state_dict(opts.checkpoint, opts.config, opts.merge_lora)
    sha = save_state_dict(state, out, opts.ddp_prefix)
    count = sum(v.numel() for v in state.values())
    print(f"wrote {out}: {count:,} parameters in {len(state)} tensors (config {config}"
          f"{', module. prefix' if opts.ddp_prefix else ''})\nsha256 {sha}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="rwkv_clip.export"))
