"""Hugging Face Hub folders: write one (weights, configs, model card), load one back, push it.

A folder holds ``model.safetensors`` (the original's key names and dtypes), the model and
preprocess configs and a model card with the evaluation results (docs/export.md); it
loads as ``"hf-hub:ORG/NAME"`` or ``"local-dir:DIR"``. Written files have mode 0644.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .json_files import read_json, read_json_object
from .transform import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

WEIGHTS_FILE = "model.safetensors"
MODEL_CONFIG_FILE = "model_config.json"
PREPROCESS_CONFIG_FILE = "preprocess_config.json"
CARD_FILE = "README.md"
HF_HUB_PREFIX = "hf-hub:"
LOCAL_DIR_PREFIX = "local-dir:"
FILE_MODE = 0o644
LIBRARY_NAME = "rwkv-clip"
DEFAULT_TAGS = ("clip", "rwkv", "rwkv-clip", "zero-shot-image-classification")
# CLIP_benchmark metric -> (model-index metric type, readable name)
METRIC_NAMES = {
    "acc1": ("accuracy", "top-1 accuracy"),
    "acc5": ("accuracy", "top-5 accuracy"),
    "mean_per_class_recall": ("recall", "mean per-class recall"),
    "text_retrieval_recall@1": ("recall", "image-to-text R@1"),
    "text_retrieval_recall@5": ("recall", "image-to-text R@5"),
    "text_retrieval_recall@10": ("recall", "image-to-text R@10"),
    "image_retrieval_recall@1": ("recall", "text-to-image R@1"),
    "image_retrieval_recall@5": ("recall", "text-to-image R@5"),
    "image_retrieval_recall@10": ("recall", "text-to-image R@10"),
}
TASK_TYPES = {"zeroshot_classification": "zero-shot-image-classification",
              "zeroshot_retrieval": "zero-shot-retrieval"}


# ------------------------------------------------------------------------------ files
def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` atomically, readable by others (0644)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, FILE_MODE)
    os.replace(tmp, path)
    return path


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2) + "\n")


def preprocess_config(size: int) -> dict[str, Any]:
    """The evaluation preprocessing of ``create_model_and_transforms`` (open_clip's
    ``preprocess_cfg`` keys): bicubic resize of the shorter side, centre crop, CLIP mean/std."""
    return {"size": int(size), "mode": "RGB", "mean": list(OPENAI_DATASET_MEAN),
            "std": list(OPENAI_DATASET_STD), "interpolation": "bicubic",
            "resize_mode": "shortest", "fill_color": 0}


def write_config_files(out: Path, model_config: Mapping[str, Any], size: int) -> dict[str, Path]:
    return {"model_config": write_json(out / MODEL_CONFIG_FILE, dict(model_config)),
            "preprocess_config": write_json(out / PREPROCESS_CONFIG_FILE,
                                            preprocess_config(size))}


def write_weights(state: Mapping[str, torch.Tensor], path: Path,
                  settings: Mapping[str, Any] | None = None) -> Path:
    """``state`` as safetensors at ``path`` (safetensors' own writer makes files 0600),
    recording the model ``settings`` in its header."""
    from .checkpoint_files import save_state_dict

    save_state_dict(dict(state), path, settings=dict(settings) if settings else None)
    os.chmod(path, FILE_MODE)
    return path


# ---------------------------------------------------------------------- eval results
def find_eval_results(checkpoint: str | os.PathLike) -> list[Path]:
    """CLIP_benchmark result files (``*_zeroshot_classification.json``,
    ``*_zeroshot_retrieval.json``) beside ``checkpoint``, or in its run folder when it sits
    in ``checkpoints/``, or in the ``eval_results/`` folder there (where ``zero_shot.py``
    writes them by default)."""
    from .eval.results import DEFAULT_OUTPUT_DIR

    path = Path(checkpoint)
    if not path.is_file():
        return []
    folders = [path.parent]
    if path.parent.name == "checkpoints":
        folders.append(path.parent.parent)
    folders += [folder / DEFAULT_OUTPUT_DIR for folder in folders]
    found: list[Path] = []
    for folder in folders:
        for task in TASK_TYPES:
            found.extend(sorted(folder.glob(f"*_{task}.json")))
    return found


def load_eval_results(paths: Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """CLIP_benchmark records (``rwkv_clip.eval.results``) from files, each holding one
    record or a list of them, or folders of such files."""
    records: list[dict[str, Any]] = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            files = [p for task in TASK_TYPES for p in sorted(path.glob(f"*_{task}.json"))]
            if not files:
                raise CheckpointError(f"evaluation results folder {path} holds no "
                                      "*_zeroshot_classification.json / *_zeroshot_retrieval.json")
            records.extend(load_eval_results(files))
            continue
        data = read_json(path, label="evaluation results ")
        for record in data if isinstance(data, list) else [data]:
            if not (isinstance(record, dict) and isinstance(record.get("metrics"), dict)
                    and "dataset" in record and record.get("task") in TASK_TYPES):
                raise CheckpointError(
                    f"evaluation results {path}: expected a zero_shot.py result record "
                    "({\"dataset\": ..., \"task\": \"zeroshot_classification\"|"
                    "\"zeroshot_retrieval\", \"metrics\": {...}}) or a list of them")
            records.append(record)
    return records


def eval_results_for_card(records: Sequence[Mapping[str, Any]]) -> list[Any]:
    """``huggingface_hub.EvalResult`` per metric of each record (values in percent)."""
    from huggingface_hub import EvalResult

    results = []
    for record in records:
        task = TASK_TYPES[record["task"]]
        for key, value in record["metrics"].items():
            if value is None or key not in METRIC_NAMES:
                continue
            kind, name = METRIC_NAMES[key]
            results.append(EvalResult(task_type=task, dataset_type=str(record["dataset"]),
                                      dataset_name=str(record["dataset"]), metric_type=kind,
                                      metric_name=name, metric_value=round(100 * float(value), 4)))
    return results


# ------------------------------------------------------------------------ model card
@dataclass
class CardInfo:
    """What a model card says besides the numbers."""

    name: str
    model_config: Mapping[str, Any]
    license: str = "mit"
    datasets: Sequence[str] = ()
    trained_on: str | None = None  # a sentence on the training data and schedule
    repo_id: str | None = None  # ORG/NAME, for the loading snippet
    parameters: int | None = None


def training_summary(run_args: Mapping[str, Any] | None) -> str | None:
    """A sentence on a training run from the ``args`` a training checkpoint holds."""
    if not run_args:
        return None
    data = run_args.get("train_data") or "?"
    if run_args.get("data_format") == "builtin":
        data = "the built-in synthetic shapes dataset (rwkv_clip.data.ensure_builtin_dataset)"
    parts = [f"Trained with `train.py` on {data}"]
    for key, label in (("epochs", "epochs"), ("max_steps", "max steps"),
                       ("batch_size", "batch size per rank"), ("lr", "learning rate"),
                       ("precision", "precision")):
        if run_args.get(key) not in (None, 0, ""):
            parts.append(f"{label} {run_args[key]}")
    return ", ".join(parts) + "."


def _count(n: Any, noun: str) -> str:
    """``1 block``, ``12 blocks``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def model_card(info: CardInfo, records: Sequence[Mapping[str, Any]]) -> str:
    """README.md text: YAML front matter (license, library_name, tags, datasets,
    model-index from ``records``) and a body on loading, training and the figures."""
    from huggingface_hub import ModelCardData

    data = ModelCardData(license=info.license, library_name=LIBRARY_NAME,
                         tags=list(DEFAULT_TAGS), datasets=list(info.datasets) or None,
                         pipeline_tag="zero-shot-image-classification",
                         model_name=info.name, eval_results=eval_results_for_card(records) or None)
    cfg = info.model_config
    where = f"hf-hub:{info.repo_id}" if info.repo_id else "local-dir:PATH/TO/THIS/FOLDER"
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {info.name}", "",
        "RWKV-CLIP (Gu et al., EMNLP 2024): a CLIP model whose image and text towers are "
        "bidirectional RWKV-6 stacks. Weights in the original's state-dict names "
        "(`model.safetensors`), the model config (`model_config.json`) and the "
        "preprocessing (`preprocess_config.json`).", "",
        "## How to load it", "",
        "```python",
        "import rwkv_clip",
        f'model, _, preprocess = rwkv_clip.create_model_and_transforms("{where}")',
        f'tokenizer = rwkv_clip.get_tokenizer("{where}")',
        "model.eval()",
        'probs = rwkv_clip.classify(model, images, ["cat", "dog"])  # CLIP templates',
        "```", "",
        "## Model", "",
        f"- image tower: {_count(cfg.get('image_depth'), 'block')}, width "
        f"{cfg.get('image_embed_dims')}, "
        f"patch {cfg.get('image_patch_size')}, input {cfg.get('input_size')} px",
        f"- text tower: {_count(cfg.get('n_layer'), 'block')}, width {cfg.get('n_embd')}, context "
        f"{cfg.get('ctx_len')} tokens",
    ]
    if info.parameters:
        lines.append(f"- {info.parameters:,} parameters")
    lines += ["", "## Training", "", info.trained_on or "Not recorded with these weights.", ""]
    lines += ["## Evaluation", ""]
    if records:
        lines += ["| dataset | task | metric | value (%) |", "|---|---|---|---|"]
        for record in records:
            for key, value in record["metrics"].items():
                if value is not None and key in METRIC_NAMES:
                    lines.append(f"| {record['dataset']} | {record['task']} | "
                                 f"{METRIC_NAMES[key][1]} | {100 * float(value):.2f} |")
    else:
        lines.append("No evaluation results were given with these weights.")
    lines.append("")
    return "\n".join(lines)


