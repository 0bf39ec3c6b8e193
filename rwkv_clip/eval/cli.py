"""Command lines of ``zero_shot.py`` and ``text_image_retrieval.py`` (the scripts only call
:func:`zero_shot_main` / :func:`retrieval_main`).

Both accept every flag of the original scripts of that name, so its evaluation shell
scripts run with only their paths filled in (docs/evaluation.md).
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..config import INPUT_SIZE_FLAGS, str2bool
from ..errors import EvalError, OneLineArgumentParser, run_cli
from ..faults import DEFAULT_DIST_TIMEOUT
from ..host_memory import add_host_malloc_flag
from ..onnx import RUNTIMES
from ..text_files import check_encoding
from .runner import ARCH_FLAGS, run

CLASSIFICATION_SETS = ("cifar10, cifar100, food101, pets, flowers, sun397, stanford_car, dtd, "
                       "caltech101, aircraft, imagenet")
_BOOL_FLAGS = ("image_output_cls_token", "image_with_cls_token", "text_initialization")
_FLOAT_FLAGS = ("dropout",)

ZERO_SHOT_EXAMPLES = """\
Examples:
  python zero_shot.py                                   # fresh small model, built-in split
  python zero_shot.py --model-weight epoch_32.pt        # config inferred, built-in split
  python zero_shot.py --pretrained RWKV-CLIP-B32:yfcc15m --data-root /data --dataset \\
      cifar10,cifar100,food101,pets,flowers,sun397,stanford_car,dtd,caltech101,aircraft,imagenet
  python zero_shot.py --pretrained hf-hub:Kaichengalex/RWKV-CLIP-B32-YFCC15M --dataset imagenet \\
      --data-root /data
  torchrun --nproc_per_node 8 zero_shot.py --model-weight model_31.pt --dataset imagenet \\
      --data-root /data
  python zero_shot.py --model-weight w.pt --dataset imagefolder --data-root my_images/
  python zero_shot.py --model-weight w.pt --task zeroshot_retrieval --retrieval-file pairs.jsonl
  python zero_shot.py --model-weight w.pt --task linear_probe --dataset builtin
Retrieval on MSCOCO / Flickr30k: text_image_retrieval.py (or --dataset mscoco,flickr30k here).
"""
RETRIEVAL_EXAMPLES = """\
Examples:
  python text_image_retrieval.py --pretrained RWKV-CLIP-B32:yfcc15m --dataset coco \\
      --data-root /data/coco
  python text_image_retrieval.py --model-weight model_31.pt --dataset flickr \\
      --data-root /data/flickr30k
  python text_image_retrieval.py --model-weight w.pt --dataset urban1k --data-root /data/Urban1k \\
      --ctx-len 248 --encoding latin-1
