"""Cost against image size: RWKV-CLIP beside an open_clip ViT, both built for each side.

Time (ABBA-interleaved, :mod:`rwkv_clip.bench.versus`), peak memory and counted FLOPs
(:mod:`rwkv_clip.bench.flops`) of inference (the image tower) and a training step per side, and
their log-log slopes against the patch tokens (1: linear, 2: quadratic). Used by
``scripts/bench_resolution.py``.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..host_memory import add_host_malloc_flag
from .provenance import measured
from .versus import (
    MEMORY_METHODS,
    PRECISIONS,
    RATIO_STATISTIC,
    build_open_clip,
    image_inference_runner,
    import_open_clip,
    interleaved,
    machine,
    make_inputs,
    open_clip_shapes,
    parse_list,
    peak_memory,
    resident_bytes,
    summarise,
    training_runner,
)

# our published configs and the open_clip model of the same patch size
PAIRS = {"B16": ("RWKV_CLIP_B16.json", "ViT-B-16"), "B32": ("RWKV_CLIP_B32.json", "ViT-B-32")}
SIDES = "224,448,896,1792"
# the largest side of a training step on the CPU by default (its cost grows with the tokens)
CPU_TRAIN_MAX_SIDE = 896
TASKS = ("infer", "train")
OURS, THEIRS = "rwkv_clip", "open_clip"


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of log(y) against log(x): the exponent p of y ~ x^p. None with
    fewer than two distinct x or a non-positive value."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True)
           if x is not None and y is not None and x > 0 and y > 0]
    if len(pts) != len(xs) or len({x for x, _ in pts}) < 2:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / var


def predict_seconds(history: Sequence[tuple[int, float]], tokens: int) -> float | None:
    """A call's seconds at ``tokens`` from earlier (tokens, seconds) of the same series:
    the last point scaled by the local log-log slope of the last two, kept within [1, 2]
    (2, the quadratic bound, with one point). None without history."""
    if not history:
        return None
    t1, s1 = history[-1]
    slope = 2.0
    if len(history) > 1:
        t0, s0 = history[-2]
        fitted = loglog_slope([t0, t1], [s0, s1])
        slope = 2.0 if fitted is None else min(2.0, max(1.0, fitted))
    return s1 * (tokens / t1) ** slope


@dataclasses.dataclass
class Sweep:
    """What the flags ask for, checked."""

    config: str
    versus: str | None
    sides: list[int]
    train_sides: list[int]
    tasks: list[str]
    precisions: list[str]
    batch: int
    train_batch: int
    warmup: int
    repeats: int
    device: torch.device
    max_seconds: float

    def warmup_for(self, task: str) -> int:
        # a training step's steady state holds the optimizer's moments, which its first
        # step makes: memory is measured on the second
        return self.warmup + (task == "train")


def build_ours(args: Any, side: int, device: torch.device) -> torch.nn.Module:
    """Our model for ``side`` px images (its pos_embed grid made for that size)."""
    from ..factory import build_model
    return build_model(dataclasses.replace(args, input_size=side), seed=0, device=device)


def count_case_flops(task: str, batch: int, side: int, ctx_len: int,
                     models: dict[str, torch.nn.Module],
                     log: Callable[[str], None]) -> dict[str, int | None]:
    """Each model's FLOPs per call of ``task`` (the same under every precision); None,
    with a line in the log, for a model the fake-tensor count cannot run."""
    from .flops import image_inference_flops, training_flops
    out: dict[str, int | None] = {}
    for name, model in models.items():
        model.train(task == "train")
        try:
            counted = (training_flops(model, batch, side, ctx_len) if task == "train"
                       else image_inference_flops(model, batch, side))
            out[name] = int(counted["total"])
        except Exception as exc:
            log(f"{name}: FLOPs of {task} at {side} px not counted ({_one_line(exc)})")
            out[name] = None
    return out


def run_case(sweep: Sweep, task: str, precision: str, side: int, tokens: int,
             models: dict[str, torch.nn.Module], ctx_len: int, vocab: int,
             log: Callable[[str], None],
             flops: dict[str, int | None] | None = None) -> dict[str, Any]:
    """One (task, precision, side): each model's step times, its peak memory, the paired
    time ratio (their time / ours) and the memory ratio (their peak / ours); with
    ``flops`` (per call, by model) each model's FLOPs and achieved GFLOP/s and the FLOP
    ratio (theirs / ours). A model whose call fails is dropped from the case with its
    error."""
    batch = sweep.train_batch if task == "train" else sweep.batch
    dev = sweep.device
    images, tokens_in = (t.to(dev) for t in make_inputs(batch, side, ctx_len, vocab))
    runners: dict[str, Callable[[], float]] = {}
    held: dict[str, Callable[[], int]] = {}
    for name, model in models.items():
        model.train(task == "train")
        if task == "train":
            run = training_runner(model, model, precision, images, tokens_in, dev.type)
            held[name] = partial(resident_bytes, model, run.optimizer,  # type: ignore[attr-defined]
                                 images, tokens_in)
        else:
            run = image_inference_runner(model, precision, images, dev.type)
            held[name] = partial(resident_bytes, model, images)
        runners[name] = run
    memory: dict[str, tuple[int, int]] = {}

    def probe(name: str, run: Callable[[], float]) -> float:
        value, start, rise = peak_memory(run, dev, held[name])
        memory[name] = (start, rise)
        return value

    errors: dict[str, str] = {}
    while runners:
        try:
            timings = interleaved(runners, sweep.warmup_for(task), sweep.repeats, probe)
            break
        except Exception as exc:  # a model that cannot run this case: find which, go on
            failing = _failing(runners, dev) or {next(iter(runners)): _one_line(exc)}
            errors.update(failing)
            for name in failing:
                runners.pop(name)
            memory.clear()
    result: dict[str, Any] = {"task": task, "precision": precision, "side": side,
                              "tokens": tokens, "batch": batch}
    if runners:
        result.update(summarise(timings, batch, OURS, THEIRS if len(runners) == 2 else None))
        for name in runners:
            start, rise = memory[name]
            result[name].update(median_s=statistics.median(result[name]["step_s"]),
                                peak_memory_bytes=start + rise, held_bytes=start,
                                step_memory_bytes=rise)
            counted = (flops or {}).get(name)
            if counted:
                result[name].update(flops=counted,
                                    gflop_per_s=counted / 1e9 / result[name]["median_s"])
        if len(runners) == 2:
            result["memory_ratio"] = (result[THEIRS]["peak_memory_bytes"]
                                      / result[OURS]["peak_memory_bytes"])
            if "flops" in result[OURS] and "flops" in result[THEIRS]:
                result["flop_ratio"] = result[THEIRS]["flops"] / result[OURS]["flops"]
    for name, message in errors.items():
        result[name] = {"error": message}
    log(format_case(result, sweep.versus))
    return result


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"


def _failing(runners: dict[str, Callable[[], float]], dev: torch.device) -> dict[str, str]:
    out = {}
    for name, run in runners.items():
        try:
            run()
        except Exception as exc:
            out[name] = _one_line(exc)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return out


def format_case(r: dict[str, Any], versus: str | None) -> str:
    cells = [f"{r['task']} {r['precision']} {r['side']} px ({r['tokens']} tokens)"]
    for name, label in ((OURS, "ours"), (THEIRS, versus)):
        if name not in r:
            continue
        m = r[name]
        cells.append(f"{label}: {m['error']}" if "error" in m else
                     f"{label} {m['median_s']:.3g} s, {m['peak_memory_bytes'] / 2**30:.2f} GiB"
                     + (f", {m['flops'] / 1e9:.4g} GFLOP" if "flops" in m else ""))
    if "ratio" in r:
        cells.append(f"time ratio {r['ratio']:.2f}x ({r['ratio_range'][0]:.2f}-"
                     f"{r['ratio_range'][1]:.2f}), memory ratio {r['memory_ratio']:.2f}x"
                     + (f", FLOP ratio {r['flop_ratio']:.2f}x" if "flop_ratio" in r else ""))
    return " | ".join(cells)


def slopes(cases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, task and precision: log-log slopes against tokens of the median step
    time, the peak memory, the memory the step itself adds (peak minus what the case
    held at its start) and the counted FLOPs (None where a side has no count)."""
    out = []
    for task in TASKS:
        for precision in PRECISIONS:
            for name in (OURS, THEIRS):
                rows = [c for c in cases if c["task"] == task and c["precision"] == precision
                        and "median_s" in c.get(name, {})]
                if not rows:
                    continue
                tokens = [c["tokens"] for c in rows]
                m = [c[name] for c in rows]
                out.append({"model": name, "task": task, "precision": precision,
                            "sides": [c["side"] for c in rows],
                            "time_slope": loglog_slope(tokens, [x["median_s"] for x in m]),
                            "memory_slope": loglog_slope(
                                tokens, [x["peak_memory_bytes"] for x in m]),
                            "step_memory_slope": loglog_slope(
                                tokens, [x["step_memory_bytes"] for x in m]),
                            "flop_slope": loglog_slope(tokens, [x.get("flops") for x in m])})
    return out