def write_hub_folder(state: Mapping[str, torch.Tensor], model_config: Mapping[str, Any],
                     out_dir: str | os.PathLike, info: CardInfo,
                     records: Sequence[Mapping[str, Any]] = ()) -> dict[str, Path]:
    """Write the weights, configs and model card into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from .config import MODEL_KEYS

    settings = {k: v for k, v in model_config.items() if k in MODEL_KEYS}
    written = {"weights": write_weights(state, out / WEIGHTS_FILE, settings)}
    written.update(write_config_files(out, model_config, int(model_config["input_size"])))
    written["model_card"] = write_text(out / CARD_FILE, model_card(info, records))
    return written


def card_records(checkpoint: str | os.PathLike,
                 eval_json: Sequence[str | os.PathLike] | None) -> list[dict[str, Any]]:
    """The evaluation records for a card: from ``eval_json`` if given, else the result
    files found beside ``checkpoint`` (:func:`find_eval_results`)."""
    return load_eval_results(eval_json if eval_json else find_eval_results(checkpoint))


def export_hub_folder(exported: Any, out: Path, opts: Any,
                      records: Sequence[Mapping[str, Any]]) -> int:
    """The ``--format hub`` command: the weights of ``exported``
    (:class:`rwkv_clip.export.ExportedWeights`), its model settings as the folder's config
    and a card with ``records``."""
    from .config import folder_config

    state, config = exported.state, exported.config
    params = folder_config(exported.args, config)
    info = CardInfo(name=opts.name or (opts.repo_id or "").split("/")[-1] or out.resolve().name,
                    model_config=params, license=opts.license, datasets=opts.datasets or (),
                    trained_on=training_summary(exported.run_args),
                    repo_id=opts.repo_id, parameters=sum(v.numel() for v in state.values()))
    write_hub_folder(state, params, out, info, records)
    figures = (", ".join(f"{r['dataset']} {r['task']}" for r in records) if records
               else "no evaluation results")
    print(f"wrote {out}: {WEIGHTS_FILE}, {MODEL_CONFIG_FILE}, {PREPROCESS_CONFIG_FILE}, "
          f"{CARD_FILE} (figures: {figures}; config {config}, context {params['ctx_len']} "
          f"tokens, images {params['input_size']} px)\nload it with "
          f"create_model_and_transforms(\"local-dir:{out}\")", flush=True)
    return 0


def push_to_hub(folder: str | os.PathLike, repo_id: str, *, private: bool = False,
                commit_message: str = "Add RWKV-CLIP model", token: str | None = None,
                revision: str | None = None) -> Any:
    """Upload an exported folder to the Hub repository ``repo_id`` (created if missing):
    ``huggingface_hub.create_repo`` + ``upload_folder``."""
    from huggingface_hub import create_repo, upload_folder

    folder = Path(folder)
    missing = [f for f in (WEIGHTS_FILE, MODEL_CONFIG_FILE, PREPROCESS_CONFIG_FILE, CARD_FILE)
               if not (folder / f).is_file()]
    if missing:
        raise CheckpointError(f"{folder} is not an exported Hub folder (missing {missing}); "
                              "write one with python -m rwkv_clip.export CHECKPOINT --format hub "
                              "--output DIR")
    create_repo(repo_id, private=private, exist_ok=True, token=token)
    return upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message,
                         token=token, revision=revision)


# --------------------------------------------------------------------------- loading
def is_folder_spec(name: str | os.PathLike) -> bool:
    """Whether a model name is ``hf-hub:ORG/NAME`` or ``local-dir:DIR``."""
    text = str(name)
    return text.startswith((HF_HUB_PREFIX, LOCAL_DIR_PREFIX))


def folder_file(spec: str, filename: str, *, revision: str | None = None,
                cache_dir: str | os.PathLike | None = None) -> Path:
    """``filename`` of the exported folder ``hf-hub:ORG/NAME[@REV]`` (through the Hub
    cache) or ``local-dir:DIR``."""
    from .pretrained import _split_revision, download_from_hub

    if spec.startswith(LOCAL_DIR_PREFIX):
        folder = Path(spec[len(LOCAL_DIR_PREFIX):]).expanduser()
        if not folder.is_dir():
            raise CheckpointError(f"{spec}: {folder} is not a folder")
        path = folder / filename
        if not path.is_file():
            raise CheckpointError(f"{spec}: {folder} has no {filename} (expected a folder "
                                  "written by python -m rwkv_clip.export CHECKPOINT --format "
                                  "hub --output DIR)")
        return path
    if not spec.startswith(HF_HUB_PREFIX):
        raise CheckpointError(f"model {spec!r}: expected hf-hub:ORG/NAME or local-dir:DIR")
    repo, rev = _split_revision(spec[len(HF_HUB_PREFIX):].strip("/"))
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise CheckpointError(f"model {spec!r}: expected hf-hub:ORG/NAME[@REVISION]")
    return download_from_hub(repo, filename, revision=revision or rev, cache_dir=cache_dir)


def read_folder_json(spec: str, filename: str, **kwargs: Any) -> dict[str, Any]:
    return read_json_object(folder_file(spec, filename, **kwargs))


def known_hub_repo(spec: str) -> Any:
    """The registry entry of a published repository (``hf-hub:Kaichengalex/...``), if any:
    those hold the original's checkpoint, not an exported folder."""
    from .pretrained import PRETRAINED, _split_revision

    if not spec.startswith(HF_HUB_PREFIX):
        return None
    repo = _split_revision(spec[len(HF_HUB_PREFIX):].strip("/"))[0]
    return next((p for p in PRETRAINED if p.hf_repo.lower() == repo.lower()), None)


def folder_context_length(spec: str, *, revision: str | None = None,
                          cache_dir: str | os.PathLike | None = None) -> int:
    """``ctx_len`` of an exported folder's model config."""
    known = known_hub_repo(spec)
    if known is not None:
        from .config import read_config_json

        return int(read_config_json(known.config)[0].get("ctx_len", 77))
    config = read_folder_json(spec, MODEL_CONFIG_FILE, revision=revision, cache_dir=cache_dir)
    return int(config.get("ctx_len", 77))


__all__ = ["WEIGHTS_FILE", "MODEL_CONFIG_FILE", "PREPROCESS_CONFIG_FILE", "CARD_FILE",
           "CardInfo", "write_hub_folder", "model_card", "preprocess_config",
           "find_eval_results", "load_eval_results", "push_to_hub", "is_folder_spec",
           "folder_file", "folder_context_length", "training_summary"]
