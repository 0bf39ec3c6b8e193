"""Command line of ``train.py``: every flag of the original, plus the new ones.

Model (tower) settings are resolved in this order, later winning:

1. a base: the ``--config`` JSON if given; otherwise, if any tower flag is given (as
   the original launch scripts do), the original ``train.py`` argparse defaults;
   otherwise the shipped ``RWKV_CLIP_small`` config (the CPU-friendly default);
2. the tower flags given explicitly on the command line.

``--precision``, ``--dropout``, ``--workers`` and ``--open-checkpoint`` also fall back
to the config's ``precision``, ``dropout``, ``workers`` and ``with_cp`` when not given.
The resolved model fields are stored flat on the namespace (as the original's ``args``)
and collected in ``args.model_config``.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from ..config import ConfigError, ModelArgs, complete_args, parse_bool, read_config_json
from ..errors import TrainArgsError

DEFAULT_CONFIG = "RWKV_CLIP_small"

# The original train.py argparse defaults of the tower flags (base when tower flags
# are given without --config, so the original launch scripts mean what they meant).
ORIGINAL_TOWER_DEFAULTS: dict[str, Any] = {
    "input_size": 224, "image_depth": 12, "image_embed_dims": 384, "image_patch_size": 16,
    "image_hidden_rate": 4, "image_num_heads": 8, "image_output_cls_token": False,
    "image_with_cls_token": False, "drop_path_rate": 0.0, "ctx_len": 77, "vocab_size": 49408,
    "text_initialization": True, "head_size": 8, "text_num_head": 0, "pos_emb": 0,
    "head_size_divisor": 8, "n_layer": 12, "n_embd": 384, "dim_att": 0, "dim_ffn": 0,
    "head_qk": 0, "tiny_att_dim": 0, "tiny_att_layer": -999,
}
TOWER_KEYS = tuple(ORIGINAL_TOWER_DEFAULTS)
# Settings that live in config JSONs but are training options with their own flag.
SHARED_KEYS = {"precision": "bf16", "dropout": 0.0, "workers": 10}

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
DATA_FORMATS = ("rec", "wds", "builtin")


def str2bool(value: Any) -> bool:
    """argparse type for booleans: True/False, 1/0 (also yes/no), as the original's scripts."""
    parsed = parse_bool(value)
    if parsed is None:
        raise argparse.ArgumentTypeError(f"expected a boolean (True/False/1/0), got {value!r}")
    return parsed


