"""Cost against caption length: our text tower beside open_clip's text transformer with its
positional embedding stretched to the same length (Long-CLIP's method), in one process.

At each length both text towers encode the same random token batch, ABBA-interleaved
(:func:`rwkv_clip.bench.versus.interleaved`): inference (``encode_text`` without grad) and a
training pass (``encode_text``, backward). Peak memory as the other benchmarks count it
(:func:`rwkv_clip.bench.versus.peak_memory`, the text tower's own bytes held). Used by
``scripts/bench_text_length.py``.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .provenance import measured
from .versus import MEMORY_METHODS, build_open_clip, interleaved, peak_memory, resident_bytes

LENGTHS = "77,154,248,512,1024"
KEEP = 20  # Long-CLIP keeps the first 20 positions and stretches the rest
OURS, THEIRS = "rwkv_clip", "open_clip"


def stretch_positional_embedding(pos: torch.Tensor, length: int, keep: int = KEEP
                                 ) -> torch.Tensor:
    """(77, C) -> (length, C): the first ``keep`` rows kept, the others linearly
    interpolated to fill the rest (Long-CLIP's 77 -> 248 is keep 20, the 57 others x 4).
    A length up to ``keep`` keeps the first rows."""
    if length <= keep:
        return pos[:length].clone()
    rest = pos[keep:].t()[None]  # (1, C, 77 - keep)
    stretched = F.interpolate(rest, size=length - keep, mode="linear", align_corners=True)
    return torch.cat([pos[:keep], stretched[0].t()]).contiguous()


def stretch_open_clip_text(model: Any, length: int) -> None:
    """Make an open_clip CLIP read ``length`` tokens: positional embedding stretched, the
    causal mask and ``context_length`` rebuilt for it."""
    with torch.no_grad():
        pos = stretch_positional_embedding(model.positional_embedding.data, length)
    model.positional_embedding = torch.nn.Parameter(pos)
    model.attn_mask = torch.full((length, length), float("-inf")).triu_(1)
    model.context_length = length


def text_parts_open_clip(model: Any) -> list:
    return [model.token_embedding, model.positional_embedding, model.transformer,
            model.ln_final, model.text_projection, model.attn_mask]


def runner(encode: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, task: str,
           params: list) -> Callable[[], float]:
    """One call: ``encode`` without grad (infer) or with its backward (train)."""
    def infer() -> float:
        with torch.no_grad():
            return float(encode(tokens).float().sum())

    def train() -> float:
        for p in params:
            p.grad = None
        out = encode(tokens).float().sum()
        out.backward()
        return float(out.detach())
    return infer if task == "infer" else train


def stats(step_s: list[float], batch: int) -> dict[str, Any]:
    return {"median_s": statistics.median(step_s), "min_s": min(step_s), "max_s": max(step_s),
            "spread": (max(step_s) - min(step_s)) / statistics.median(step_s),
            "step_s": step_s, "tokens_per_s": None}


def measure_case(ours: Any, theirs: Any, tokens: torch.Tensor, task: str, repeats: int,
                 warmup: int) -> dict[str, Any]:
    """Both text towers on ``tokens``: ABBA step times, peak memory, paired ratio."""
    batch, length = tokens.shape
    ours_params = list(ours.text_model.parameters())
    theirs_parts = text_parts_open_clip(theirs)
    theirs_params = [p for m in theirs_parts for p in
                     (m.parameters() if isinstance(m, torch.nn.Module) else [m])
                     if isinstance(p, torch.nn.Parameter)]
    for p in ours_params + theirs_params:  # no gradients held from an earlier case
        p.grad = None
        p.requires_grad_(task == "train")
    runners = {OURS: runner(ours.encode_text, tokens, task, ours_params),
               THEIRS: runner(theirs.encode_text, tokens, task, theirs_params)}
    held = {OURS: lambda: resident_bytes(ours.text_model, tokens),
            THEIRS: lambda: resident_bytes(*theirs_parts, tokens)}
    memory: dict[str, int] = {}

    def probe(name: str, call: Callable[[], float]) -> float:
        value, start, rise = peak_memory(call, torch.device("cpu"), held[name])
        memory[name] = start + rise
        return value
    timed = interleaved(runners, warmup, repeats, probe)
    case: dict[str, Any] = {"task": task, "length": int(length), "batch": int(batch)}
    for name in (OURS, THEIRS):
        case[name] = stats(timed[name]["step_s"], int(batch))
        case[name]["tokens_per_s"] = batch * length / case[name]["median_s"]
        case[name]["peak_bytes"] = memory[name]
        case[name]["finite"] = timed[name]["finite"]
    paired = [b / a for a, b in zip(timed[OURS]["step_s"], timed[THEIRS]["step_s"], strict=True)]
    case["ratio"] = statistics.median(paired)  # their time / ours, paired
    case["ratio_range"] = [min(paired), max(paired)]
    return case


def run(lengths: list[int], tasks: list[str], batch: int, repeats: int, warmup: int,
        config: str, versus: str, log: Callable[[str], None]) -> dict[str, Any]:
    from ..config import load_model_configs
    from ..factory import build_model

    args = load_model_configs(config)
    args.ctx_len = max(lengths)  # no tensor depends on it: one model reads every length
    ours: Any = build_model(args, seed=0).eval()
    ours.image_model = torch.nn.Identity()  # the text tower alone is measured
    theirs: Any = build_open_clip(versus).eval()
    theirs.visual = torch.nn.Identity()
    base_pos = theirs.positional_embedding.data.clone()
    cases = []
    for length in lengths:
        theirs.positional_embedding = torch.nn.Parameter(base_pos.clone())
        stretch_open_clip_text(theirs, length)
        g = torch.Generator().manual_seed(length)
        tokens = torch.randint(1, 49406, (batch, length), generator=g)
        tokens[:, -1] = 49407  # open_clip pools at the end-of-text token
        for task in tasks:
            t = time.perf_counter()
            case = measure_case(ours, theirs, tokens, task, repeats, warmup)
            cases.append(case)
            log(f"{task} {length:5d} tokens x {batch}: ours {case[OURS]['median_s']:.3f} s "
                f"({case[OURS]['peak_bytes'] / 2**20:.0f} MiB), {versus} "
                f"{case[THEIRS]['median_s']:.3f} s ({case[THEIRS]['peak_bytes'] / 2**20:.0f} "
                f"MiB), ratio {case['ratio']:.2f} [{time.perf_counter() - t:.0f} s]")
            gc.collect()
    return {"cases": cases, "slopes": slopes(cases)}


def slopes(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Log-log slope of median time and peak memory against length, per task and model
    (1: linear, 2: quadratic), fitted over the lengths measured."""
    from .resolution import loglog_slope

    out: dict[str, Any] = {}
    for task in sorted({c["task"] for c in cases}):
        sel = [c for c in cases if c["task"] == task]
        xs = [c["length"] for c in sel]
        out[task] = {name: {"time": loglog_slope(xs, [c[name]["median_s"] for c in sel]),
                            "memory": loglog_slope(xs, [c[name]["peak_bytes"] for c in sel])}
                     for name in (OURS, THEIRS)}
    return out


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({c["task"] for c in result["cases"]})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, label) in zip(axes, (("median_s", "seconds per batch"),
                                       ("peak_bytes", "peak MiB")), strict=True):
        for task in tasks:
            sel = [c for c in result["cases"] if c["task"] == task]
            xs = [c["length"] for c in sel]
            for name, style in ((OURS, "-o"), (THEIRS, "--s")):
                ys = [c[name][key] / (2**20 if key == "peak_bytes" else 1) for c in sel]
                slope = result["slopes"][task][name]["time" if key == "median_s" else "memory"]
                ax.plot(xs, ys, style, label=f"{name} {task} (slope {slope:.2f})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(result["lengths"], [str(n) for n in result["lengths"]])
        ax.set_xlabel("caption tokens")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"text tower vs caption length: {result['config']} vs {result['versus']} "
                 f"(positional embedding stretched), batch {result['batch']}, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_flags(ap: Any) -> None:
    ap.add_argument("--lengths", default=LENGTHS, help=f"caption lengths (default {LENGTHS})")
    ap.add_argument("--tasks", default="infer,train", help="infer, train or both")
    ap.add_argument("--batch", type=int, default=2, help="captions per call (default 2)")
    ap.add_argument("--repeats", type=int, default=4, help="timed calls per model, ABBA")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per model first")
    ap.add_argument("--config", default="RWKV_CLIP_B32", help="our model config")
    ap.add_argument("--versus", default="ViT-B-32", help="open_clip model")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--output", default=None, help="also write the JSON here")
    ap.add_argument("--plot", default=None, help="draw time and memory against length (PNG)")


def main(ns: Any, argv: list[str] | None = None) -> int:
    from ..errors import ConfigError
    from .versus import parse_list

    lengths = parse_list(ns.lengths, int, None, "--lengths")
    tasks = parse_list(ns.tasks, str, ("infer", "train"), "--tasks")
    if min(lengths) < 1 or ns.batch < 1 or ns.repeats < 2 or ns.warmup < 1:
        raise ConfigError("--lengths and --batch must be >= 1, --repeats >= 2 (ABBA) and "
                          "--warmup >= 1 (it measures the memory)")
    if ns.threads:
        torch.set_num_threads(ns.threads)
    torch.manual_seed(0)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
    result: dict[str, Any] = {
        "what": "text tower time and peak memory against caption length; open_clip's text "
                f"transformer with its positional embedding stretched (first {KEEP} kept, "
                "the rest linearly interpolated, as Long-CLIP)",
        "command": "python scripts/bench_text_length.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "config": ns.config, "versus": ns.versus, "lengths": lengths, "batch": ns.batch,
        "repeats": ns.repeats, "device": "cpu", "threads": torch.get_num_threads(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU(s)",
        "interleaving": "ABBA per repeat; ratio = median of paired (their time / ours); "
                        "spread = (max - min) / median of a model's timed calls",
        "memory_method": MEMORY_METHODS["cpu"], "torch": torch.__version__, **measured(),
    }
    result.update(run(lengths, tasks, ns.batch, ns.repeats, ns.warmup, ns.config, ns.versus,
                      log))
    text = json.dumps(result, indent=1)
    print(text)
    if ns.output:
        with open(ns.output, "w") as f:
            f.write(text + "\n")
    if ns.plot:
        plot(result, ns.plot)
    return 0


__all__ = ["stretch_positional_embedding", "stretch_open_clip_text", "run", "slopes", "plot",
           "add_flags", "main", "LENGTHS"]