"""


def build_eval_parser(retrieval: bool = False) -> argparse.ArgumentParser:
    """The parser of ``zero_shot.py`` (``retrieval=False``) or ``text_image_retrieval.py``."""
    prog = "text_image_retrieval.py" if retrieval else "zero_shot.py"
    description = ("Zero-shot image-text retrieval of RWKV-CLIP (MSCOCO, Flickr30k, Urban1k, "
                   "ShareGPT4V, DCI, JSONL)"
                   if retrieval else
                   "Zero-shot evaluation of RWKV-CLIP: classification and image-text retrieval")
    p = OneLineArgumentParser(prog=prog, description=description,
                                epilog=RETRIEVAL_EXAMPLES if retrieval else ZERO_SHOT_EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model-weight", default=None, metavar="PT|NAME",
                   help="weights to evaluate: a file (.pt or .safetensors; ours or the "
                        "original's, 'module.'/'_orig_mod.' prefixes are stripped), NAME:TAG "
                        "(e.g. RWKV-CLIP-B32:yfcc15m) or hf-hub:OWNER/REPO[/FILE][@REV]. "
                        "Without it a fresh randomly initialised model is evaluated (a smoke "
                        "test).")
    g.add_argument("--pretrained", default=None, metavar="NAME:TAG|PATH|hf-hub:...",
                   help="same as --model-weight (open_clip / CLIP_benchmark's name); published "
                        "weights download into the Hugging Face cache (HF_HOME, HF_HUB_CACHE; "
                        "HF_HUB_OFFLINE=1: cache only)")
    g.add_argument("--config", default=None, metavar="JSON|NAME",
                   help="model config JSON or shipped name (RWKV_CLIP_B32, RWKV_CLIP_B16, "
                        "RWKV_CLIP_small, RWKV_CLIP_tiny). Default: the published weights' "
                        "config, else the shipped config whose model fits the checkpoint's "
                        "parameter shapes (with the architecture flags applied), else "
                        "RWKV_CLIP_small without weights. Architecture flags override it.")
    g.add_argument("--onnx", default=None, metavar="DIR",
                   help="evaluate the encoders of an ONNX folder (python -m rwkv_clip.export "
                        "--format onnx, or its python -m rwkv_clip.quantize INT8 copy) instead "
                        "of PyTorch weights, by the same protocol; one process, CPU")
    g.add_argument("--onnx-runtime", default="onnxruntime", choices=RUNTIMES,
                   help="what runs --onnx encoders")
    g.add_argument("--model-name", default=None,
                   help="model name written to the JSON 'model' field (default: config name)")
    g.add_argument("--wkv-backend", default=None, choices=("auto", "cuda", "cpu", "reference"),
                   help="WKV kernel: native CUDA/CPU kernel (built on first use) or the pure "
                        "PyTorch reference (slow, needs no compiler). Default: by device.")
    g.add_argument("--torchcompile", action="store_true", default=False,
                   help="torch.compile encode_image / encode_text (open_clip's flag); the "
                        "first batches include the compilation")
    g.add_argument("--seed", type=int, default=1024,
                   help="seed for the random init when no weights are given and for the "
                        "linear probe's splits (default 1024)")

    g = p.add_argument_group("data")
    if retrieval:
        g.add_argument("--dataset", default="coco", metavar="A,B,...",
                       help="comma list of retrieval sets: coco (mscoco), flickr (flickr30k), "
                            "urban1k (--data-root with image/ and caption/), sharegpt4v and "
                            "dci (--retrieval-file FILE.json), jsonl (--retrieval-file). "
                            "Default: coco, as the original")
    else:
        g.add_argument("--dataset", default=None, metavar="A,B,...",
                       help="comma list of sets. Classification: " + CLASSIFICATION_SETS +
                            ", imagefolder (any folder of class sub-folders, given by "
                            "--data-root), builtin (the built-in held-out split; the "
                            "default), builtin_shifted (its distribution-shifted split). "
                            "Retrieval: mscoco (coco), flickr30k (flickr), urban1k, "
                            "sharegpt4v, dci, jsonl (--retrieval-file).")
    g.add_argument("--data-root", default=None, metavar="DIR",
                   help="folder holding the sets in torchvision's layouts (e.g. "
                        "DIR/cifar-10-batches-py, DIR/imagenet/val/<wnid>/ or "
                        "DIR/imagenet/val.rec + val.idx); for imagefolder the image folder "
                        "itself; for retrieval the folder with the Karpathy test JSON and the "
                        "images (JSONL: image paths are relative to it, default the JSONL's "
                        "folder). A missing set prints the expected layout.")
    if not retrieval:
        g.add_argument("--templates", default=None, metavar="FILE",
                       help="prompt templates: JSON list, JSON object keyed by dataset (like "
                            "the original's template.json) or text with one template per "
                            "line; '{}' marks the class name. Default: the original's per-set "
                            "templates; for image folders their templates.json, else CLIP's "
                            "80 ImageNet templates.")
    g.add_argument("--retrieval-file", default=None, metavar="FILE",
                   help="retrieval annotations: JSONL of {\"image\": path, \"captions\": [...]}, "
                        "a Karpathy test JSON for mscoco/flickr30k, or the JSON list of "
                        "sharegpt4v/dci")
    g.add_argument("--encoding", default="utf-8",
                   help="text encoding of the retrieval captions (--retrieval-file, Urban1k's "
                        "caption/*.txt; default utf-8, e.g. latin-1); a byte not valid in it "
                        "is an error naming the file and line")
    g.add_argument("--caption-prefix", default=None,
                   help="text put before every retrieval caption (default: 'a photo of ' for "
                        "mscoco/flickr30k as the original, nothing for JSONL)")
    if not retrieval:
        g.add_argument("--caltech101-split", default="original", choices=("original", "all"),
                       help="caltech101: the original's random 3000/5677 split with seed 3072 "
                            "(evaluates the 5677) or all 8677 images")
        g.add_argument("--task", default="zeroshot_classification",
                       choices=("zeroshot_classification", "zeroshot_retrieval", "linear_probe"),
                       help="task for sets that do not imply one (mscoco/flickr30k/jsonl are "
                            "always retrieval). linear_probe: logistic regression on frozen "
                            "image features of the set's train split (builtin, imagefolder "
                            "with train/ and test/, the paper's sets), CLIP's protocol")
        g.add_argument("--fewshot-k", type=int, default=-1, metavar="K",
                       help="linear probe: K training images per class (seeded by --seed); "
                            "-1: the whole train split")
        g.add_argument("--val-proportion", type=float, default=0.2, metavar="P",
                       help="linear probe: share of the train split held out to choose the "
                            "L2 regularisation (then refit on the whole split)")
        g.add_argument("--feature-root", default=None, metavar="DIR",
                       help="linear probe: where frozen features are cached, keyed by the "
                            "weights, dataset, split and transform (default: "
                            "$RWKV_CLIP_CACHE/features, else ~/.cache/rwkv_clip/features)")

    g = p.add_argument_group("run")
    g.add_argument("--batch-size", type=int, default=64,
                   help="images per batch and rank (default 64)")
    g.add_argument("--text-batch-size", type=int, default=256,
                   help="prompts/captions per text batch (default 256)")
    g.add_argument("--workers", type=int, default=2,
                   help="data loader worker processes (default 2)")
    g.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16", "tf32"),
                   help="accepted as the original's flag and, as there, not used for "
                        "computing: evaluation runs in fp32 (the original's --precision only "
                        "rounds the text tower's init, which the loaded weights overwrite). "
                        "Use --amp for autocast.")
    g.add_argument("--amp", default=None, choices=("bf16", "fp16"),
                   help="opt-in autocast of the encoders in this dtype (faster on GPUs, not "
                        "the paper's protocol; features and logits stay float32). Default: "
                        "none, fp32 throughout")
    g.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda if available; under torchrun "
                        "each rank uses cuda:LOCAL_RANK)")
    add_host_malloc_flag(g)
    g.add_argument("--dist-timeout", type=float, default=DEFAULT_DIST_TIMEOUT,
                   metavar="SECONDS",
                   help="under torchrun or srun: how long a collective waits for a stuck "
                        f"rank before the run stops (default {DEFAULT_DIST_TIMEOUT:.0f}); a "
                        "lost rank is noticed sooner (docs/faults.md)")
    g.add_argument("--output-dir", default=None, metavar="DIR",
                   help="where <dataset>_<task>.json files go (CLIP_benchmark shape). The "
                        "score line is appended to DIR/zero_shot_scores.txt. An argument "
                        "ending in .txt is read as the original's score file and the JSONs "
                        "go beside it. Default: beside the evaluated run (runs/X/eval_results "
                        "for runs/X/checkpoints/Y.pt, <folder>/eval_results for other weights, "
                        "runs/pretrained/<name>/eval_results for weights by name, "
                        "runs/zero_shot/eval_results for a fresh model)")
    g.add_argument("--score-file", default=None, metavar="TXT",
                   help="text file to append the original's comma-separated score line to")

    g = p.add_argument_group(
        "original script flags",
        "accepted so the original's shell scripts run unchanged; architecture flags "
        "override the chosen config (see --config)")
    for key in ARCH_FLAGS:
        flag = "--" + key.replace("_", "-")
        typ = str2bool if key in _BOOL_FLAGS else float if key in _FLOAT_FLAGS else int
        names = list(INPUT_SIZE_FLAGS) if key == "input_size" else [flag]
        if retrieval and key == "image_output_cls_token":
            names.append("--image-output-cls_token")  # the original retrieval script's spelling
        g.add_argument(*names, dest=key, type=typ, default=None,
                       help="model config field " + key)
    for flag in ("--model-type", "--start-epoch", "--end-epoch", "--dataset-type", "--data-type",
                 "--pre-ffn"):
        g.add_argument(flag, default=None, help="accepted and ignored (unused by the original)")
    return p


def parse_options(argv: Sequence[str] | None = None, retrieval: bool = False
                  ) -> argparse.Namespace:
    """Parsed and checked options (what :func:`rwkv_clip.eval.runner.run` takes)."""
    opts = build_eval_parser(retrieval).parse_args(argv)
    if opts.batch_size < 1 or opts.text_batch_size < 1 or opts.workers < 0:
        raise EvalError(f"--batch-size ({opts.batch_size}) and --text-batch-size "
                        f"({opts.text_batch_size}) must be >= 1, --workers ({opts.workers}) "
                        ">= 0")
    if not opts.dist_timeout > 0:
        raise EvalError(f"--dist-timeout must be > 0 seconds, got {opts.dist_timeout}")
    opts.prog = "text_image_retrieval.py" if retrieval else "zero_shot.py"
    check_encoding(opts.encoding)
    if (opts.model_weight and opts.pretrained
            and str(opts.model_weight) != str(opts.pretrained)):
        raise EvalError(f"--model-weight {opts.model_weight} and --pretrained "
                        f"{opts.pretrained} name different weights: give one")
    if opts.onnx:
        given = [flag for flag, value in (("--model-weight", opts.model_weight),
                                          ("--pretrained", opts.pretrained),
                                          ("--config", opts.config),
                                          ("--torchcompile", opts.torchcompile),
                                          ("--amp", opts.amp)) if value]
        if given:
            raise EvalError(f"--onnx {opts.onnx} is the model: drop {', '.join(given)}")
    if not retrieval and not 0.0 < opts.val_proportion < 1.0:
        raise EvalError(f"--val-proportion must lie in (0, 1), got {opts.val_proportion}")
    if not retrieval and (opts.fewshot_k == 0 or opts.fewshot_k < -1):
        raise EvalError(f"--fewshot-k must be -1 (all) or >= 1, got {opts.fewshot_k}")
    if retrieval:
        opts.task = "zeroshot_retrieval"
        opts.templates = None
        opts.caltech101_split = "original"
    return opts


def _main(argv: Sequence[str] | None, retrieval: bool) -> int:
    from ..distributed import launch_environment, pick_device
    from ..host_memory import configure_host_malloc

    opts = parse_options(argv, retrieval)
    from ..ops import check_wkv_environment
    check_wkv_environment()  # a mistyped kernel name stops here, on every device
    # the process is ours: on the CPU it keeps freed memory for the next batch's reuse
    configure_host_malloc(pick_device(opts.device or "auto", launch_environment()[2]),
                          opts.host_malloc)
    run(opts)
    return 0


def zero_shot_main(argv: Sequence[str] | None = None) -> int:
    """``zero_shot.py``: user errors are one ``zero_shot.py: error: ...`` line, exit 2."""
    return run_cli(lambda: _main(argv, retrieval=False), prog="zero_shot.py")


def retrieval_main(argv: Sequence[str] | None = None) -> int:
    """``text_image_retrieval.py``: as :func:`zero_shot_main`, retrieval sets only."""
    return run_cli(lambda: _main(argv, retrieval=True), prog="text_image_retrieval.py")