def _bool_flag(group, name: str, default, help: str) -> None:
    group.add_argument(name, type=str2bool, nargs="?", const=True, default=default,
                       metavar="BOOL", help=help)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train RWKV-CLIP. With no arguments: the small config on the built-in "
                    "dataset on the available device, then zero-shot accuracy on its "
                    "held-out split. Launch multi-process with torchrun "
                    "(NCCL on GPU, gloo on CPU).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    g = p.add_argument_group("optimisation (original flags)")
    g.add_argument("--batch-size", type=int, default=64,
                   help="micro-batch size per process (one forward/backward)")
    g.add_argument("--beta1", type=float, default=0.9,
                   help="AdamW beta1 (SGD momentum); the cosine schedule cycles it "
                        "0.95 -> 0.85 -> 0.95 as the original's OneCycleLR does")
    g.add_argument("--beta2", type=float, default=0.98, help="AdamW beta2")
    g.add_argument("--epochs", type=int, default=4, help="passes over the training data")
    g.add_argument("--gradient-acc", type=int, default=1, metavar="K",
                   help="micro-batches per optimizer step (global batch = batch-size x K x "
                        "world size); see --accum-mode")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--lr-scheduler", choices=("cosine", "linear"), default="cosine",
                   help="cosine: OneCycleLR (warmup fraction --warmup, cycles beta1), as the "
                        "original; linear: LinearLR from lr to 0, no warmup (as the original)")
    g.add_argument("--warmup", type=float, default=0.1,
                   help="warmup fraction of all optimizer steps (cosine schedule)")
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="adamw (what the original always used) or sgd with momentum beta1")
    g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
    g.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="bf16: bf16 autocast; fp16: fp16 autocast + GradScaler (init 128, "
                        "growth interval 200); fp32: no autocast; tf32: fp32 with TF32 "
                        "matmuls. Default: the config's precision (small: fp32)")
    g.add_argument("--dropout", type=float, default=None,
                   help="text tower dropout (default: the config's, else 0.0)")
    g.add_argument("--open-checkpoint", type=str2bool, default=None, metavar="BOOL",
                   help="activation (gradient) checkpointing in both towers, less memory")
    _bool_flag(g, "--local-loss", False,
               "each rank scores only its own samples against the gathered features")
    _bool_flag(g, "--gather-with-grad", False,
               "let gradients flow through the cross-rank feature all-gather")

    g = p.add_argument_group("data and output (original flags)")
    g.add_argument("--train-data", default=None,
                   help="rec: prefix of X.rec/X.idx; wds: shard pattern/list. "
                        "Not needed for --data-format builtin")
    g.add_argument("--train-num-samples", type=int, default=None,
                   help="samples per epoch; only used when the loader cannot tell its "
                        "length (the epoch length comes from the data)")
    g.add_argument("--workers", type=int, default=None,
                   help="data loading workers per process (default: the config's, else 10)")
    g.add_argument("--output", default="runs/default",
                   help="run folder: training.log, tensorboard/, checkpoints/")

    g = p.add_argument_group("accepted for compatibility with the original")
    g.add_argument("--is-normlize", type=int, default=1, choices=(0, 1),
                   help="ignored, as in the original: features are always L2-normalised")
    g.add_argument("--horovod", action="store_true",
                   help="not supported (the original crashed with it); use torchrun")
    g.add_argument("--cfg", default="", help="ignored (unused in the original)")
    g.add_argument("--opts", nargs="+", default=None, help="ignored (unused in the original)")
    g.add_argument("--drop-path", type=float, default=None,
                   help="ignored (unused in the original); use --drop-path-rate")
    g.add_argument("--data-type", default="utf-8",
                   choices=("utf-8", "utf-16le", "numpy", "binidx", "dummy", "uint16"),
                   help="ignored (the original validated and ignored it)")

    g = p.add_argument_group("model config")
    g.add_argument("--config", default=None, metavar="JSON",
                   help="model config (path or shipped name, e.g. model_config/"
                        "RWKV_CLIP_B32.json or RWKV_CLIP_small); tower flags override it. "
                        f"Default: {DEFAULT_CONFIG}, or the original's defaults when tower "
                        "flags are given without --config")

    g = p.add_argument_group("image tower (original flags; default: from the config)")
    g.add_argument("--input-size", type=int, default=None, help="image side in pixels")
    g.add_argument("--image-depth", type=int, default=None, help="image blocks")
    g.add_argument("--image-embed-dims", type=int, default=None, help="image width (= n-embd)")
    g.add_argument("--image-patch-size", type=int, default=None, help="patch side")
    g.add_argument("--image-hidden-rate", type=int, default=None, help="ChannelMix expansion")
    g.add_argument("--image-num-heads", type=int, default=None, help="image WKV heads")
    g.add_argument("--image-output-cls-token", type=str2bool, default=None, metavar="BOOL",
                   help="use the cls token as image feature (needs --image-with-cls-token)")
    g.add_argument("--image-with-cls-token", type=str2bool, default=None, metavar="BOOL",
                   help="add a cls token (the original could never enable this)")
    g.add_argument("--drop-path-rate", type=float, default=None,
                   help="stochastic depth rate of the image tower")

    g = p.add_argument_group("text tower (original flags; default: from the config)")
    g.add_argument("--ctx-len", type=int, default=None, help="text tokens")
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary size")
    g.add_argument("--text-initialization", type=str2bool, default=None, metavar="BOOL",
                   help="RWKV orthogonal init of the text tower")
    g.add_argument("--head-size", type=int, default=None, help="text head size")
    g.add_argument("--text-num-head", type=int, default=None,
                   help="if > 0, head size = n-embd / text-num-head")
    g.add_argument("--pos-emb", type=int, default=None, help="(unused by the model)")
    g.add_argument("--head-size-divisor", type=int, default=None, help="ln_x eps divisor")
    g.add_argument("--n-layer", type=int, default=None, help="text blocks")
    g.add_argument("--n-embd", type=int, default=None, help="text width")
    g.add_argument("--dim-att", type=int, default=None, help="TimeMix width (0: n-embd)")
    g.add_argument("--dim-ffn", type=int, default=None, help="ChannelMix width (0: 3.5 n-embd)")
    g.add_argument("--head-qk", type=int, default=None, help="(unused by the model)")
    g.add_argument("--tiny-att-dim", type=int, default=None, help="(unused by the model)")
    g.add_argument("--tiny-att-layer", type=int, default=None, help="(unused by the model)")

    g = p.add_argument_group("new in this implementation")
    g.add_argument("--data-format", choices=DATA_FORMATS, default=None,
                   help="default: builtin without --train-data, else wds for .tar shards, "
                        "else rec")
    g.add_argument("--loader", choices=("auto", "dali", "torch"), default="auto",
                   help="data pipeline (auto: DALI if installed, else PyTorch)")
    _bool_flag(g, "--skip-corrupt", False, "skip unreadable records (counted) instead of "
                                           "stopping with an error")
    g.add_argument("--builtin-root", default=None,
                   help="cache folder of the built-in dataset (default: the data package's)")
    g.add_argument("--device", default="auto",
                   help="auto (cuda:LOCAL_RANK if available, else cpu), cpu, cuda, cuda:N")
    g.add_argument("--seed", type=int, default=0, help="seed of model init, captions, dropout")
    g.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps (the schedule spans "
                        "min(epochs x steps/epoch, max-steps))")
    g.add_argument("--save-every-steps", type=int, default=0,
                   help="also checkpoint every N optimizer steps (0: only per epoch)")
    g.add_argument("--resume", default=None, metavar="latest|PATH",
                   help="continue a run: 'latest' = OUTPUT/checkpoints/epoch_latest.pt "
                        "(fresh start if none), or a checkpoint path")
    g.add_argument("--pretrained", default=None, metavar="PATH",
                   help="initial weights (ours or the original's), fresh optimizer/schedule")
    _bool_flag(g, "--lock-image", False, "freeze the image tower")
    _bool_flag(g, "--lock-text", False, "freeze the text tower")
    g.add_argument("--accum-mode", choices=("exact", "mean"), default="exact",
                   help="exact: cache the K micro-batches' features, recompute each with "
                        "grad against all of them (gradient of one batch of K x m); "
                        "mean: average per-micro-batch losses (cheaper, fewer negatives)")
    _bool_flag(g, "--exclude-decay", False,
               "no weight decay on norms, biases, 1-D parameters and logit_scale")
    g.add_argument("--grad-clip-norm", type=float, default=1.0,
                   help="clip the global gradient norm (<= 0: off)")
    g.add_argument("--log-every", type=int, default=5,
                   help="progress line every N optimizer steps")
    g.add_argument("--log-format", choices=("plain", "original"), default="plain",
                   help="plain: 'epoch 3/7 step 255/441 loss 1.81 lr 4.5e-4 102 pairs/s eta "
                        "3:10'; original: the original's 'rank:.. total:.. lr:[..] step:..' line")
    g.add_argument("--zero-shot-every", type=int, default=1,
                   help="zero-shot evaluation every N epochs during training (0: only at "
                        "the end)")
    g.add_argument("--zero-shot-data", default=None, metavar="DIR",
                   help="image folder (classnames.json, templates.json) for zero-shot; "
                        "default: the built-in held-out split with --data-format builtin")
    _bool_flag(g, "--final-zero-shot", True, "evaluate zero-shot after training")
    _bool_flag(g, "--tensorboard", True, "write TensorBoard scalars to OUTPUT/tensorboard")
    _bool_flag(g, "--progress", True, "tqdm progress bar on rank 0")
    return p


