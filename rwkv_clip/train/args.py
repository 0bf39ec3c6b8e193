"""Command line of ``train.py``: every flag of the original, plus the new ones.

Tower settings come from one config (``--config``, default ``RWKV_CLIP_small``); a tower
flag on the command line overrides its key. The resolved fields are stored flat on the
namespace, as the original's ``args``, and in ``args.model_config`` for checkpoints.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..config import (
    DEFAULT_CONFIG,
    INPUT_SIZE_FLAGS,
    REBUILD_CHOICES,
    TOWER_KEYS,
    ModelArgs,
    apply_overrides,
    read_config_json,
    str2bool,
)
from ..errors import (
    EXIT_USER_ERROR,
    CheckpointError,
    ConfigError,
    OneLineArgumentParser,
    TrainArgsError,
    report,
)
from ..faults import DEFAULT_DIST_TIMEOUT
from ..host_memory import add_host_malloc_flag
from ..lora import add_lora_flags, check_lora_args
from ..precision import PRECISIONS
from ..pretrained import published_config
from .tracking import add_tracking_flags, resolve_tracking
from .validation import add_validation_flags, resolve_validation

# Config keys that are training options with their own flag (flag name -> config key).
SHARED_FLAGS = {"precision": "precision", "dropout": "dropout", "workers": "workers",
                "open_checkpoint": "with_cp", "rebuild": "rebuild", "dispatch": "dispatch"}
# Config keys that are not model settings: not recorded in args.model_config.
NOT_MODEL_KEYS = ("workers", "data_type")

DATA_FORMATS = ("rec", "wds", "parquet", "builtin")


def _bool_flag(group, name: str, default, help: str) -> None:
    group.add_argument(name, type=str2bool, nargs="?", const=True, default=default,
                       metavar="BOOL", help=help)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in its help, once: not where the text already states it, and
    not for None (a default the text explains or that means "not given")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default is None:
            return text
        return super()._get_help_string(action)


def build_train_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="train.py",
        description="Train RWKV-CLIP. With no arguments: the small config on the built-in "
                    "dataset on the available device, then zero-shot accuracy on its "
                    "held-out split. Launch multi-process with torchrun "
                    "(NCCL on GPU, gloo on CPU).",
        formatter_class=HelpFormatter)

    g = p.add_argument_group("optimisation (original flags)")
    g.add_argument("--batch-size", type=int, default=32,
                   help="micro-batch size per process (one forward/backward)")
    g.add_argument("--beta1", type=float, default=0.9,
                   help="AdamW beta1 (SGD momentum); the cosine schedule cycles it "
                        "0.95 -> 0.85 -> 0.95 as the original's OneCycleLR does")
    g.add_argument("--beta2", type=float, default=0.98, help="AdamW beta2")
    g.add_argument("--epochs", type=int, default=2, help="passes over the training data")
    g.add_argument("--gradient-acc", type=int, default=1, metavar="K",
                   help="micro-batches per optimizer step (global batch = batch-size x K x "
                        "world size); see --accum-mode")
    g.add_argument("--lr", type=float, default=1.5e-3, help="peak learning rate")
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
    g.add_argument("--dispatch", default=None, metavar="OP=NAME,...|DISPATCH.JSON",
                   help="the dispatch table's choices: pins such as wkv=cpu,relu_square="
                        "reference, or a run's dispatch.json to repeat its choices. Default: "
                        "the config's dispatch, else auto (each op checked and timed on first "
                        "use; under DDP every rank takes rank 0's choices)")
    g.add_argument("--rebuild", choices=REBUILD_CHOICES, default=None,
                   help="where a residual branch keeps only the projections' and the WKV's "
                        "results and recomputes the rest in the backward: auto (branches "
                        "from 2^20 input elements), always, never (docs/training.md). "
                        "Default: the config's rebuild, else auto")
    _bool_flag(g, "--local-loss", False,
               "each rank scores only its own samples against the gathered features")
    _bool_flag(g, "--gather-with-grad", False,
               "let gradients flow through the cross-rank feature all-gather")

    g = p.add_argument_group("data and output (original flags)")
    g.add_argument("--train-data", default=None,
                   help="rec: prefix of X.rec/X.idx (scripts/make_rec.py's output); wds: "
                        ".tar shard pattern/list; parquet: .parquet file, glob, brace list "
                        "or folder (img2dataset, the Hub's YFCC15M). A JSONL/CSV of pairs "
                        "is converted first with scripts/make_rec.py. Not needed for "
                        "--data-format builtin")
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
                        "RWKV_CLIP_B32.json or RWKV_CLIP_small); tower flags override its "
                        f"keys. Default: the config of a published --pretrained name, else "
                        f"{DEFAULT_CONFIG}")

    g = p.add_argument_group("image tower (original flags; default: from the config)")
    g.add_argument(*INPUT_SIZE_FLAGS, dest="input_size",
                   type=int, default=None, metavar="PIXELS",
                   help="image side in pixels (open_clip's --force-image-size): the model's "
                        "pos_embed is made for it, and --pretrained weights of another size "
                        "have theirs resized (bicubic)")
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
                   help="default: builtin without --train-data, else parquet for .parquet "
                        "files, wds for .tar shards, else rec")
    g.add_argument("--image-column", default=None,
                   help="parquet image column (default: jpg, images, image or img)")
    g.add_argument("--caption-columns", default=None, metavar="RAW[,SYN[,GEN]]",
                   help="parquet caption columns as raw,synthetic,generated (default: "
                        "caption, texts or text)")
    g.add_argument("--caption-tokens", default=None, metavar="FILE.npy",
                   help="token array (N, 77 x k), row i = record/sample i, replacing the first "
                        "k caption variants")
    g.add_argument("--loader", choices=("auto", "dali", "torch"), default="auto",
                   help="data pipeline (auto: DALI if installed, else PyTorch)")
    _bool_flag(g, "--skip-corrupt", False, "skip unreadable records (counted) instead of "
                                           "stopping with an error")
    g.add_argument("--builtin-root", default=None,
                   help="cache folder of the built-in dataset (default: the data package's)")
    g.add_argument("--device", default="auto",
                   help="auto (cuda:LOCAL_RANK if available, else cpu), cpu, cuda, cuda:N")
    add_host_malloc_flag(g)
    g.add_argument("--dist-timeout", type=float, default=DEFAULT_DIST_TIMEOUT, metavar="SECONDS",
                   help="how long a collective waits for a stuck rank before the job stops "
                        f"(default {DEFAULT_DIST_TIMEOUT:.0f}); a lost rank is noticed sooner "
                        "(docs/faults.md)")
    g.add_argument("--seed", type=int, default=0, help="seed of model init, captions, dropout")
    g.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps (the schedule spans "
                        "min(epochs x steps/epoch, max-steps))")
    g.add_argument("--save-every-steps", type=int, default=0,
                   help="also checkpoint every N optimizer steps (0: only per epoch)")
    g.add_argument("--resume", default=None, metavar="latest|PATH",
                   help="continue a run: 'latest' = OUTPUT/checkpoints/epoch_latest.pt "
                        "(fresh start if none), or a checkpoint path")
    g.add_argument("--pretrained", default=None, metavar="NAME:TAG|PATH|hf-hub:...",
                   help="initial weights (ours or the original's; a file, a published name "
                        "such as RWKV-CLIP-B32:yfcc15m, whose config is then the default, or "
                        "hf-hub:OWNER/REPO[/FILE]), fresh optimizer/schedule")
    _bool_flag(g, "--lock-image", False, "freeze the image tower")
    _bool_flag(g, "--lock-text", False, "freeze the text tower")
    g.add_argument("--accum-mode", choices=("exact", "mean"), default="exact",
                   help="exact: cache the K micro-batches' features, recompute each with "
                        "grad against all of them (gradient of one batch of K x m); "
                        "mean: average per-micro-batch losses (cheaper, fewer negatives)")
    _bool_flag(g, "--exclude-decay", None,
               "no weight decay on norms, biases, 1-D parameters and logit_scale (as "
               "open_clip); default: on for the built-in dataset (the main job's recipe: a "
               "decayed logit_scale stays near its start and shape is learnt late), off "
               "otherwise (the original decays every parameter)")
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
    _bool_flag(g, "--tensorboard", True, "write TensorBoard scalars to OUTPUT/tensorboard "
                                         "(False: drop tensorboard from --report-to)")
    _bool_flag(g, "--progress", True, "tqdm progress bar on rank 0")
    add_lora_flags(p)
    add_run_safety_flags(p)
    add_loss_flags(p)
    add_validation_flags(p)
    add_tracking_flags(p)

    g = p.add_argument_group("compilation (open_clip's flag)")
    g.add_argument("--torchcompile", action="store_true", default=False,
                   help="torch.compile the model (after DDP) before training; checkpoints "
                        "hold the plain module's weights")
    return p


def resolve_model_config(args: argparse.Namespace) -> tuple[ModelArgs, str]:
    """The model settings of parsed flags: the chosen config (``--config``, else the one
    a published ``--pretrained`` name was trained with, else ``RWKV_CLIP_small``) with
    every tower and shared flag given overriding its key; and where they came from (the
    config's path and the overriding flags, for the log)."""
    config, named_by = args.config, None
    if config is None and getattr(args, "pretrained", None):
        config = published_config(args.pretrained)
        named_by = f"the config of --pretrained {args.pretrained}" if config else None
    params, path = read_config_json(config if config is not None else DEFAULT_CONFIG)
    flags = [f for f in (*TOWER_KEYS, *SHARED_FLAGS) if getattr(args, f) is not None]
    given = {SHARED_FLAGS.get(f, f): getattr(args, f) for f in flags}
    source = str(path) + (f" ({named_by})" if named_by else "")
    if flags:
        source += " overridden by " + ", ".join("--" + f.replace("_", "-") for f in flags)
    model = ModelArgs.from_dict(apply_overrides(params, given), source=f"model config {source}")
    return model, source


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
    if not args.dist_timeout > 0:
        raise TrainArgsError(f"--dist-timeout must be > 0 seconds, got {args.dist_timeout}")
    if args.save_every_steps < 0 or args.zero_shot_every < 0:
        raise TrainArgsError("--save-every-steps and --zero-shot-every must be >= 0")
    if args.lock_image and args.lock_text:
        raise TrainArgsError("--lock-image and --lock-text together leave only logit_scale "
                             "to train; unlock one tower")
    if args.resume is not None and args.pretrained is not None:
        raise TrainArgsError("--resume and --pretrained exclude each other: resume restores "
                             "weights and optimizer; pretrained starts a fresh run from weights")

    resolve_tracking(args)
    resolve_validation(args)
    model, args.config_source = resolve_model_config(args)
    args.model_config = {k: v for k, v in model.to_dict().items() if k not in NOT_MODEL_KEYS}
    for k, v in args.model_config.items():
        setattr(args, k, v)
    args.workers = model.workers
    args.open_checkpoint = model.with_cp
    check_lora_args(args)

    if args.data_format is None:
        if args.train_data is None:
            args.data_format = "builtin"
        elif ".parquet" in args.train_data:
            args.data_format = "parquet"
        elif ".tar" in args.train_data or "{" in args.train_data:
            args.data_format = "wds"
        else:
            args.data_format = "rec"
    if args.data_format != "builtin" and not args.train_data:
        raise TrainArgsError(f"--data-format {args.data_format} needs --train-data")
    if args.exclude_decay is None:
        args.exclude_decay = args.data_format == "builtin"
    check_train_data(args)
    return args


PAIRS_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv")


def check_train_data(args: argparse.Namespace) -> None:
    """Catch training data given in a form the chosen loader cannot read, with the fix:
    a JSONL/CSV of pairs (convert it with make_rec.py) or a folder of parquet / .tar
    shards read as a .rec prefix (name the format)."""
    import os

    data, fmt = args.train_data, args.data_format
    if not data or fmt in ("builtin", "parquet"):
        return
    if data.lower().endswith(PAIRS_SUFFIXES):
        raise TrainArgsError(
            f"--train-data {data} is a table of image-caption pairs, which train.py does not "
            f"read directly: convert it first with python scripts/make_rec.py {data} "
            "data/train, then pass --train-data data/train (see docs/own-data.md)")
    if fmt == "rec" and os.path.isdir(data):
        names = os.listdir(data)
        for suffix, flag in ((".parquet", "parquet"), (".tar", "wds")):
            if any(n.endswith(suffix) for n in names):
                raise TrainArgsError(
                    f"--train-data {data} is a folder of {suffix} files, read here as a .rec "
                    f"prefix: pass --data-format {flag}")
        if any(n.endswith(".rec") for n in names):
            recs = sorted(n[:-4] for n in names if n.endswith(".rec"))
            raise TrainArgsError(
                f"--train-data {data} is a folder; pass the .rec prefix, e.g. --train-data "
                f"{os.path.join(data, recs[0])}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and resolve; bad flags or a bad config exit with status 2 and one line
    ``train.py: error: ...`` naming the flag or config key (argparse's own errors, such as
    an unknown flag, come with its usage text as usual)."""
    parser = build_train_parser()
    args = parser.parse_args(argv)
    args.explicit = explicit_dests(argv)  # what a resume may not silently override
    try:
        return resolve_args(args)
    except (TrainArgsError, ConfigError, CheckpointError) as exc:
        report(exc, parser.prog)
        raise SystemExit(EXIT_USER_ERROR) from None


def warn_ignored(args: argparse.Namespace, log=print) -> None:
    for flag, value in (("--cfg", args.cfg or None), ("--opts", args.opts),
                        ("--drop-path", args.drop_path)):
        if value is not None:
            log(f"note: {flag} is accepted for compatibility and ignored, as in the original")
    if getattr(args, "siglip", False) and (args.local_loss or args.gather_with_grad):
        log("note: --local-loss and --gather-with-grad belong to the CLIP loss and are "
            "ignored with --siglip (see --siglip-dist-impl)")


# ----------------------------------------------------------------------------- resume, retention
# the run-safety flags; the logic lives in loop.py / checkpoint.py

DEFAULT_KEEP_CHECKPOINTS = 5


def add_run_safety_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("resume and checkpoint retention")
    _bool_flag(g, "--resume-allow-changes", False,
               "with --resume: let flags given again change the checkpoint's run settings "
               "(data, config, batch, precision, schedule, ...); without it a contradicting "
               "flag is an error")
    g.add_argument("--keep-checkpoints", type=int, default=DEFAULT_KEEP_CHECKPOINTS,
                   metavar="N",
                   help="keep the newest N epoch_/step_ checkpoints (plus epoch_latest.pt); "
                        "0 keeps all")
    _bool_flag(g, "--delete-previous-checkpoint", False,
               "delete the previous checkpoint once a new one is written (as open_clip)")


def explicit_dests(argv: Sequence[str] | None) -> list[str]:
    """The destinations of the flags given on the command line (not their defaults)."""
    parser = build_train_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return sorted(vars(parser.parse_args(argv)))


# ----------------------------------------------------------------------------- loss, captions

CAPTION_ROLES = ("raw", "synthetic", "generated")


def caption_weights(text: str) -> list[float]:
    """argparse type of ``--caption-weights RAW,SYN,GEN``: three non-negative numbers,
    not all zero."""
    try:
        weights = [float(x) for x in text.split(",")]
    except ValueError:
        weights = []
    if (len(weights) != len(CAPTION_ROLES) or not all(w >= 0 and w != float("inf")
                                                      for w in weights) or sum(weights) == 0):
        raise argparse.ArgumentTypeError(
            f"expected three non-negative numbers RAW,SYN,GEN (weights of the raw, synthetic "
            f"and generated captions), not all zero, e.g. 1,1,1 or 1,0,0; got {text!r}")
    return weights


def add_loss_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("loss and captions")
    g.add_argument("--siglip", action="store_true", default=False,
                   help="SigLIP's pairwise sigmoid loss instead of CLIP's softmax loss (as "
                        "open_clip's --siglip); the model gains logit_bias (init -10) and "
                        "logit_scale starts at ln 10")
    g.add_argument("--siglip-dist-impl", choices=("bidir", "gather"), default="bidir",
                   help="how SigLIP sees the other ranks' texts: bidir (neighbour exchange "
                        "both ways, one block at a time) or gather (all-gather); the same "
                        "loss and gradients")
    g.add_argument("--caption-weights", type=caption_weights, default=[1.0, 1.0, 1.0],
                   metavar="RAW,SYN,GEN",
                   help="relative chance of drawing each image's raw, synthetic and "
                        "generated caption (1,1,1: the original's uniform draw; 1,0,0: raw "
                        "captions only)")
