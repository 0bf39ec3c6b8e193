"""What ``zero_shot.py`` and ``text_image_retrieval.py`` run: build the model, evaluate
each requested set (sharded over torchrun ranks when launched that way) with the
original's preprocessing for that set, in fp32 unless ``--amp`` asks for autocast, write
the JSON results, the summary table and the original's score line. The CLIs
(:mod:`rwkv_clip.eval.cli`) only parse arguments and call :func:`run`."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from .. import faults
from ..compiling import compile_model
from ..config import TOWER_KEYS
from ..distributed import DistInfo, cleanup_distributed, init_distributed
from ..errors import EvalError
from ..factory import build_model, choose_model_args
from ..faults import DEFAULT_DIST_TIMEOUT
from ..precision import get_precision
from ..pretrained import HF_HUB_PREFIX, is_weights_name, load_weights
from .datasets import PAPER_DATASETS, build_classification_set, canonical_name
from .results import (
    DEFAULT_OUTPUT_DIR,
    append_score_line,
    keep_earlier,
    result_path,
    result_record,
    summary,
    write_result,
)
from .retrieval import FILE_SETS, RETRIEVAL_ALIASES, build_retrieval_set, evaluate_retrieval
from .transforms import eval_transform, protocol
from .zeroshot import evaluate_classification

# The architecture flags of the original's evaluation scripts: the tower flags but the
# image tower's stochastic depth (a training setting), and the text dropout.
ARCH_FLAGS = (*(key for key in TOWER_KEYS if key != "drop_path_rate"), "dropout")
DEFAULT_SCORE_FILE = "zero_shot_scores.txt"


def log(info: DistInfo, msg: str) -> None:
    if info.is_master:
        print(msg, flush=True)


# ------------------------------------------------------------------ precision
def evaluation_precision(opts) -> str:
    """The precision evaluation computes in: fp32 unless ``--amp`` opts into autocast.

    The original's ``--precision`` (bf16 in its shell scripts) only set RWKV_FLOAT_MODE,
    which rounds the text tower's initialisation; the loaded checkpoint overwrites that
    and its zero_shot.py / text_image_retrieval.py run the encoders in fp32.
    """
    return getattr(opts, "amp", None) or "fp32"


# ------------------------------------------------------------------ model
def _arch_overrides(opts) -> dict:
    return {k: getattr(opts, k) for k in ARCH_FLAGS if getattr(opts, k, None) is not None}


def build_eval_model(opts, device: torch.device, info: DistInfo) -> tuple[Any, Any, str, str]:
    """(model, model args, model name, pretrained label) from the options.

    The config is ``--config``, else the one the published weights name, else the shipped
    config whose model fits the checkpoint (architecture flags applied), else the small
    default; a training checkpoint's saved model settings (context length, image size,
    ...) override its keys, and architecture flags override those. The original's shell scripts pass
    every architecture flag but ``--input-size`` (its default 224), so with their B/32
    checkpoint they resolve to exactly RWKV_CLIP_B32.
    """
    if getattr(opts, "onnx", None):
        return onnx_eval_model(opts, device, info)
    weights_spec = opts.model_weight or opts.pretrained or None
    weights = load_weights(weights_spec) if weights_spec else None
    args, name = choose_model_args(opts.config, weights, _arch_overrides(opts),
                                   log=lambda msg: log(info, msg))
    model = build_model(args, weights, seed=opts.seed)
    if opts.wkv_backend and opts.wkv_backend != "auto":
        model.set_wkv_backend(opts.wkv_backend)
    model = model.to(device).eval()
    if getattr(opts, "torchcompile", False):
        # the evaluators call encode_image / encode_text, so those are what gets compiled
        model.encode_image = compile_model(model.encode_image)  # type: ignore[method-assign]
        model.encode_text = compile_model(model.encode_text)  # type: ignore[method-assign]
    model_name = opts.model_name or name
    pretrained = weights.label if weights else f"none (random init, seed {opts.seed})"
    return model, args, model_name, pretrained


def onnx_eval_model(opts, device: torch.device, info: DistInfo) -> tuple[Any, Any, str, str]:
    """:func:`build_eval_model` for ``--onnx DIR``: the exported encoders on the CPU."""
    from .onnx_model import OnnxModel

    if device.type != "cpu" or info.distributed:
        raise EvalError(f"--onnx runs in one process on the CPU (got {device}, "
                        f"{info.world_size} process(es)): add --device cpu, no torchrun")
    model = OnnxModel(opts.onnx, runtime=opts.onnx_runtime)
    args = SimpleNamespace(input_size=model.image_size, ctx_len=model.context_length)
    name = opts.model_name or Path(opts.onnx).name
    return model, args, name, model.describe()


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
        if opts.task == "linear_probe" and key not in RETRIEVAL_ALIASES and key != "jsonl":
            plan.append((canonical_name(key), "linear_probe"))
        elif key in RETRIEVAL_ALIASES or key in ("jsonl",) or (
                opts.task == "zeroshot_retrieval" and key not in PAPER_DATASETS):
            plan.append((RETRIEVAL_ALIASES.get(key, key), "zeroshot_retrieval"))
        else:
            plan.append((canonical_name(key), "zeroshot_classification"))
    for (name, task), given in zip(plan, names, strict=True):  # before any model is built
        if name not in known_datasets(task) and name not in FILE_SETS:
            probe = task == "linear_probe"
            raise EvalError(f"unknown dataset {given!r}{' for --task linear_probe' if probe else ''}"
                            f": choose from {', '.join(known_datasets(task if probe else None))}")
    return plan


def known_datasets(task: str | None = None) -> tuple[str, ...]:
    """The ``--dataset`` names (aliases aside) of ``task``; every task's when None."""
    classification = ("builtin", "builtin_shifted", "imagefolder", *PAPER_DATASETS)
    retrieval = ("jsonl", *dict.fromkeys(RETRIEVAL_ALIASES.values()))
    probe = ("builtin", "imagefolder", *PAPER_DATASETS)
    by_task = {"zeroshot_classification": classification, "zeroshot_retrieval": retrieval,
               "linear_probe": probe}
    return by_task[task] if task else tuple(dict.fromkeys(classification + retrieval))


