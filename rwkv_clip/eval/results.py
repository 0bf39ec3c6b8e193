"""Result records and reports: one CLIP_benchmark-shaped JSON per set (metric values as
fractions, run facts at the top level), a summary table on stdout in the paper's layout,
and the original's comma-separated line of percentages appended to a text file.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

DEFAULT_OUTPUT_DIR = "eval_results"  # the folder's name; where: runner.default_output_dir
TASKS = ("zeroshot_classification", "zeroshot_retrieval", "linear_probe")
REQUIRED_KEYS = ("dataset", "model", "pretrained", "task", "metrics")
# Keys of an evaluate_* result that describe the run rather than measure the model: they go
# to the top level of the record so that "metrics" holds only CLIP_benchmark's numbers.
INFO_KEYS = ("headline_metric", "headline", "num_samples", "num_images", "num_texts",
             "num_train")


def result_record(dataset: str, model: str, pretrained: str, task: str, results: dict,
                  **extra) -> dict:
    """A CLIP_benchmark record from the flat dict of ``evaluate_classification`` /
    ``evaluate_retrieval``."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    metrics = {k: v for k, v in results.items() if k not in INFO_KEYS}
    record = {"dataset": dataset, "model": model, "pretrained": pretrained, "task": task,
              "metrics": metrics, "language": "en"}
    record.update({k: results[k] for k in INFO_KEYS if k in results})
    for key, value in extra.items():
        if key not in record:
            record[key] = value
    return record


def validate_record(record: dict) -> None:
    """Raise ValueError unless ``record`` has CLIP_benchmark's keys and finite numbers."""
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        raise ValueError(f"result record lacks {missing}")
    if record["task"] not in TASKS:
        raise ValueError(f"unknown task {record['task']!r}")
    for key, value in record["metrics"].items():
        if value is None:  # acc5 with fewer than 5 classes, as CLIP_benchmark
            continue
        not_a_number = isinstance(value, bool) or not isinstance(value, (int, float))
        if not_a_number or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"metric {key} = {value!r} is not a finite number")


def result_path(output_dir: str | os.PathLike, dataset: str, task: str) -> Path:
    return Path(output_dir) / f"{dataset}_{task}.json"


def keep_earlier(path: Path) -> Path | None:
    """Move an existing result file at ``path`` aside to ``STEM.N.json`` (the lowest free
    N from 1), so that a new run never overwrites an earlier one's figures; returns where it
    went (None when there was nothing). ``STEM.N.json`` does not match ``*_TASK.json``."""
    if not path.exists():
        return None
    n = 1
    while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    os.replace(path, kept)
    return kept


def write_result(record: dict, output_dir: str | os.PathLike) -> Path:
    """Write ``record`` to ``OUTPUT_DIR/<dataset>_<task>.json``; an earlier run's file
    there is kept as ``<dataset>_<task>.N.json`` (:func:`keep_earlier`)."""
    validate_record(record)
    path = result_path(output_dir, record["dataset"], record["task"])
    path.parent.mkdir(parents=True, exist_ok=True)
    keep_earlier(path)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def headline(record: dict) -> float:
    """The paper's metric of a classification record (``headline_metric``, else acc1)."""
    return record["metrics"][record.get("headline_metric", "acc1")]


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def classification_table(records: Sequence[dict]) -> str:
    rows = [("dataset", "samples", "acc1", "acc5", "mean-per-class", "paper metric")]
    for r in records:
        m = r["metrics"]
        label = "mpc" if r.get("headline_metric") == "mean_per_class_recall" else "acc1"
        rows.append((r["dataset"], str(r.get("num_samples", "")), _pct(m["acc1"]), _pct(m.get("acc5")),
                     _pct(m["mean_per_class_recall"]), f"{_pct(headline(r))} ({label})"))
    if len(records) > 1:
        mean = sum(headline(r) for r in records) / len(records)
        rows.append((f"mean of {len(records)}", "", "", "", "", _pct(mean)))
    return _format(rows)


def retrieval_table(records: Sequence[dict]) -> str:
    rows = [("dataset", "images", "texts", "I2T R@1", "R@5", "R@10", "T2I R@1", "R@5", "R@10")]
    for r in records:
        m = r["metrics"]
        rows.append((r["dataset"], str(r.get("num_images", "")), str(r.get("num_texts", "")),
                     *(_pct(m.get(f"text_retrieval_recall@{k}")) for k in (1, 5, 10)),
                     *(_pct(m.get(f"image_retrieval_recall@{k}")) for k in (1, 5, 10))))
    return _format(rows)


def linear_probe_table(records: Sequence[dict]) -> str:
    rows = [("dataset", "train", "test", "acc1", "acc5", "mean-per-class", "C")]
    for r in records:
        m = r["metrics"]
        rows.append((r["dataset"], str(r.get("num_train", "")), str(r.get("num_samples", "")),
                     _pct(m["lp_acc1"]), _pct(m.get("lp_acc5")),
                     _pct(m["lp_mean_per_class_recall"]), f"{m['C']:.3g}"))
    return _format(rows)


def _format(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def summary(records: Iterable[dict]) -> str:
    records = list(records)
    parts = []
    cls = [r for r in records if r["task"] == "zeroshot_classification"]
    ret = [r for r in records if r["task"] == "zeroshot_retrieval"]
    if cls:
        parts.append("Zero-shot classification (%)\n" + classification_table(cls))
    if ret:
        parts.append("Zero-shot retrieval (%)\n" + retrieval_table(ret))
    probe = [r for r in records if r["task"] == "linear_probe"]
    if probe:
        parts.append("Linear probe (%)\n" + linear_probe_table(probe))
    return "\n\n".join(parts)


def score_line(records: Iterable[dict]) -> str:
    """The original's line: 100 x the paper metric of each classification set, comma
    separated (linear probe: its top-1); for retrieval sets I2T R@1,5,10 then T2I R@1,5,10 of each set."""
    values: list[float] = []
    for r in records:
        m = r["metrics"]
        if r["task"] == "zeroshot_classification":
            values.append(headline(r))
        elif r["task"] == "linear_probe":
            values.append(m["lp_acc1"])
        else:
            values.extend(m[f"text_retrieval_recall@{k}"] for k in (1, 5, 10))
            values.extend(m[f"image_retrieval_recall@{k}"] for k in (1, 5, 10))
    return ",".join(f"{100 * v:.4f}" for v in values)


def append_score_line(path: str | os.PathLike, records: Iterable[dict]) -> str:
    line = score_line(records)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(line + "\n")
    return line
