#!/usr/bin/env python
"""Zero-shot evaluation of RWKV-CLIP: classification and image-text retrieval.

Examples:
  python zero_shot.py                                   # fresh small model, built-in split
  python zero_shot.py --model-weight epoch_32.pt        # config inferred, built-in split
  python zero_shot.py --model-weight RWKV_CLIP_B32.pt --config RWKV_CLIP_B32 \\
      --dataset cifar10,cifar100,food101,pets,flowers,sun397,stanford_car,dtd,caltech101,aircraft,imagenet \\
      --data-root /data --precision bf16 --output-dir results/
  torchrun --nproc_per_node 8 zero_shot.py --model-weight ... --dataset imagenet --data-root /data
  python zero_shot.py --model-weight w.pt --dataset imagefolder --data-root my_images/
  python zero_shot.py --model-weight w.pt --dataset mscoco,flickr30k --data-root /data/coco
  python zero_shot.py --model-weight w.pt --task zeroshot_retrieval --retrieval-file pairs.jsonl
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time

CLASSIFICATION_SETS = ("cifar10, cifar100, food101, pets, flowers, sun397, stanford_car, dtd, "
                       "caltech101, aircraft, imagenet")


def _bool(text: str) -> bool:
    from rwkv_clip.config import parse_bool
    parsed = parse_bool(text)
    if parsed is None:
        raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")
    return parsed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zero_shot.py", description=__doc__.split("\n")[1],
        epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model-weight", default=None, metavar="PT",
                   help="checkpoint to evaluate (ours or the original's; 'module.'/'_orig_mod.' "
                        "prefixes are stripped). Without it a fresh randomly initialised model is "
                        "evaluated (a smoke test).")
    g.add_argument("--pretrained", default=None, metavar="PT",
                   help="alias of --model-weight (CLIP_benchmark's name); recorded in the JSON")
    g.add_argument("--config", default=None, metavar="JSON|NAME",
                   help="model config JSON or shipped name (RWKV_CLIP_B32, RWKV_CLIP_B16, "
                        "RWKV_CLIP_small, RWKV_CLIP_tiny). Default: inferred from the checkpoint's "
                        "parameter shapes, or RWKV_CLIP_small without a checkpoint. A config that "
                        "does not fit the checkpoint is an error listing the mismatched keys.")
    g.add_argument("--model-name", default=None,
                   help="model name written to the JSON 'model' field (default: config name)")
    g.add_argument("--wkv-backend", default=None, choices=("auto", "cuda", "cpu", "reference"),
                   help="WKV kernel: native CUDA/CPU kernel (built on first use) or the pure "
                        "PyTorch reference (slow, needs no compiler). Default: by device.")
    g.add_argument("--seed", type=int, default=1024,
                   help="seed for the random init when no weights are given (default 1024)")

    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=None, metavar="A,B,...",
                   help="comma list of sets. Classification: " + CLASSIFICATION_SETS +
                        ", imagefolder (any folder of class sub-folders, given by --data-root), "
                        "builtin (the built-in held-out split; the default). Retrieval: mscoco "
                        "(coco), flickr30k (flickr), jsonl (--retrieval-file).")
    g.add_argument("--data-root", default=None, metavar="DIR",
                   help="folder holding the sets in torchvision's layouts (e.g. DIR/cifar-10-batches-py, "
                        "DIR/caltech101/101_ObjectCategories, DIR/imagenet/val/<wnid>/); for "
                        "imagefolder the image folder itself; for retrieval the folder with the "
                        "Karpathy test JSON and the images (JSONL: image paths are relative to it, "
                        "default the JSONL's folder). A missing set prints the expected layout.")
    g.add_argument("--templates", default=None, metavar="FILE",
                   help="prompt templates: JSON list, JSON object keyed by dataset (like the "
                        "original's template.json) or text with one template per line; '{}' marks "
                        "the class name. Default: the original's per-set templates; for image "
                        "folders their templates.json, else CLIP's 80 ImageNet templates.")
    g.add_argument("--retrieval-file", default=None, metavar="FILE",
                   help="retrieval annotations: JSONL of {\"image\": path, \"captions\": [...]}, or a "
                        "Karpathy test JSON for mscoco/flickr30k")
    g.add_argument("--caption-prefix", default=None,
                   help="text put before every retrieval caption (default: 'a photo of ' for "
                        "mscoco/flickr30k as the original, nothing for JSONL)")
    g.add_argument("--caltech101-split", default="original", choices=("original", "all"),
                   help="caltech101: the original's random 3000/5677 split with seed 3072 "
                        "(evaluates the 5677) or all 8677 images")
    g.add_argument("--task", default="zeroshot_classification",
                   choices=("zeroshot_classification", "zeroshot_retrieval"),
                   help="task for sets that do not imply one (mscoco/flickr30k/jsonl are always "
                        "retrieval)")

    g = p.add_argument_group("run")
    g.add_argument("--batch-size", type=int, default=64, help="images per batch and rank (default 64)")
    g.add_argument("--text-batch-size", type=int, default=256,
                   help="prompts/captions per text batch (default 256)")
    g.add_argument("--workers", type=int, default=2, help="data loader worker processes (default 2)")
    g.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16", "tf32"),
                   help="autocast dtype for the encoders (features and logits are float32 either "
                        "way); tf32 = fp32 with TF32 matmuls on CUDA")
    g.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda if available; under torchrun each rank "
                        "uses cuda:LOCAL_RANK)")
    g.add_argument("--output-dir", default="eval_results", metavar="DIR",
                   help="where <dataset>_<task>.json files go (CLIP_benchmark shape). The score "
                        "line is appended to DIR/zero_shot_scores.txt. An argument ending in .txt is "
                        "read as the original's score file and the JSONs go beside it.")
    g.add_argument("--score-file", default=None, metavar="TXT",
                   help="text file to append the original's comma-separated score line to")

    g = p.add_argument_group(
        "original script flags",
        "accepted so shell/test_zero_shot_*.sh of the original run unchanged; architecture flags "
        "override the config (on top of the original's defaults when no --config is given)")
    for flag, typ in (("--input-size", int), ("--image-depth", int), ("--image-embed-dims", int),
                      ("--image-patch-size", int), ("--image-hidden-rate", int),
                      ("--image-num-heads", int), ("--image-output-cls-token", _bool),
                      ("--image-with-cls-token", _bool), ("--ctx-len", int), ("--vocab-size", int),
                      ("--text-initialization", _bool), ("--head-size", int),
                      ("--text-num-head", int), ("--head-size-divisor", int), ("--n-layer", int),
                      ("--n-embd", int), ("--dim-att", int), ("--dim-ffn", int), ("--pos-emb", int),
                      ("--head-qk", int), ("--tiny-att-dim", int), ("--tiny-att-layer", int),
                      ("--dropout", float)):
        g.add_argument(flag, type=typ, default=None, help="model config field " +
                       flag[2:].replace("-", "_"))
    for flag in ("--model-type", "--start-epoch", "--end-epoch", "--dataset-type", "--data-type",
                 "--pre-ffn"):
        g.add_argument(flag, default=None, help="accepted and ignored (unused by the original)")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.batch_size < 1 or opts.text_batch_size < 1 or opts.workers < 0:
        parser.error("--batch-size and --text-batch-size must be >= 1, --workers >= 0")

    from rwkv_clip.config import ConfigError
    from rwkv_clip.eval.datasets import EvalError
    from rwkv_clip.eval.runner import run
    from rwkv_clip.model import CheckpointError
    from rwkv_clip.ops import WKVError

    try:
        run(opts)
    except (EvalError, ConfigError, CheckpointError, WKVError) as exc:
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"zero_shot.py: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