def run_sweep(sweep: Sweep, log: Callable[[str], None]) -> dict[str, Any]:
    """Every case the sweep asks for, over the inference and training sides ascending (a
    side's models are built once for both tasks); a case predicted to end past
    ``max_seconds`` is skipped with its prediction."""
    from ..config import load_model_configs
    t0 = time.perf_counter()
    args = load_model_configs(sweep.config)
    patch, ctx_len, vocab = int(args.image_patch_size or 0), args.ctx_len, args.vocab_size
    names = (OURS, THEIRS) if sweep.versus else (OURS,)
    cases: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    history: dict[tuple[str, str, str], list[tuple[int, float]]] = {}

    def predict(task: str, precision: str, tokens: int) -> float | None:
        """Seconds for the case's calls of every model; a series with one point grows
        as the same model's inference did (quadratically when that is not known yet)."""
        total = 0.0
        for name in names:
            series = history.get((name, task, precision), [])
            infer = dict(history.get((name, "infer", precision), []))
            seconds: float | None
            if len(series) == 1 and tokens in infer and series[0][0] in infer:
                seconds = series[0][1] * infer[tokens] / infer[series[0][0]]
            else:
                seconds = predict_seconds(series, tokens)
            if seconds is None:
                return None
            total += seconds * (sweep.warmup_for(task) + sweep.repeats)
        return total

    for side in sorted({*sweep.sides, *sweep.train_sides}):
        tokens = (side // patch) ** 2
        models: dict[str, torch.nn.Module] = {}
        flops: dict[str, dict[str, int | None]] = {}  # by task: the same for every precision
        for task in sweep.tasks:
            if side not in (sweep.train_sides if task == "train" else sweep.sides):
                continue
            for precision in sweep.precisions:
                guess, elapsed = predict(task, precision, tokens), time.perf_counter() - t0
                if guess is not None and elapsed + guess > sweep.max_seconds:
                    skipped.append({"task": task, "precision": precision, "side": side,
                                    "tokens": tokens, "predicted_s": round(guess, 1),
                                    "reason": f"predicted to end past --max-seconds "
                                              f"{sweep.max_seconds:g} ({elapsed:.0f} s spent)"})
                    log(f"[{elapsed:6.0f} s] skip {task} {precision} {side} px: predicted "
                        f"{guess:.0f} s, past --max-seconds {sweep.max_seconds:g}")
                    continue
                if not models:
                    models = build_models(sweep, args, side)
                if task not in flops:
                    batch = sweep.train_batch if task == "train" else sweep.batch
                    flops[task] = count_case_flops(task, batch, side, ctx_len, models, log)
                log(f"[{time.perf_counter() - t0:6.0f} s] {task} {precision} {side} px "
                    f"({tokens} tokens)" + (f", predicted {guess:.0f} s" if guess else ""))
                case = run_case(sweep, task, precision, side, tokens, models, ctx_len, vocab,
                                log, flops[task])
                cases.append(case)
                for name in models:
                    if "median_s" in case.get(name, {}):
                        history.setdefault((name, task, precision), []).append(
                            (tokens, case[name]["median_s"]))
        del models
        gc.collect()
        if sweep.device.type == "cuda":
            torch.cuda.empty_cache()
    return {"cases": cases, "skipped": skipped, "slopes": slopes(cases),
            "total_s": time.perf_counter() - t0}


def build_models(sweep: Sweep, args: Any, side: int) -> dict[str, torch.nn.Module]:
    """Ours and, if asked for, open_clip's model, both for ``side`` px images."""
    models = {OURS: build_ours(args, side, sweep.device)}
    if sweep.versus:
        models[THEIRS] = build_open_clip(sweep.versus, force_image_size=side).to(sweep.device)
        theirs = open_clip_shapes(models[THEIRS])[1:]
        if theirs != (args.ctx_len, args.vocab_size):
            raise ConfigError(f"{Path(sweep.config).name} takes (context, vocabulary) = "
                              f"{(args.ctx_len, args.vocab_size)} but open_clip "
                              f"{sweep.versus} takes {theirs}; both must read one batch")
    return models


def plot(result: dict[str, Any], path: str) -> None:
    """Time, peak memory, the memory the step adds and the counted FLOPs against tokens,
    log-log, one line per model, task and precision (FLOPs: per model and task), its
    fitted slope in the legend (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator
    names = {OURS: f"RWKV-CLIP {Path(result['config']).stem.split('_')[-1]}",
             THEIRS: f"open_clip {result['versus']}"}
    panels = (("median_s", 1.0, "time_slope", "seconds per call (median)"),
              ("peak_memory_bytes", 2.0 ** -30, "memory_slope", "peak memory (GiB)"),
              ("step_memory_bytes", 2.0 ** -30, "step_memory_slope",
               "memory the call adds (GiB)"),
              ("flops", 1e-9, "flop_slope", "GFLOP per call (counted)"))
    fig, grid = plt.subplots(2, 2, figsize=(13, 9.6))
    axes = grid.ravel()
    all_tokens = sorted({c["tokens"] for c in result["cases"]})
    for s in result["slopes"]:
        rows = [c for c in result["cases"] if c["task"] == s["task"]
                and c["precision"] == s["precision"] and "median_s" in c.get(s["model"], {})]
        style = dict(color="tab:red" if s["model"] == OURS else "tab:blue",
                     linestyle="-" if s["task"] == "infer" else "--",
                     marker="o" if s["precision"] == "fp32" else "s")
        what = f"{names[s['model']]} {s['task']}"
        for ax, (key, scale, fit, _) in zip(axes, panels, strict=True):
            if key == "flops" and (s[fit] is None or s["precision"] != result["precisions"][0]):
                continue  # counted once per model and task: the same under every precision
            label = (what + ("" if key == "flops" else f" {s['precision']}")
                     + ("" if s[fit] is None else f" (slope {s[fit]:.2f})"))
            ax.plot([c["tokens"] for c in rows], [c[s["model"]][key] * scale for c in rows],
                    label=label, **style)
    for ax, (_, _, _, ylabel) in zip(axes, panels, strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(all_tokens, [str(t) for t in all_tokens])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("image tokens (patches)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"cost against image size: {result['device']}, {result['threads']} threads",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_flags(ap: Any) -> None:
    ap.add_argument("--model", default="B16", choices=sorted(PAIRS),
                    help="our config and the open_clip model of its patch size "
                         "(B16: RWKV_CLIP_B16 and ViT-B-16; B32: RWKV_CLIP_B32 and ViT-B-32)")
    ap.add_argument("--config", default=None, help="our model config instead of --model's")
    ap.add_argument("--versus", default=None, metavar="OPEN_CLIP_MODEL",
                    help="open_clip model instead of --model's; 'none': ours only")
    ap.add_argument("--sides", default=SIDES, help=f"image sides in px (default {SIDES})")
    ap.add_argument("--train-sides", default=None,
                    help="sides for the training step (default: --sides, up to "
                         f"{CPU_TRAIN_MAX_SIDE} on the CPU)")
    ap.add_argument("--tasks", default="infer,train", help="infer and/or train")
    ap.add_argument("--precisions", default=None,
                    help="fp32 and/or bf16 autocast (default fp32 on the CPU, bf16 on CUDA)")
    ap.add_argument("--batch-size", type=int, default=1, help="inference batch (default 1)")
    ap.add_argument("--train-batch-size", type=int, default=2,
                    help="training batch (default 2: the contrastive loss needs negatives)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed calls per model and case, the last measuring memory "
                         "(default 1; training makes one more: its first step creates the "
                         "optimizer state)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed calls per model and case, ABBA (default 2)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    add_host_malloc_flag(ap)
    ap.add_argument("--max-seconds", type=float, default=1800.0,
                    help="skip a case predicted (from the smaller sides) to end past this "
                         "many seconds of the sweep (default 1800)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--plot", default=None, help="draw time and memory against tokens here "
                                                 "(PNG; needs matplotlib)")


def sweep_from_flags(ns: Any) -> Sweep:
    from ..config import load_model_configs, resolve_config_path
    config_name, versus = PAIRS[ns.model]
    config = str(resolve_config_path(ns.config or config_name))
    versus = ns.versus or versus
    patch = load_model_configs(config).image_patch_size
    sides = parse_list(ns.sides, int, None, "--sides")
    device = torch.device(ns.device)
    if ns.train_sides is not None:
        train_sides = parse_list(ns.train_sides, int, None, "--train-sides")
    else:
        train_sides = [s for s in sides if device.type == "cuda" or s <= CPU_TRAIN_MAX_SIDE]
    bad = sorted({s for s in sides + train_sides if s < patch or s % patch})
    if bad:
        raise ConfigError(f"--sides / --train-sides {bad}: expected multiples of the patch "
                          f"size {patch} of {Path(config).name}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    precisions = parse_list(ns.precisions or ("bf16" if device.type == "cuda" else "fp32"),
                            str, PRECISIONS, "--precisions")
    if min(ns.batch_size, ns.train_batch_size, ns.warmup, ns.repeats) < 1:
        raise ConfigError("--batch-size, --train-batch-size, --warmup and --repeats must be "
                          "at least 1 (memory is measured on the last warm-up call)")
    if ns.threads is not None and ns.threads < 1:
        raise ConfigError(f"--threads {ns.threads}: expected at least 1")
    return Sweep(config=config, versus=None if versus == "none" else versus,
                 sides=sorted(set(sides)), train_sides=sorted(set(train_sides)),
                 tasks=parse_list(ns.tasks, str, TASKS, "--tasks"), precisions=precisions,
                 batch=ns.batch_size, train_batch=ns.train_batch_size, warmup=ns.warmup,
                 repeats=ns.repeats, device=device, max_seconds=ns.max_seconds)


def main(ns: Any) -> int:
    """Run the sweep the flags describe; prints one JSON object (progress on stderr).
    Returns 0 when no model failed a case and every value was finite (cases skipped for
    time are listed under "skipped")."""
    from ..host_memory import configure_host_malloc
    sweep = sweep_from_flags(ns)
    theirs_version = import_open_clip().__version__ if sweep.versus else None
    if ns.threads is not None:
        torch.set_num_threads(ns.threads)
    host_malloc = configure_host_malloc(sweep.device, ns.host_malloc)  # as train.py, both models

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    dev = sweep.device
    result: dict[str, Any] = {
        "benchmark": "resolution", "config": Path(sweep.config).name, "versus": sweep.versus,
        "open_clip": theirs_version,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "host_malloc": host_malloc, "sides": sweep.sides, "train_sides": sweep.train_sides,
        "tasks": sweep.tasks, "precisions": sweep.precisions, "batch_size": sweep.batch,
        "train_batch_size": sweep.train_batch, "warmup": sweep.warmup,
        "repeats": sweep.repeats, "max_seconds": sweep.max_seconds,
        "tokens": "patch tokens, (side / patch)^2 (the ViT adds its class token)",
        "machine": machine(sweep.device),
        "interleaving": RATIO_STATISTIC + "; memory_ratio = their peak / our peak",
        "memory_method": MEMORY_METHODS[dev.type],
        "memory_measured_on": "each model's last warm-up call (the second training step)",
        **run_sweep(sweep, log),
        **measured(),
    }
    text = json.dumps(result)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    if ns.plot:
        plot(result, ns.plot)
        log(f"wrote {ns.plot}")
    ok = all("error" not in c[n] and c[n]["finite"] for c in result["cases"]
             for n in (OURS, THEIRS) if n in c)
    return 0 if ok else 1