def builtin_folder(shifted: bool = False) -> str:
    """The built-in set's held-out zero-shot folder, or its distribution-shifted one."""
    try:
        from ..data import ensure_builtin_dataset
    except ImportError:
        try:
            from ..data.builtin import ensure_builtin_dataset
        except ImportError as exc:
            raise EvalError(f"the built-in held-out split is not available ({exc}); pass "
                            "--dataset and --data-root") from None
    ds = ensure_builtin_dataset()
    return str(ds.shifted_dir if shifted else ds.zeroshot_dir)


def default_output_dir(opts) -> Path:
    """Beside the evaluated checkpoint's run: ``runs/X/checkpoints/Y.pt`` ->
    ``runs/X/eval_results``, other weights -> ``<their folder>/eval_results``; published
    weights by name (``NAME:TAG``, ``hf-hub:OWNER/REPO``) -> ``runs/pretrained/<name as
    one folder>/eval_results``; an ONNX folder (``--onnx DIR``) -> ``runs/onnx/<its
    name>/eval_results``, keeping the served folder as exported; a fresh model ->
    ``runs/zero_shot/eval_results``. Never the current folder itself."""
    if getattr(opts, "onnx", None):
        return (Path("runs") / "onnx" / name_as_folder(Path(opts.onnx).resolve().name)
                / DEFAULT_OUTPUT_DIR)
    weight = opts.model_weight or opts.pretrained
    if not weight:
        return Path("runs") / "zero_shot" / DEFAULT_OUTPUT_DIR
    if not opts.model_weight and is_weights_name(weight):
        return Path("runs") / "pretrained" / name_as_folder(weight) / DEFAULT_OUTPUT_DIR
    folder = Path(weight).resolve().parent
    if folder.name == "checkpoints":
        folder = folder.parent
    return folder / DEFAULT_OUTPUT_DIR


def name_as_folder(name: str) -> str:
    """A weights name as one folder name: ``hf-hub:Owner/Repo@rev`` -> ``Owner_Repo_rev``,
    ``RWKV-CLIP-B32:yfcc15m`` -> ``RWKV-CLIP-B32_yfcc15m``."""
    text = str(name).strip()
    if text.startswith(HF_HUB_PREFIX):
        text = text[len(HF_HUB_PREFIX):]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "weights"


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
    timeout = getattr(opts, "dist_timeout", None) or DEFAULT_DIST_TIMEOUT
    info = init_distributed(opts.device or "auto", timeout_minutes=timeout / 60)
    # a lost peer: one line, exit status 3, no result for the set being evaluated
    with faults.watch_peers(info, timeout, getattr(opts, "prog", "zero_shot.py")) as watch:
        finished = False
        try:
            records = _run(opts, info, watch)
            finished = True
            return records
        except Exception as exc:
            watch.check(exc)
            raise
        finally:
            watch.close("done" if finished else "interrupted")
            cleanup_distributed(info, synchronize=False)


