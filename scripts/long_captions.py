#!/usr/bin/env python
"""The long-caption job: what reading past 77 tokens gains, on the built-in long-caption
split (rwkv_clip/data/builtin_long.py: scenes described in 80-120 tokens, the background
named past token 77).

For each seed it trains the small config on the split at --ctx-len 128 (whole captions),
then scores the same model on the split's evaluation groups (images that differ only in
the background, captions that differ only past token 77) reading each caption whole and
cut to 77 tokens, and prints one JSON document (also written to --output):

  python scripts/long_captions.py --seeds 0,1 --output docs/results/long_captions.json
"""

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rwkv_clip.errors import TrainArgsError, run_cli

SHORT = 77


def seeds_list(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}"
                                         ) from None
    if not seeds:
        raise argparse.ArgumentTypeError("expected at least one seed")
    return seeds


def finished_run(path: str, argv: list[str]):
    """(model, steps, train seconds, last loss) of a finished run's last checkpoint, which
    must have been trained with the same command line; the seconds and loss from its log."""
    import re

    import torch

    from rwkv_clip.factory import build_model
    from rwkv_clip.pretrained import load_weights
    from rwkv_clip.train import parse_args

    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    want = vars(parse_args(argv))
    differ = [k for k in ("seed", "epochs", "batch_size", "train_data", "lr")
              if ckpt["args"].get(k) != want.get(k)]
    if differ:
        raise TrainArgsError(f"--reuse: {path} was trained with other {', '.join(differ)}; "
                             "remove it or drop --reuse")
    model = build_model(ckpt["model_config"], load_weights(path)).eval()
    log_text = open(os.path.join(os.path.dirname(os.path.dirname(path)), "training.log")).read()
    done = re.findall(r"done: \d+ steps in ([\d.]+) min, last loss ([\d.]+)", log_text)
    minutes, loss = (float(done[-1][0]), float(done[-1][1])) if done else (float("nan"), None)
    return model, int(ckpt["step"]), 60 * minutes, loss


def run_seed(seed: int, a, data, log) -> dict:
    from rwkv_clip.data.builtin_long import CONTEXT_LENGTH
    from rwkv_clip.eval.long_captions import evaluate_groups, read_group_file
    from rwkv_clip.train import main, parse_args

    out = os.path.join(a.runs, f"seed{seed}")
    argv = ["--config", a.config, "--ctx-len", str(CONTEXT_LENGTH), "--train-data",
            data.train_prefix, "--data-format", "rec", "--output", out, "--seed", str(seed),
            "--epochs", str(a.epochs), "--batch-size", str(a.batch_size), "--lr", str(a.lr),
            "--device", "cpu",
            "--loader", "torch", "--workers", str(a.workers), "--progress", "False",
            "--final-zero-shot", "False", "--report-to", "none", "--log-every", "16"]
    if a.max_steps:
        argv += ["--max-steps", str(a.max_steps)]
    final = os.path.join(out, "checkpoints", f"epoch_{a.epochs}.pt")
    if a.reuse and os.path.isfile(final):  # a finished run of these settings: scored again
        model, steps, seconds, loss = finished_run(final, argv)
    else:
        start = time.perf_counter()
        summary = main(parse_args(argv))
        seconds = time.perf_counter() - start
        model, steps, loss = summary["model"].eval(), summary["steps"], summary["last_loss"]
    scores = evaluate_groups(model, read_group_file(data.eval_file), (None, SHORT))
    log(f"seed {seed}: R@1 image->text full {scores['full']['image_to_text_R@1']:.3f}, "
        f"{SHORT} tokens {scores[f'{SHORT} tokens']['image_to_text_R@1']:.3f} "
        f"(chance {scores['full']['chance']:.3f}); trained in {seconds:.0f} s")
    return {"seed": seed, "steps": steps, "train_seconds": round(seconds, 1),
            "last_loss": loss, "ctx_len": model.text_model.args.ctx_len,
            "full": scores["full"], f"{SHORT}_tokens": scores[f"{SHORT} tokens"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=seeds_list, default=[0, 1], metavar="A,B,...",
                   help="training seeds, one model each (default 0,1)")
    p.add_argument("--config", default="RWKV_CLIP_small", help="model config (default small)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training scenes")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--num-train", type=int, default=8192, help="training scenes")
    p.add_argument("--num-groups", type=int, default=64,
                   help="evaluation groups (4 images each)")
    p.add_argument("--data-root", default=None,
                   help="where the split is generated (default $RWKV_CLIP_CACHE or "
                        "~/.cache/rwkv_clip)")
    p.add_argument("--runs", default="runs/long_captions", help="training output folder")
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.add_argument("--reuse", action="store_true",
                   help="score a seed's finished run in --runs again instead of retraining")
    a = p.parse_args(argv)
    if a.epochs < 1 or a.batch_size < 1 or a.num_train < a.batch_size or a.num_groups < 1:
        raise TrainArgsError("--epochs, --batch-size and --num-groups must be >= 1 and "
                             "--num-train at least one batch")
    if not a.lr > 0:
        raise TrainArgsError(f"--lr must be > 0, got {a.lr}")
    from rwkv_clip.data.builtin_long import GROUP, ensure_long_caption_dataset

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    data = ensure_long_caption_dataset(a.data_root, num_train=a.num_train,
                                       num_groups=a.num_groups)
    runs = [run_seed(s, a, data, log) for s in a.seeds]
    doc = {
        "what": "built-in long-caption split: group R@1 of one model reading captions whole "
                f"vs cut to {SHORT} tokens (groups of {GROUP} differ only past token 77)",
        "command": "python scripts/long_captions.py " + " ".join(argv if argv is not None
                                                                 else sys.argv[1:]),
        "config": a.config, "epochs": a.epochs, "batch_size": a.batch_size,
        "num_train": a.num_train, "eval_pairs": a.num_groups * GROUP,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s)", "runs": runs,
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if a.output:
        with open(a.output, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="long_captions.py"))
