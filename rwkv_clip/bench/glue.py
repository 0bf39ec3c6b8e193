"""The fused glue ops (rwkv_clip.ops.glue) against their reference, eager and compiled.

For each op at a model's training shapes (the B/32 config at batch 256 by default: image
tokens on the 7 x 7 grid, text at ctx_len), forward + backward of three forms is timed,
interleaved (:func:`.versus.interleaved`, ABBA): the eager reference, the reference under
``torch.compile`` (:func:`rwkv_clip.compiling.compile_model`) and the Triton op (CUDA
only; named as skipped elsewhere). Each form is first checked against the float64
reference, output and gradients. The ratios are the project's one statistic
(:func:`.versus.paired_ratios`): the median paired ratio with its min-max.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..compiling import compile_model
from ..config import complete_args, load_model_configs
from ..errors import ConfigError
from ..ops import glue
from .provenance import measured
from .versus import interleaved, machine, paired_ratios, parse_list

MODES = ("eager", "compiled", "triton")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# max |form - float64 reference| / max |reference|, output and each gradient
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}


@dataclass
class GlueCase:
    """One op at one shape: ``make(batch, dtype, device, generator)`` gives its inputs;
    ``reference`` and ``fused`` take them."""
    name: str
    op: str
    shape: dict[str, Any]
    make: Callable[..., list[torch.Tensor]]
    reference: Callable[..., torch.Tensor]
    fused: Callable[..., torch.Tensor]


def _lerp_case(name: str, shift: glue.Shift, T: int, C: int, mixes: int, full: bool,
               shifted_first: bool) -> GlueCase:
    def make(batch, dtype, device, g):
        x = torch.randn(batch, T, C, generator=g)
        w = torch.rand(mixes, *((batch, T) if full else (1, 1)), C, generator=g)
        return [x.to(device, dtype), w.to(device, dtype)]
    return GlueCase(
        name, "shift_lerp",
        {"x": ["B", T, C], "weight": [mixes, "B" if full else 1, T if full else 1, C],
         "shift": shift.kind, "head_dim": shift.head_dim, "shifted_first": shifted_first},
        make,
        lambda x, w: glue.shift_lerp_reference(x, w, shift, shifted_first),
        lambda x, w: torch.stack(glue.SHIFT_LERP.implementations["triton"].fn(
            x, w, shift=shift, shifted_first=shifted_first)))


def _norm_case(name: str, T: int, C: int, n_head: int, eps: float) -> GlueCase:
    def make(batch, dtype, device, g):
        y = torch.randn(batch, T, C, generator=g) * 3  # the WKV output: float32
        weight, bias = torch.rand(C, generator=g) + 0.5, torch.randn(C, generator=g)
        gate = torch.randn(batch, T, C, generator=g)
        return [y.to(device), weight.to(device), bias.to(device), gate.to(device, dtype)]
    return GlueCase(
        name, "head_norm_gate", {"y": ["B", T, C], "heads": n_head, "eps": eps}, make,
        lambda y, w, b, gate: glue.head_norm_gate_reference(y, w, b, gate, n_head, eps),
        lambda y, w, b, gate: glue.HEAD_NORM_GATE.implementations["triton"].fn(
            y, w, b, gate, n_head=n_head, eps=eps))


def _relu_square_case(name: str, T: int, hidden: int) -> GlueCase:
    def make(batch, dtype, device, g):
        return [torch.randn(batch, T, hidden, generator=g).to(device, dtype)]
    return GlueCase(name, "relu_square", {"x": ["B", T, hidden]}, make,
                    glue.relu_square_reference, glue.RELU_SQUARE.implementations["triton"].fn)


def cases(config: str) -> list[GlueCase]:
    """Every glue op of both towers of ``config`` at its training shapes."""
    args = complete_args(load_model_configs(config))
    image = (args.input_size, args.image_patch_size, args.image_embed_dims,
             args.image_num_heads)
    if any(v is None for v in image):
        raise ConfigError(f"model config {config}: no image tower (input_size, "
                          "image_patch_size, image_embed_dims, image_num_heads)")
    size, patch, C_img, img_heads = (int(v) for v in image)  # type: ignore[arg-type]
    side = size // patch
    T_img = side * side
    img_hidden = int(args.image_hidden_rate) * C_img
    q = glue.Shift("q", C_img // img_heads, 1, (side, side))
    T_txt, C_txt, C_att = int(args.ctx_len), int(args.n_embd), int(args.dim_att)
    head_size = int(args.head_size)
    txt_eps = 1e-5 * int(args.head_size_divisor) ** 2
    seq = glue.Shift("sequence", head_size)
    # each op's kind on both towers first, so that a run cut short has measured each
    return [
        _lerp_case("image_time_mix_lerps", q, T_img, C_img, 5, True, False),
        _norm_case("image_head_norm_gate", T_img, C_img, img_heads, 1e-5),
        _relu_square_case("image_relu_square", T_img, img_hidden),
        _lerp_case("text_time_mix_lerps", seq, T_txt, C_txt, 5, True, False),
        _norm_case("text_head_norm_gate", T_txt, C_att, C_att // head_size, txt_eps),
        _relu_square_case("text_relu_square", T_txt, int(args.dim_ffn)),
        _lerp_case("image_channel_mix_lerps", q, T_img, C_img, 2, False, True),
        _lerp_case("text_channel_mix_lerps", seq, T_txt, C_txt, 2, False, False),
        _lerp_case("image_time_mix_first_lerp", q, T_img, C_img, 1, False, False),
        _lerp_case("text_time_mix_first_lerp", seq, T_txt, C_txt, 1, False, False),
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fwd_bwd(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor],
            grad: torch.Tensor) -> list[torch.Tensor]:
    """fn's output and the gradients of its floating inputs for the upstream ``grad``."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


