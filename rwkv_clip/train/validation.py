"""Validation during training: the contrastive loss and retrieval ranks on held-out pairs.

Every ``--val-frequency`` epochs the model, in eval mode and without augmentation, encodes
the ``--val-data`` pairs with their raw caption; metrics are open_clip's ``evaluate``
(``clip_val_loss``, :func:`clip_metrics`; docs/linear-probe-and-validation.md).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..distributed import DistInfo
from .accumulation import caption_length

VAL_CAPTION = 0  # the raw caption
RESULTS_NAME = "results.jsonl"
RECALL_KS = (1, 5, 10)


def ranks(logits: torch.Tensor) -> torch.Tensor:
    """0-based rank of the diagonal entry in each row of a square score matrix, sorting
    descending with ties broken by column index."""
    order = torch.argsort(logits, dim=1, descending=True, stable=True)
    truth = torch.arange(logits.shape[0]).view(-1, 1)
    return (order == truth).nonzero()[:, 1]


def clip_metrics(image_features: torch.Tensor, text_features: torch.Tensor,
                 logit_scale: float = 1.0) -> dict[str, float]:
    """open_clip's ``get_clip_metrics``: ``{image_to_text,text_to_image}_{mean_rank,
    median_rank,R@1,R@5,R@10}`` (ranks 1-based, recalls fractions) against all pairs,
    pair i matching only caption i (ties: the lower index ranks first)."""
    logits = logit_scale * image_features.float() @ text_features.float().t()
    out: dict[str, float] = {}
    for name, scores in (("image_to_text", logits), ("text_to_image", logits.t())):
        r = ranks(scores.cpu()).numpy()
        out[f"{name}_mean_rank"] = float(r.mean() + 1)
        out[f"{name}_median_rank"] = float(np.floor(np.median(r)) + 1)
        for k in RECALL_KS:
            out[f"{name}_R@{k}"] = float(np.mean(r < k))
    return out


def batched_contrastive_loss(image_features: torch.Tensor, text_features: torch.Tensor,
                             logit_scale: float, batch_size: int) -> float:
    """Mean symmetric InfoNCE over consecutive batches of ``batch_size`` pairs."""
    total, n = 0.0, image_features.shape[0]
    for start in range(0, n, batch_size):
        img = image_features[start:start + batch_size].float()
        txt = text_features[start:start + batch_size].float()
        logits = logit_scale * img @ txt.t()
        labels = torch.arange(img.shape[0])
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        total += loss.item() * img.shape[0]
    return total / n


def build_val_loader(val_data: str, data_format: str, args, info: DistInfo, log=None):
    """The held-out pairs as an eval loader (PyTorch, in order, this rank's contiguous
    shard, partial last batch)."""
    from ..data import build_eval_loader

    return build_eval_loader(
        args, data=val_data, data_format=data_format, log=log, loader="torch",
        rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
        device=str(info.device), batch_size=args.batch_size, input_size=args.input_size,
        caption_tokens=None)


@torch.no_grad()
def evaluate_pairs(model, loader, info: DistInfo, precision: str, batch_size: int
                   ) -> dict[str, float]:
    """Encode this rank's shard, gather all features, return the loss and rank metrics."""
    from ..eval.distributed import fail_together, gather_rows
    from ..eval.zeroshot import unwrap_model
    from ..precision import get_precision
    from ..tokenizer import fit_context_length

    model = unwrap_model(model)
    autocast = get_precision(precision, info.device).autocast
    ctx_len = model.text_model.args.ctx_len
    was_training = model.training
    model.eval()
    images, texts = [], []
    try:
        with fail_together(info):
            for batch_images, tokens in loader:
                length = caption_length(tokens.shape[1], ctx_len)
                caption = tokens[:, VAL_CAPTION * length:(VAL_CAPTION + 1) * length]
                caption = fit_context_length(caption.long(), ctx_len).to(info.device)
                with autocast():
                    img = model.encode_image(batch_images.to(info.device))
                    txt = model.encode_text(caption)
                images.append(F.normalize(img.float(), dim=-1).cpu())
                texts.append(F.normalize(txt.float(), dim=-1).cpu())
        scale = float(model.logit_scale.exp().item())
    finally:
        model.train(was_training)
    width = model.image_model.embed_dims
    img = torch.cat(images) if images else torch.zeros(0, width)
    txt = torch.cat(texts) if texts else torch.zeros(0, width)
    # this rank's samples are a contiguous run; rank r's rows go after rank r-1's
    order = torch.arange(img.shape[0]) + info.rank * (1 << 40)
    img, txt = gather_rows(order, img, txt, info=info)
    metrics = {"clip_val_loss": batched_contrastive_loss(img, txt, scale, batch_size)}
    metrics.update(clip_metrics(img, txt, scale))
    metrics["num_samples"] = int(img.shape[0])
    return metrics


def describe(metrics: dict) -> str:
    """The log line's numbers."""
    i2t = "/".join(f"{100 * metrics[f'image_to_text_R@{k}']:.1f}" for k in RECALL_KS)
    t2i = "/".join(f"{100 * metrics[f'text_to_image_R@{k}']:.1f}" for k in RECALL_KS)
    return (f"loss {metrics['clip_val_loss']:.4f}, image->text R@1/5/10 {i2t}% "
            f"(mean rank {metrics['image_to_text_mean_rank']:.1f}, median "
            f"{metrics['image_to_text_median_rank']:.0f}), text->image R@1/5/10 {t2i}% "
            f"(mean rank {metrics['text_to_image_mean_rank']:.1f}, median "
            f"{metrics['text_to_image_median_rank']:.0f}), {metrics['num_samples']} pairs")


