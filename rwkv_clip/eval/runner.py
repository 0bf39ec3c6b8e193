"""What ``zero_shot.py`` runs: build the model, evaluate each requested set (sharded over
torchrun ranks when launched that way), write the JSON results, the summary table and
the original's score line. The CLI only parses arguments and calls :func:`run`."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..distributed import DistInfo, cleanup_distributed, init_distributed
from ..precision import get_precision
from ..config import (ConfigError, available_configs, load_model_configs, model_args_from_dict,
                      read_config_json)
from .datasets import EvalError, PAPER_DATASETS, build_classification_set, canonical_name
from .results import append_score_line, result_record, summary, write_result
from .retrieval import RETRIEVAL_ALIASES, build_retrieval_set, evaluate_retrieval
from .zeroshot import evaluate_classification

DEFAULT_CONFIG = "RWKV_CLIP_small"
DEFAULT_SCORE_FILE = "zero_shot_scores.txt"
DEFAULT_OUTPUT_DIR = "eval_results"  # the folder's name; where it goes: default_output_dir
# Architecture flags of the original scripts (shell/test_zero_shot_*.sh) -> config keys.
ARCH_FLAGS = ("input_size", "image_depth", "image_embed_dims", "image_patch_size",
              "image_hidden_rate", "image_num_heads", "image_output_cls_token",
              "image_with_cls_token", "ctx_len", "vocab_size", "text_initialization",
              "head_size", "text_num_head", "head_size_divisor", "n_layer", "n_embd",
              "dim_att", "dim_ffn", "pos_emb", "head_qk", "tiny_att_dim", "tiny_att_layer",
              "dropout")
# The original zero_shot.py's argparse defaults, the base when only such flags are given.
ORIGINAL_ARCH_DEFAULTS = {
    "input_size": 224, "image_depth": 12, "image_embed_dims": 384, "image_patch_size": 16,
    "image_hidden_rate": 4, "image_num_heads": 6, "image_output_cls_token": False,
    "image_with_cls_token": False, "ctx_len": 77, "vocab_size": 49408,
    "text_initialization": True, "head_size": 64, "text_num_head": 0, "head_size_divisor": 8,
    "n_layer": 12, "n_embd": 384, "dim_att": 0, "dim_ffn": 0, "pos_emb": 0, "head_qk": 0,
    "tiny_att_dim": 0, "tiny_att_layer": -999, "dropout": 0.0, "precision": "bf16",
}


def log(info: DistInfo, msg: str) -> None:
    if info.is_main:
        print(msg, flush=True)


# ------------------------------------------------------------------ model
def _config_dict(path_or_name: str) -> dict:
    return read_config_json(path_or_name)[0]


def _arch_overrides(opts) -> dict:
    return {k: getattr(opts, k) for k in ARCH_FLAGS if getattr(opts, k, None) is not None}


def infer_config_name(state_dict: dict) -> str | None:
    """The shipped config whose parameter names and shapes match ``state_dict``."""
    from ..model import create_RWKV_Model

    shapes = {k: tuple(v.shape) for k, v in state_dict.items()}
    for name in available_configs():
        try:
            args = load_model_configs(name)
            with torch.device("meta"):
                model = create_RWKV_Model(args)
        except Exception:  # noqa: BLE001 - a config that cannot build simply does not match
            continue
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if expected == shapes:
            return name
    return None


def build_model(opts, device: torch.device, info: DistInfo) -> tuple[Any, Any, str, str]:
    """(model, model args, model name, pretrained label) from the options."""
    from ..model import check_state_dict, create_RWKV_Model, read_state_dict

    weight = opts.model_weight or opts.pretrained or None
    state_dict = read_state_dict(weight) if weight else None
    overrides = _arch_overrides(opts)
    if opts.config:
        base, name = _config_dict(opts.config), Path(opts.config).stem
    elif overrides:
        base, name = dict(ORIGINAL_ARCH_DEFAULTS), "custom"
    elif state_dict is not None:
        name = infer_config_name(state_dict)
        if name is None:
            raise ConfigError(f"checkpoint {weight} matches none of the shipped configs "
                              f"{available_configs()}: pass --config path/to/config.json")
        log(info, f"config: {name} (inferred from the checkpoint's parameter shapes)")
        base = _config_dict(name)
    else:
        base, name = _config_dict(DEFAULT_CONFIG), DEFAULT_CONFIG
    if overrides:
        if "n_embd" in overrides:  # let dim_att / dim_ffn follow a new width
            base.setdefault("dim_att", 0)
            base.setdefault("dim_ffn", 0)
            for key in ("dim_att", "dim_ffn"):
                if key not in overrides:
                    base[key] = 0
        base.update(overrides)
    args = model_args_from_dict(base, source=f"model config {name}")
    torch.manual_seed(opts.seed)
    model = create_RWKV_Model(args)
    if state_dict is not None:
        check_state_dict(model, state_dict, str(weight))
        model.load_state_dict(state_dict, strict=True)
    if opts.wkv_backend and opts.wkv_backend != "auto":
        model.set_wkv_backend(opts.wkv_backend)
    model = model.to(device).eval()
    model_name = opts.model_name or name
    pretrained = str(weight) if weight else "none (random init, seed %d)" % opts.seed
    return model, args, model_name, pretrained


# ------------------------------------------------------------------ datasets
def dataset_plan(opts) -> list[tuple[str, str]]:
    """[(dataset name, task)] in the order given."""
    names = [n.strip() for n in (opts.dataset or "").split(",") if n.strip()]
    if not names:
        if opts.task == "zeroshot_retrieval":
            if not opts.retrieval_file:
                raise EvalError("--task zeroshot_retrieval needs --dataset mscoco|flickr30k or "
                                "--retrieval-file FILE.jsonl")
            names = ["jsonl"]
        else:
            names = ["builtin"]
    plan = []
    for n in names:
        key = n.lower()
        if key in RETRIEVAL_ALIASES or key in ("jsonl",) or (
                opts.task == "zeroshot_retrieval" and key not in PAPER_DATASETS):
            plan.append((RETRIEVAL_ALIASES.get(key, key), "zeroshot_retrieval"))
        else:
            plan.append((canonical_name(key), "zeroshot_classification"))
    return plan


def builtin_folder() -> str:
    try:
        from ..data import ensure_builtin_dataset  # type: ignore[attr-defined]
    except ImportError:
        try:
            from ..data.builtin import ensure_builtin_dataset
        except ImportError as exc:
            raise EvalError(f"the built-in held-out split is not available ({exc}); pass "
                            "--dataset and --data-root") from None
    return str(ensure_builtin_dataset().zeroshot_dir)


def default_output_dir(opts) -> Path:
    """Beside the evaluated checkpoint's run: ``runs/X/checkpoints/Y.pt`` ->
    ``runs/X/eval_results``, other weights -> ``<their folder>/eval_results``; a fresh
    model -> ``runs/zero_shot/eval_results``. Never the current folder itself."""
    weight = opts.model_weight or opts.pretrained
    if not weight:
        return Path("runs") / "zero_shot" / DEFAULT_OUTPUT_DIR
    folder = Path(weight).resolve().parent
    if folder.name == "checkpoints":
        folder = folder.parent
    return folder / DEFAULT_OUTPUT_DIR


def output_paths(opts) -> tuple[Path, Path]:
    """(JSON folder, score text file). An --output-dir ending in .txt is the original's
    score file; the JSONs then go beside it. No --output-dir (None, or the parser's
    default name): :func:`default_output_dir`."""
    given = opts.output_dir not in (None, DEFAULT_OUTPUT_DIR)
    out = Path(opts.output_dir) if given else default_output_dir(opts)
    if out.suffix == ".txt":
        json_dir, score = out.parent, out
    else:
        json_dir, score = out, out / DEFAULT_SCORE_FILE
    if opts.score_file:
        score = Path(opts.score_file)
    return json_dir, score


# ------------------------------------------------------------------ main entry
def run(opts) -> list[dict]:
    """Evaluate every requested set; returns the result records (on every rank)."""
    info = init_distributed(opts.device or "auto")
    try:
        return _run(opts, info)
    finally:
        cleanup_distributed(info, synchronize=False)


def _run(opts, info: DistInfo) -> list[dict]:
    from ..transform import image_transform

    device = info.device
    get_precision(opts.precision, device)  # validates the name; tf32 switches TF32 on
    plan = dataset_plan(opts)
    json_dir, score_file = output_paths(opts)
    model, args, model_name, pretrained = build_model(opts, device, info)
    transform = image_transform(args.input_size, is_train=False)
    log(info, f"model {model_name} ({pretrained}) on {device}, precision {opts.precision}, "
              f"{info.world_size} process(es)")
    common = dict(device=device, batch_size=opts.batch_size, workers=opts.workers,
                  precision=opts.precision, text_batch_size=opts.text_batch_size, info=info)
    records = []
    for name, task in plan:
        if task == "zeroshot_classification":
            if name == "builtin":
                eval_set = build_classification_set("imagefolder", builtin_folder(), transform,
                                                    templates_file=opts.templates)
                eval_set.name = "builtin"
            else:
                eval_set = build_classification_set(name, opts.data_root, transform,
                                                    templates_file=opts.templates,
                                                    caltech101_split=opts.caltech101_split)
            log(info, f"{eval_set.name}: {len(eval_set)} images, {eval_set.num_classes} classes, "
                      f"{len(eval_set.templates)} templates")
            metrics = evaluate_classification(model, eval_set, **common)
        else:
            rset = build_retrieval_set(name, opts.data_root, opts.retrieval_file, opts.caption_prefix)
            log(info, f"{rset.name}: {rset.num_images} images, {len(rset.captions)} captions")
            metrics = evaluate_retrieval(model, rset, transform, **common)
            name = rset.name
        record = result_record(name, model_name, pretrained, task, metrics)
        records.append(record)
        if info.is_main:
            path = write_result(record, json_dir)
            print(f"wrote {path}", flush=True)
    if info.is_main and records:
        print("\n" + summary(records), flush=True)
        line = append_score_line(score_file, records)
        print(f"\nscores ({', '.join(r['dataset'] for r in records)}): {line}\nappended to {score_file}",
              flush=True)
    return records


def options(**kwargs) -> SimpleNamespace:
    """Default options for calling :func:`run` from Python (same names as the CLI)."""
    base = dict(model_weight=None, pretrained=None, config=None, model_name=None, dataset=None,
                data_root=None, templates=None, retrieval_file=None, caption_prefix=None,
                task="zeroshot_classification", batch_size=64, text_batch_size=256, workers=0,
                precision="fp32", output_dir=None, score_file=None, device=None,
                wkv_backend=None, caltech101_split="original", seed=1024)
    base.update({k: None for k in ARCH_FLAGS})
    base.update(kwargs)
    return SimpleNamespace(**base)