def check(results: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Largest error of the output and gradients, each relative to its reference's peak."""
    return max(float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-12))
               for a, b in zip(results, reference, strict=True))


def runner(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor,
           inner: int) -> Callable[[], float]:
    """``inner`` forward + backward calls per call, synchronised at the end; returns the
    first output element (a finite check)."""
    leaves = [t.detach().requires_grad_() for t in inputs]

    def run() -> float:
        for _ in range(inner):
            out = fn(*leaves)
            torch.autograd.grad(out, leaves, grad)
        _sync(out.device)
        return float(out.detach().reshape(-1)[0])
    return run


def measure_case(case: GlueCase, modes: list[str], batch: int, dtype: str,
                 device: torch.device, warmup: int, repeats: int, inner: int,
                 compile_backend: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    inputs = case.make(batch, DTYPES[dtype], device, g)
    out = case.reference(*inputs)
    grad = torch.randn(out.shape, generator=g).to(device, out.dtype)
    reference = fwd_bwd(case.reference, [t.double() for t in inputs], grad.double())
    forms: dict[str, Callable[..., torch.Tensor]] = {}
    result: dict[str, Any] = {"name": case.name, "op": case.op, "shape": case.shape,
                              "modes": {}}
    for mode in modes:
        if mode == "triton" and not glue.uses_triton(inputs[0]):
            result["modes"][mode] = {"skipped": "no CUDA device" if device.type != "cuda"
                                     else "triton is not importable"}
            continue
        if mode == "compiled":
            forms[mode] = compile_model(case.reference, dynamic=False, fullgraph=True,
                                        backend=compile_backend)
        else:
            forms[mode] = case.fused if mode == "triton" else case.reference
        t0 = time.perf_counter()
        err = check(fwd_bwd(forms[mode], inputs, grad), reference)
        result["modes"][mode] = {"max_rel_err": err, "check_passed": err <= TOLERANCE[dtype],
                                 "first_call_s": time.perf_counter() - t0}
    del reference
    timings = interleaved({m: runner(f, inputs, grad, inner) for m, f in forms.items()},
                          warmup, repeats)
    for mode, t in timings.items():
        ms = [s * 1e3 / inner for s in t["step_s"]]
        result["modes"][mode].update(fwd_bwd_ms=statistics.median(ms), fwd_bwd_ms_all=ms,
                                     finite=t["finite"])
    for ours, theirs in (("triton", "eager"), ("triton", "compiled"), ("compiled", "eager")):
        if ours in timings and theirs in timings:
            result[f"{ours}_vs_{theirs}"] = paired_ratios(timings[ours]["step_s"],
                                                          timings[theirs]["step_s"])
    if timings:
        result["fastest"] = min(timings, key=lambda m: result["modes"][m]["fwd_bwd_ms"])
    return result


def format_row(r: dict[str, Any]) -> str:
    cells = [r["name"]]
    for mode, rec in r["modes"].items():
        cells.append(f"{mode} " + (f"{rec['fwd_bwd_ms']:.3f} ms" if "fwd_bwd_ms" in rec
                                   else rec.get("skipped", "not timed")))
    for key in ("triton_vs_eager", "triton_vs_compiled", "compiled_vs_eager"):
        if key in r:
            low, high = r[key]["ratio_range"]
            cells.append(f"{key} {r[key]['ratio']:.2f}x ({low:.2f}-{high:.2f})")
    return " | ".join(cells)


def add_flags(ap: Any) -> None:
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--config", default="RWKV_CLIP_B32", help="model config for the shapes")
    ap.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    ap.add_argument("--dtype", default="bf16", choices=tuple(DTYPES),
                    help="the glue's dtype (bf16: as under bf16 autocast)")
    ap.add_argument("--ops", default=None, help="comma-separated case names (default all)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {MODES}")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per form first")
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per form, ABBA")
    ap.add_argument("--inner", type=int, default=None,
                    help="forward + backward calls per timed call (default 10 on CUDA, 1 "
                         "on the CPU)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the compiled form (aot_eager: trace only)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="skip the cases left once this much time has passed")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--output", default=None, help="also write the JSON here")


def main(ns: Any, argv: list[str] | None = None) -> int:
    all_cases = cases(ns.config)
    names = [c.name for c in all_cases]
    chosen = parse_list(ns.ops, str, names, "--ops") if ns.ops else names
    modes = parse_list(ns.modes, str, MODES, "--modes")
    if ns.batch < 1 or ns.repeats < 1 or ns.warmup < 0:
        raise ConfigError("--batch and --repeats must be >= 1, --warmup >= 0")
    device = torch.device(ns.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device here (use --device cpu)")
    if ns.threads:
        torch.set_num_threads(ns.threads)
    inner = ns.inner or (10 if device.type == "cuda" else 1)
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    for case in all_cases:
        if case.name not in chosen:
            continue
        if ns.max_seconds is not None and time.monotonic() - t0 > ns.max_seconds:
            rows.append({"name": case.name, "op": case.op, "skipped": "out of time"})
            continue
        rows.append(measure_case(case, modes, ns.batch, ns.dtype, device, ns.warmup,
                                 ns.repeats, inner, ns.compile_backend))
        print(format_row(rows[-1]), file=sys.stderr, flush=True)
    result = {
        "what": "forward + backward of each fused glue op: the eager reference, the "
                "reference under torch.compile and the Triton op, interleaved",
        "command": "python scripts/bench_glue.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "config": ns.config, "batch": ns.batch, "dtype": ns.dtype, "device": device.type,
        "machine": machine(device), **measured(), "torch": torch.__version__, "modes": modes,
        "warmup": ns.warmup, "repeats": ns.repeats, "inner": inner,
        "compile_backend": ns.compile_backend,
        "statistic": "ABBA per repeat; X_vs_Y: ratio = median over repeats of the paired "
                     "(Y time / X time), > 1: X faster; ratio_range = their min and max; "
                     "gain = 'ours' (X) or 'theirs' (Y) only when the range excludes 1.0",
        "check": f"max |form - float64 reference| / max |reference| over the output and "
                 f"gradients <= {TOLERANCE[ns.dtype]}",
        "cases": rows,
        "all_checks_passed": all(rec.get("check_passed", True) for r in rows
                                 for rec in r.get("modes", {}).values()),
        "total_s": round(time.monotonic() - t0, 1),
    }
    text = json.dumps(result)
    print(text)
    if ns.output:
        with open(ns.output, "w") as f:
            f.write(text + "\n")
    return 0


__all__ = ["GlueCase", "MODES", "add_flags", "cases", "main", "measure_case"]