def board_scalars(metrics: dict) -> dict[str, float]:
    """TensorBoard / wandb names: ``val/clip_val_loss``, ``val/image_to_text_R@1``..."""
    return {f"val/{k}": v for k, v in metrics.items() if k != "num_samples"}


def append_result(output: str | os.PathLike, record: dict) -> Path:
    """Append one JSON line to ``OUTPUT/results.jsonl`` (open_clip's results file)."""
    path = Path(output) / RESULTS_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return path


def read_results(output: str | os.PathLike) -> list[dict]:
    """The validation records of the run's last fresh start and its resumes (each record
    carries the step its process started from: 0 for a fresh run)."""
    path = Path(output) / RESULTS_NAME
    if not path.is_file():
        return []
    records: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if "clip_val_loss" not in rec:
                continue
            start = rec.get("start_step", 0)
            if start:  # a resumed process: what the interrupted one logged later is replaced
                records = [r for r in records
                           if r.get("step", 0) <= start or r.get("start_step", 0) == start]
            elif records and rec.get("step", 0) <= records[-1].get("step", 0):
                records = []  # a fresh run in the same folder
            records.append(rec)
    return records


# ----------------------------------------------------------------------------- flags, loop

def add_validation_flags(p) -> None:
    g = p.add_argument_group("validation during training (open_clip's flags)")
    g.add_argument("--val-data", default=None, metavar="DATA",
                   help="held-out image-text pairs in any training format (rec prefix, wds "
                        "shards, parquet files; 'builtin': the built-in held-out pairs). "
                        "Default: the built-in held-out pairs with --data-format builtin, "
                        "else none")
    g.add_argument("--val-data-format", choices=("rec", "wds", "parquet"), default=None,
                   help="format of --val-data (default: inferred as for --train-data)")
    g.add_argument("--val-frequency", type=int, default=1, metavar="N",
                   help="validate every N epochs and after the last step (0: only after the "
                        "last step): contrastive loss and image<->text R@1/5/10, mean and "
                        "median rank on the held-out pairs")


def infer_format(data: str) -> str:
    if ".parquet" in data:
        return "parquet"
    if ".tar" in data or "{" in data:
        return "wds"
    return "rec"


def resolve_validation(args) -> None:
    from ..errors import TrainArgsError

    if getattr(args, "val_frequency", 1) < 0:
        raise TrainArgsError(f"--val-frequency must be >= 0 (0: only at the end), got "
                             f"{args.val_frequency}")


class Validator:
    """Runs :func:`evaluate_pairs` when due, logs the line, the scalars and the JSON line."""

    def __init__(self, args, info: DistInfo, log, trackers, start_step: int = 0) -> None:
        self.args, self.info, self.log, self.trackers = args, info, log, trackers
        self.start_step = start_step
        self.history: list[dict] = []
        self.last_step: int | None = None
        self.loader, self.name = None, None
        data, fmt = getattr(args, "val_data", None), getattr(args, "val_data_format", None)
        if (data is None and args.data_format == "builtin") or data == "builtin":
            from ..data import ensure_builtin_dataset
            data, fmt = ensure_builtin_dataset(root=args.builtin_root).val_prefix, "rec"
        if data is None:
            return
        fmt = fmt or infer_format(data)
        self.name = data
        self.loader = build_val_loader(data, fmt, args, info, log=None)
        if info.is_master:
            log.info(f"validation: {self.loader.num_samples} held-out pairs in {data} "
                     f"(raw captions), every {args.val_frequency or 'last'} epoch(s)")

    def due(self, epoch: int) -> bool:
        freq = self.args.val_frequency
        return self.loader is not None and bool(freq) and epoch % freq == 0

    def run(self, model, step: int, epoch: int, tag: str) -> dict:
        metrics = evaluate_pairs(model, self.loader, self.info, self.args.precision,
                                 self.args.batch_size)
        self.last_step = step
        record = {"epoch": epoch, "step": step, "start_step": self.start_step, **metrics}
        self.history.append(record)
        if self.info.is_master:
            self.log.info(f"validation ({tag}) on {self.name}: {describe(metrics)}")
            self.trackers.scalars(step, **board_scalars(metrics))
            append_result(self.args.output, record)
        return metrics

    def finish(self, model, step: int, epoch: int) -> None:
        """Validate the final weights unless the last validation saw them."""
        if self.loader is not None and self.last_step != step:
            self.run(model, step, epoch, "final")


def plot_validation(loss_ax, recall_ax, records: list[dict]) -> None:
    """The validation loss on the training-loss axes, R@1/5/10 both ways on their own."""
    steps = [r["step"] for r in records]
    loss_ax.plot(steps, [r["clip_val_loss"] for r in records], "o-", color="tab:red",
                 label="validation (held-out pairs)")
    loss_ax.set_title("training loss (interval means) and validation loss")
    loss_ax.legend(loc="upper right")
    styles = {1: "o-", 5: "s--", 10: "^:"}
    for name, color in (("image_to_text", "tab:blue"), ("text_to_image", "tab:green")):
        arrow = name.replace("_to_", "->")
        for k in RECALL_KS:
            recall_ax.plot(steps, [100 * r[f"{name}_R@{k}"] for r in records], styles[k],
                           color=color, alpha=1.0 if k == 1 else 0.6, label=f"{arrow} R@{k}")
    last = records[-1]
    recall_ax.set(title=f"validation retrieval recall ({last['num_samples']} pairs)",
                  xlabel="optimizer step", ylabel="recall (%)", ylim=(0, 100))
    recall_ax.grid(alpha=0.3)
    recall_ax.legend(loc="upper left", fontsize=7, ncol=2)
