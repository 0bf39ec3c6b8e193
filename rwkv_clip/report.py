"""A one-page picture of a training run: ``RUN_DIR/report.png`` (panels: :func:`draw_report`).

Everything comes from the run folder (``training.log``, ``results.jsonl``,
``predictions.json``, else the newest checkpoint), so ``python -m rwkv_clip.report
runs/default`` redraws it at any time.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .distributed import model_device
from .errors import ConfigError, EvalError, OneLineArgumentParser, run_cli

REPORT_NAME = "report.png"
PREDICTIONS_NAME = "predictions.json"
MAX_CONFUSION_CLASSES = 40
GRID_IMAGES = 16

_PLAIN_STEP = re.compile(r"step (\d+)/(\d+) loss (\S+) lr (\S+)")
_ORIGINAL_STEP = re.compile(r"lr:\[(\S+)\] step:(\d+) .*\[(\S+)\]\s*$")
_ZERO_SHOT = re.compile(r"zero-shot \((.+?)\) on (.+): top-1 ([\d.]+)%(?:, top-5 ([\d.]+)%)?")
SHIFTED_SUFFIX = ", shifted"  # the label of an evaluation on the shifted split
_STEPS = re.compile(r"(\d+) optimizer steps/epoch, (\d+) steps in all")
_RUN_START = re.compile(r"rank \d+/\d+ on ")
_RESUMED = re.compile(r"resumed from .*: step (\d+)")
_SCHEDULE = re.compile(r"learning rate: (\w+) schedule, peak (\S+), warmup (\S+), (\d+) steps")


@dataclass
class TrainingCurves:
    """What ``training.log`` says about one run (the last fresh start and its resumes)."""
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    # (step, label, top-1 %, top-5 % or None)
    zero_shot: list[tuple[int, str, float, float | None]] = field(default_factory=list)
    zero_shot_shifted: list[tuple[int, str, float, float | None]] = field(default_factory=list)
    zero_shot_dir: str | None = None
    steps_per_epoch: int | None = None
    total_steps: int | None = None
    schedule: dict | None = None  # lr_at's keywords, from the run's "learning rate:" line

    def lr_curve(self) -> tuple[list[int], list[float]]:
        """(steps, lr) at every step up to the last logged one, exact from the schedule
        where the log states it, else the logged (rounded) values."""
        if self.schedule is None or not self.steps:
            return self.steps, self.lr
        from .train.schedule import lr_at
        steps = list(range(1, self.steps[-1] + 1))
        total = self.schedule["total_steps"]
        return steps, [lr_at(min(s, total - 1), **self.schedule)[0] for s in steps]


def parse_training_log(path: str | os.PathLike) -> TrainingCurves:
    """Read the progress and zero-shot lines of a ``training.log`` (both ``--log-format``
    styles; a log that holds several runs in the same folder is read from the last fresh
    start, resumes included)."""
    curves = TrainingCurves()
    last_step = 0
    fresh = True  # the current process started a new run (no "resumed from")
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if _RUN_START.search(line):
                fresh = True
                continue
            if m := _RESUMED.search(line):
                fresh = False
                last_step = int(m.group(1))
                _drop_after(curves, last_step)
                continue
            if m := _SCHEDULE.search(line):
                curves.schedule = dict(kind=m.group(1), max_lr=float(m.group(2)),
                                       warmup=float(m.group(3)), total_steps=int(m.group(4)))
                continue
            if m := _STEPS.search(line):
                curves.steps_per_epoch, curves.total_steps = int(m.group(1)), int(m.group(2))
                continue
            if m := _PLAIN_STEP.search(line):
                step, loss, lr = int(m.group(1)), float(m.group(3)), float(m.group(4))
            elif m := _ORIGINAL_STEP.search(line):
                step, loss, lr = int(m.group(2)), float(m.group(3)), float(m.group(1))
            elif m := _ZERO_SHOT.search(line):
                label = m.group(1)
                top5 = float(m.group(4)) if m.group(4) else None
                shifted = label.endswith(SHIFTED_SUFFIX)
                if shifted:
                    label = label[:-len(SHIFTED_SUFFIX)]
                point = (_eval_step(label, last_step, curves), label, float(m.group(3)), top5)
                if shifted:
                    curves.zero_shot_shifted.append(point)
                else:
                    curves.zero_shot.append(point)
                    curves.zero_shot_dir = m.group(2)
                continue
            else:
                continue
            if fresh and curves.steps and step <= curves.steps[-1]:
                # a new run in the same folder: only its own curves count
                keep = curves.steps_per_epoch, curves.total_steps, curves.schedule
                curves = TrainingCurves(steps_per_epoch=keep[0], total_steps=keep[1],
                                        schedule=keep[2])
            fresh = False
            curves.steps.append(step)
            curves.loss.append(loss)
            curves.lr.append(lr)
            last_step = step
    return curves


def _eval_step(label: str, last_logged: int, curves: TrainingCurves) -> int:
    """The step an evaluation belongs to: "epoch N" ends at N x steps/epoch (progress
    lines come every --log-every steps, so the last one may be a few steps earlier)."""
    m = re.fullmatch(r"epoch (\d+)", label)
    if m and curves.steps_per_epoch:
        step = int(m.group(1)) * curves.steps_per_epoch
        return min(step, curves.total_steps) if curves.total_steps else step
    return last_logged


def _drop_after(curves: TrainingCurves, step: int) -> None:
    """A resume from ``step``: lines logged after it by the interrupted run are replaced."""
    keep = [i for i, s in enumerate(curves.steps) if s <= step]
    curves.steps = [curves.steps[i] for i in keep]
    curves.loss = [curves.loss[i] for i in keep]
    curves.lr = [curves.lr[i] for i in keep]
    curves.zero_shot = [z for z in curves.zero_shot if z[0] <= step]
    curves.zero_shot_shifted = [z for z in curves.zero_shot_shifted if z[0] <= step]


# ----------------------------------------------------------------------------- predictions

@torch.no_grad()
def compute_predictions(model, folder: str | os.PathLike, device: torch.device | str = "cpu",
                        batch_size: int = 128, precision: str = "fp32") -> dict[str, Any]:
    """Top-3 zero-shot predictions of ``model`` for every image of an image folder (with
    the folder's class names and templates), evaluated in this process alone."""
    from .checkpoint_files import unwrap_model
    from .distributed import DistInfo
    from .eval.datasets import image_folder_set
    from .eval.zeroshot import (
        build_classifier,
        class_probabilities,
        classification_logits,
        model_input_size,
    )
    from .transform import EvalTransform

    model = unwrap_model(model)
    device = torch.device(device)
    eval_set = image_folder_set(folder, EvalTransform(model_input_size(model)))
    was_training = model.training
    model.eval()
    try:
        classifier = build_classifier(model, eval_set.classnames, eval_set.templates, device,
                                      precision=precision)
        logits, targets = classification_logits(model, eval_set, classifier, device,
                                                batch_size=batch_size, precision=precision,
                                                info=DistInfo())
    finally:
        model.train(was_training)
    probs = class_probabilities(model, logits)
    top_p, top_i = probs.topk(min(3, probs.shape[1]), dim=-1)
    samples: list[dict[str, Any]] = [{"path": str(eval_set.describe(i)), "target": int(targets[i]),
                "top3": [int(c) for c in top_i[i]],
                "top3_prob": [round(float(p), 4) for p in top_p[i]]}
               for i in range(len(targets))]
    acc1 = sum(s["top3"][0] == s["target"] for s in samples) / max(len(samples), 1)
    return {"folder": str(folder), "classnames": list(eval_set.classnames),
            "acc1": acc1, "samples": samples}


def newest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckpt_dir = Path(run_dir) / "checkpoints"
    latest = ckpt_dir / "epoch_latest.pt"
    if latest.is_file():
        return latest
    files = sorted(ckpt_dir.glob("*.pt"), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def predictions_from_checkpoint(run_dir: str | os.PathLike, folder: str) -> dict[str, Any]:
    """Evaluate the run's newest checkpoint on ``folder`` (its settings chosen as
    ``zero_shot.py`` chooses them: the saved ones, on the config its shapes fit)."""
    from .checkpoint_files import read_checkpoint
    from .factory import build_model, choose_model_args

    ckpt = newest_checkpoint(run_dir)
    if ckpt is None:
        raise EvalError(f"{run_dir}: no {PREDICTIONS_NAME} and no checkpoint in "
                        f"{Path(run_dir) / 'checkpoints'} to compute the predictions from")
    weights = read_checkpoint(ckpt)
    try:
        args = choose_model_args(None, weights)[0]
    except ConfigError:
        raise EvalError(f"checkpoint {ckpt} matches none of the shipped model configs; the "
                        "picture needs its predictions: evaluate it with the training "
                        "config") from None
    model = build_model(args, weights)
    result = compute_predictions(model, folder)
    result["checkpoint"] = str(ckpt)
    return result


# ----------------------------------------------------------------------------- drawing

def confusion_matrix(predictions: dict[str, Any]) -> list[list[int]]:
    """counts[target][predicted top-1]."""
    n = len(predictions["classnames"])
    counts = [[0] * n for _ in range(n)]
    for s in predictions["samples"]:
        counts[s["target"]][s["top3"][0]] += 1
    return counts


def pick_grid_samples(predictions: dict[str, Any], k: int = GRID_IMAGES) -> list[dict]:
    """Up to ``k`` held-out images: mistakes first (at most half), then correct ones, each
    group spread evenly over the (class-ordered) set, in a fixed order."""
    samples = predictions["samples"]
    wrong = [s for s in samples if s["top3"][0] != s["target"]]
    right = [s for s in samples if s["top3"][0] == s["target"]]
    chosen = _spread(wrong, k // 2)
    return chosen + _spread(right, k - len(chosen))


def _spread(items: list, k: int) -> list:
    if k <= 0 or not items:
        return []
    if len(items) <= k:
        return list(items)
    return [items[i * len(items) // k] for i in range(k)]


def draw_report(curves: TrainingCurves, predictions: dict[str, Any] | None,
                out_path: str | os.PathLike, title: str = "",
                validation: list[dict] | None = None) -> Path:
    """Draw the panels into ``out_path`` (PNG) and return its path. ``validation``: the
    run's held-out records (``rwkv_clip.train.validation.read_results``), drawn on the
    loss panel and in a retrieval-recall panel.

    Panels: the training (and validation) loss and the learning rate against the optimizer
    step, the zero-shot top-1 (and top-5) accuracy of every evaluation, the validation
    retrieval recall, and, for an image folder of at most :data:`MAX_CONFUSION_CLASSES`
    classes, the confusion matrix of the held-out images and a grid of them with their
    top-3 predictions."""
    try:
        import matplotlib
    except ImportError:
        raise EvalError("drawing report.png needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg", force=True)  # no display needed; called only here
    import matplotlib.pyplot as plt
    from PIL import Image

    show_predictions = (predictions is not None
                        and len(predictions["classnames"]) <= MAX_CONFUSION_CLASSES)
    cols = 4 if validation else 3
    fig = plt.figure(figsize=(6 * cols, 12 if show_predictions else 5), dpi=80)
    rows = 2 if show_predictions else 1
    grid = fig.add_gridspec(rows, cols, height_ratios=[1, 2.2] if show_predictions else [1])

    # one point draws no line: mark it
    ax = loss_ax = fig.add_subplot(grid[0, 0])
    ax.plot(curves.steps, curves.loss, color="tab:blue",
            marker="o" if len(curves.steps) == 1 else None)
    ax.set(title="training loss (mean over each logged interval)", xlabel="optimizer step",
           ylabel="contrastive loss")
    ax.grid(alpha=0.3)
    ax = fig.add_subplot(grid[0, 1])
    lr_steps, lr = curves.lr_curve()
    ax.plot(lr_steps, lr, color="tab:orange", marker="o" if len(lr_steps) == 1 else None)
    ax.set(title="learning rate", xlabel="optimizer step", ylabel="lr")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.grid(alpha=0.3)
    ax = fig.add_subplot(grid[0, 2])
    _accuracy_panel(ax, curves)
    if validation:
        from .train.validation import plot_validation
        plot_validation(loss_ax, fig.add_subplot(grid[0, 3]), validation)

    if show_predictions:
        assert predictions is not None
        _confusion_panel(fig.add_subplot(grid[1, :cols - 1]), predictions)
        sub = grid[1, cols - 1].subgridspec(4, 4, hspace=0.55, wspace=0.1)
        names = predictions["classnames"]
        for i, s in enumerate(pick_grid_samples(predictions)):
            ax = fig.add_subplot(sub[i // 4, i % 4])
            with Image.open(s["path"]) as im:
                ax.imshow(im.convert("RGB"))
            ax.set_xticks([])
            ax.set_yticks([])
            ok = s["top3"][0] == s["target"]
            lines = [f"{names[c]} {100 * p:.0f}%"
                     for c, p in zip(s["top3"], s["top3_prob"], strict=True)]
            ax.set_title("\n".join(lines), fontsize=7, color="darkgreen" if ok else "crimson")
            ax.set_xlabel(f"true: {names[s['target']]}", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


def _accuracy_panel(ax, curves: TrainingCurves) -> None:
    """Top-1 / top-5 per evaluation; the built-in set's shifted split beside them."""
    shifted = curves.zero_shot_shifted
    ax.set(title="zero-shot accuracy on the held-out split" + ("s" if shifted else ""),
           xlabel="optimizer step", ylabel="accuracy (%)", ylim=(0, 100))
    ax.grid(alpha=0.3)
    if not curves.zero_shot:
        ax.text(0.5, 0.5, "no zero-shot evaluation logged", ha="center", va="center",
                transform=ax.transAxes)
        return
    xs = [z[0] for z in curves.zero_shot]
    ax.set_xlim(0, max([curves.total_steps or 0, *xs, *curves.steps]) * 1.03 + 1)
    # the higher final value is labelled above its point, the lower one below, so that
    # close finals do not overlap
    upper = shifted if shifted and shifted[-1][2] > curves.zero_shot[-1][2] else curves.zero_shot
    for points, name, colour in ((curves.zero_shot, "", "tab:blue"),
                                 (shifted, "shifted ", "tab:red")):
        if not points:
            continue
        offset = 8 if shifted and points is upper else -16
        px = [z[0] for z in points]
        ax.plot(px, [z[2] for z in points], "o-", color=colour, label=f"{name}top-1")
        if all(z[3] is not None for z in points):
            ax.plot(px, [z[3] for z in points], "s--", color=colour, alpha=0.45,
                    label=f"{name}top-5")
        last = points[-1]
        ax.annotate(f"{name}{last[2]:.1f}%", (last[0], last[2]), textcoords="offset points",
                    xytext=(-10, offset), ha="right", color=colour)
    ax.legend(loc="lower right" if shifted else "upper left", fontsize=8)


def _confusion_panel(ax, predictions: dict[str, Any]) -> None:
    names = predictions["classnames"]
    counts = confusion_matrix(predictions)
    n = len(names)
    ax.imshow(counts, cmap="Blues")
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_xticklabels(names, rotation=90, fontsize=7)
    ax.set_yticklabels(names, fontsize=7)
    ax.set(xlabel="predicted (top-1)", ylabel="true class")
    top = max(max(row) for row in counts) or 1
    for t in range(n):
        for p in range(n):
            if counts[t][p]:
                ax.text(p, t, str(counts[t][p]), ha="center", va="center", fontsize=6,
                        color="white" if counts[t][p] > top / 2 else "black")
    total = len(predictions["samples"])
    correct = sum(counts[i][i] for i in range(n))
    ax.set_title(f"held-out confusion matrix: {correct}/{total} correct "
                 f"({100 * correct / max(total, 1):.1f}% top-1)")


# ----------------------------------------------------------------------------- entry points

def write_report(run_dir: str | os.PathLike, model=None, zero_shot_dir: str | None = None,
                 out_path: str | os.PathLike | None = None, recompute: bool = False) -> Path:
    """Draw ``RUN_DIR/report.png`` (or ``out_path``) from the run's log and predictions.

    With ``model`` (end of training) the predictions are computed from it on
    ``zero_shot_dir`` and saved to ``predictions.json``; without, they are read from that
    file (unless ``recompute``), else computed from the newest checkpoint. No zero-shot
    folder: curves only. ``predictions.json`` holds every held-out image's label and top-3
    classes with their probabilities."""
    run_dir = Path(run_dir)
    log_path = run_dir / "training.log"
    if not log_path.is_file():
        raise EvalError(f"{run_dir}: no training.log (expected a folder written by train.py "
                        "--output)")
    curves = parse_training_log(log_path)
    folder = zero_shot_dir or curves.zero_shot_dir
    pred_path = run_dir / PREDICTIONS_NAME
    predictions = None
    if model is not None and folder:
        predictions = compute_predictions(model, folder, model_device(model))
    elif pred_path.is_file() and not recompute:
        with open(pred_path) as f:
            predictions = json.load(f)
    elif folder:
        if not Path(folder).is_dir():
            raise EvalError(f"zero-shot folder {folder} (from {log_path}) does not exist; "
                            "pass --zero-shot-data DIR")
        predictions = predictions_from_checkpoint(run_dir, folder)
    if predictions is not None and (model is not None or recompute
                                    or not pred_path.is_file()):
        tmp = pred_path.with_suffix(".json.tmp")
        with open(tmp, "w") as f:
            json.dump(predictions, f, indent=1)
        os.replace(tmp, pred_path)
    from .train.validation import read_results

    validation = read_results(run_dir)
    title = f"{run_dir.name}: {curves.steps[-1] if curves.steps else 0} steps"
    if curves.zero_shot:
        title += f", zero-shot top-1 {curves.zero_shot[-1][2]:.1f}%"
    if curves.zero_shot_shifted:
        title += f" (shifted split {curves.zero_shot_shifted[-1][2]:.1f}%)"
    if validation:
        title += f", validation loss {validation[-1]['clip_val_loss']:.3f}"
    return draw_report(curves, predictions, out_path or run_dir / REPORT_NAME, title,
                       validation)




def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineArgumentParser(prog="python -m rwkv_clip.report",
                                description="Redraw RUN_DIR/report.png from the run's "
                                            "training.log and predictions.")
    p.add_argument("run_dir", help="a train.py --output folder (e.g. runs/default)")
    p.add_argument("--zero-shot-data", default=None, metavar="DIR",
                   help="image folder to predict on when predictions.json is missing "
                        "(default: the folder named in the log)")
    p.add_argument("--output", default=None, metavar="PNG",
                   help="where to write the picture (default: RUN_DIR/report.png)")
    opts = p.parse_args(argv)
    path = write_report(opts.run_dir, zero_shot_dir=opts.zero_shot_data, out_path=opts.output,
                        recompute=bool(opts.zero_shot_data))
    print(f"report: {path}")
    return 0


def _cli() -> int:
    return run_cli(main, prog="python -m rwkv_clip.report")


if __name__ == "__main__":
    raise SystemExit(_cli())