def _run(opts, info: DistInfo, watch: faults.PeerWatch | None = None) -> list[dict]:
    device = info.device
    compute = evaluation_precision(opts)
    get_precision(compute, device)  # validates the name
    plan = dataset_plan(opts)
    json_dir, score_file = output_paths(opts)
    model, args, model_name, pretrained = build_eval_model(opts, device, info)
    size = args.input_size
    note = ""
    if compute == "fp32" and getattr(opts, "precision", "fp32") != "fp32":
        note = (f" (--precision {opts.precision} is the original's flag and, as there, does "
                "not change evaluation; --amp bf16 opts into autocast)")
    log(info, f"model {model_name} ({pretrained}) on {device}, computing in "
              f"{compute if compute == 'fp32' else compute + ' autocast'}{note}, "
              f"{info.world_size} process(es); context {args.ctx_len} tokens, images "
              f"{size} px")
    common = dict(device=device, batch_size=opts.batch_size, workers=opts.workers,
                  precision=compute, text_batch_size=opts.text_batch_size, info=info,
                  log=lambda msg: log(info, msg))
    records = []
    written: list[Path] = []
    current = {"set": ""}
    if watch is not None:
        watch.where = lambda: f"while evaluating {current['set'] or 'the model'}"
        watch.outcome = lambda: (
            f"complete results: {', '.join(map(str, written)) or 'none'}; nothing was "
            f"written for {current['set'] or 'any set'}"
            + (" or the sets after it" if len(written) + 1 < len(plan) else ""))
    for name, task in plan:
        current["set"] = name
        if task == "zeroshot_classification":
            transform = eval_transform(name, size)
            if name in ("builtin", "builtin_shifted"):
                eval_set = build_classification_set("imagefolder",
                                                    builtin_folder(name == "builtin_shifted"),
                                                    transform, templates_file=opts.templates)
                eval_set.name = name
            else:
                eval_set = build_classification_set(name, opts.data_root, transform,
                                                    templates_file=opts.templates,
                                                    caltech101_split=opts.caltech101_split)
            log(info, f"{eval_set.name}: {len(eval_set)} images, {eval_set.num_classes} classes, "
                      f"{len(eval_set.templates)} templates; {protocol(name)}")
            metrics = evaluate_classification(model, eval_set, **common)
        elif task == "linear_probe":
            from .linear_probe import evaluate_linear_probe
            metrics = evaluate_linear_probe(
                model, name, opts.data_root, size, device, opts.batch_size, opts.workers,
                compute, opts.fewshot_k, opts.val_proportion, opts.seed, opts.feature_root,
                info, log=lambda msg: log(info, msg))
        else:
            rset = build_retrieval_set(name, opts.data_root, opts.retrieval_file,
                                       opts.caption_prefix, getattr(opts, "encoding", "utf-8"))
            log(info, f"{rset.name}: {rset.num_images} images, {len(rset.captions)} captions; "
                      f"{protocol(name)}")
            metrics = evaluate_retrieval(model, rset, eval_transform(name, size), **common)
            name = rset.name
        record = result_record(name, model_name, pretrained, task, metrics,
                               ctx_len=args.ctx_len, input_size=size)
        records.append(record)
        if info.is_master:
            earlier = result_path(json_dir, record["dataset"], record["task"])
            with faults.writing():
                kept = keep_earlier(earlier)
                path = write_result(record, json_dir)
            written.append(path)
            print(f"wrote {path}" + (f" (the earlier result there kept as {kept.name})"
                                     if kept else ""), flush=True)
    if info.is_master and records:
        print("\n" + summary(records), flush=True)
        line = append_score_line(score_file, records)
        print(f"\nscores ({', '.join(r['dataset'] for r in records)}): {line}\n"
              f"appended to {score_file}", flush=True)
    return records


def options(**kwargs) -> SimpleNamespace:
    """Default options for calling :func:`run` from Python (same names as the CLI)."""
    base = dict(model_weight=None, pretrained=None, config=None, model_name=None, dataset=None,
                data_root=None, templates=None, retrieval_file=None, caption_prefix=None,
                task="zeroshot_classification", batch_size=64, text_batch_size=256, workers=0,
                precision="fp32", amp=None, output_dir=None, score_file=None,
                device=None, dist_timeout=DEFAULT_DIST_TIMEOUT,
                wkv_backend=None, torchcompile=False, caltech101_split="original", seed=1024,
                fewshot_k=-1, val_proportion=0.2, feature_root=None)
    base.update({k: None for k in ARCH_FLAGS})
    base.update(kwargs)
    return SimpleNamespace(**base)