def _tower_base(config: str | None, given: dict[str, Any]) -> tuple[dict[str, Any], str]:
    if config is not None or not given:
        name = config if config is not None else DEFAULT_CONFIG
        base, path = read_config_json(name)
        return base, str(path)
    return dict(ORIGINAL_TOWER_DEFAULTS), "the original train.py defaults"


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill model fields from --config and flags, infer data format, validate."""
    if args.horovod:
        raise TrainArgsError("--horovod is not supported; launch with torchrun "
                             "(NCCL on GPU, gloo on CPU)")
    for name in ("batch_size", "gradient_acc", "epochs", "log_every"):
        if getattr(args, name) < 1:
            raise TrainArgsError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(args, name)}")
    if args.lr <= 0:
        raise TrainArgsError(f"--lr must be > 0, got {args.lr}")
    if not 0.0 < args.warmup < 1.0 and args.lr_scheduler == "cosine":
        raise TrainArgsError(f"--warmup must be a fraction in (0, 1), got {args.warmup}")
    if args.max_steps is not None and args.max_steps < 1:
        raise TrainArgsError(f"--max-steps must be >= 1, got {args.max_steps}")
    if args.save_every_steps < 0 or args.zero_shot_every < 0:
        raise TrainArgsError("--save-every-steps and --zero-shot-every must be >= 0")
    if args.lock_image and args.lock_text:
        raise TrainArgsError("--lock-image and --lock-text together leave only logit_scale "
                             "to train; unlock one tower")
    if args.resume is not None and args.pretrained is not None:
        raise TrainArgsError("--resume and --pretrained exclude each other: resume restores "
                             "weights and optimizer; pretrained starts a fresh run from weights")

    given = {k: getattr(args, k) for k in TOWER_KEYS if getattr(args, k) is not None}
    base, source = _tower_base(args.config, given)
    fields = {k: v for k, v in base.items() if k in TOWER_KEYS or k in SHARED_KEYS
              or k == "with_cp"}
    fields.update(given)
    if "n_embd" in given:  # derived widths follow a new n_embd unless given too
        for k in ("dim_att", "dim_ffn"):
            if k not in given:
                fields[k] = 0
    for k, default in SHARED_KEYS.items():
        value = getattr(args, k)
        fields[k] = value if value is not None else base.get(k, default)
    fields["with_cp"] = (args.open_checkpoint if args.open_checkpoint is not None
                         else str2bool(base.get("with_cp", False)))
    model = complete_args(ModelArgs(**fields), source=f"model settings (base: {source})")
    for k, v in vars(model).items():
        setattr(args, k, v)
    args.open_checkpoint = model.with_cp
    args.config_source = source
    args.model_config = {k: v for k, v in vars(model).items() if k != "workers"}

    if args.data_format is None:
        if args.train_data is None:
            args.data_format = "builtin"
        elif ".tar" in args.train_data or "{" in args.train_data:
            args.data_format = "wds"
        else:
            args.data_format = "rec"
    if args.data_format != "builtin" and not args.train_data:
        raise TrainArgsError(f"--data-format {args.data_format} needs --train-data")
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and resolve; bad flags exit with status 2 and a message naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return resolve_args(args)
    except (TrainArgsError, ConfigError) as exc:
        parser.error(str(exc))


def warn_ignored(args: argparse.Namespace, log=print) -> None:
    for flag, value in (("--cfg", args.cfg or None), ("--opts", args.opts),
                        ("--drop-path", args.drop_path)):
        if value is not None:
            log(f"note: {flag} is accepted for compatibility and ignored, as in the original")


if __name__ == "__main__":  # pragma: no cover - debugging aid
    print(parse_args(sys.argv[1:]))
