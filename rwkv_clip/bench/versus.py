"""RWKV-CLIP beside an open_clip model in one process: interleaved throughput.

Repeats run ours, theirs, theirs, ours (ABBA) on the same synthetic batch, so a change
of load hits both sides alike; each ratio is the median of the paired ratios, given with
their min-max range (:func:`paired_ratios`). The
training step is the trainer's own :func:`rwkv_clip.train.accumulation.train_step`.
"""
from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..compiling import compile_model
from ..cpu_isa import cpu_info
from ..errors import ConfigError
from .provenance import measured

OPEN_CLIP_DEFAULT = "ViT-B-32"
MODES = ("eager", "compiled")
PRECISIONS = ("fp32", "bf16")


def import_open_clip() -> Any:
    """The open_clip module; a :class:`ConfigError` saying how to install it if missing."""
    try:
        import open_clip
    except ImportError as exc:
        raise ConfigError("the open_clip comparison needs open_clip_torch installed "
                          "(pip install open_clip_torch)") from exc
    return open_clip


def build_open_clip(name: str = OPEN_CLIP_DEFAULT, seed: int = 0, **options: Any) -> nn.Module:
    """open_clip's model ``name``, randomly initialised (pretrained=None: nothing is
    downloaded; the Hub is put offline for the call); ``options`` go to
    ``open_clip.create_model`` (e.g. ``force_image_size``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    open_clip = import_open_clip()
    if name not in open_clip.list_models():
        raise ConfigError(f"open_clip has no model {name!r}; expected one of "
                          f"open_clip.list_models(), e.g. {OPEN_CLIP_DEFAULT!r}")
    torch.manual_seed(seed)
    return open_clip.create_model(name, pretrained=None, output_dict=False, **options)


def open_clip_shapes(model: Any) -> tuple[int, int, int]:
    """(image size, context length, vocabulary size) of an open_clip CLIP model."""
    size = model.visual.image_size
    size = size[0] if isinstance(size, tuple | list) else size
    return int(size), int(model.context_length), int(model.vocab_size)


def make_inputs(batch: int, image_size: int, ctx_len: int, vocab: int,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One synthetic batch: normal images (B, 3, S, S), uniform token ids (B, ctx_len)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, image_size, image_size, generator=g)
    tokens = torch.randint(1, vocab, (batch, ctx_len), generator=g)
    return images, tokens


def maybe_compile(model: nn.Module, mode: str) -> Callable[..., Any]:
    if mode not in MODES:
        raise ConfigError(f"benchmark mode {mode!r}: expected one of {MODES}")
    return compile_model(model, dynamic=False) if mode == "compiled" else model


def training_runner(model: nn.Module, forward: Callable[..., Any], precision: str,
                    images: torch.Tensor, tokens: torch.Tensor,
                    device_type: str = "cpu") -> Callable[[], float]:
    """One training step per call (returns the loss): the trainer's optimizer on
    ``model``'s parameters, the forward through ``forward`` (``model`` or its compiled
    wrapper). ``step.optimizer`` is that optimizer."""
    from ..loss import ClipLoss
    from ..memory.measure import trainer_defaults
    from ..precision import get_precision
    from ..train.accumulation import MicroBatch, train_step
    from ..train.loop import build_optimizer
    settings = trainer_defaults()
    optimizer = build_optimizer(model, settings)
    loss_fn = ClipLoss(cache_labels=True)
    prec = get_precision(precision, device_type)
    scaler = prec.scaler()
    batch = [MicroBatch(images, tokens)]

    def step() -> float:
        result = train_step(model, batch, loss_fn, optimizer, scaler=scaler,
                            autocast=prec.autocast_factory, mode=settings.accum_mode,
                            clip_grad_norm=settings.grad_clip_norm, wrapped=forward)
        return float(result.loss)
    step.optimizer = optimizer  # type: ignore[attr-defined]
    return step


def inference_runner(forward: Callable[..., Any], precision: str, images: torch.Tensor,
                     tokens: torch.Tensor, device_type: str = "cpu") -> Callable[[], float]:
    """encode_image + encode_text (the models' forward) without grad, per call."""
    from ..precision import get_precision
    prec = get_precision(precision, device_type)

    def run() -> float:
        with torch.no_grad(), prec.autocast():
            image_f, text_f, _ = forward(images, tokens)
        return float(image_f.float().sum() + text_f.float().sum())
    return run


def image_inference_runner(model: Any, precision: str, images: torch.Tensor,
                           device_type: str = "cpu") -> Callable[[], float]:
    """encode_image alone without grad, per call: the image tower, where the image size
    changes the cost."""
    from ..precision import get_precision
    prec = get_precision(precision, device_type)

    def run() -> float:
        with torch.no_grad(), prec.autocast():
            return float(model.encode_image(images).float().sum())
    return run


# What torch.compile leaves as calls: the matrix products and convolutions (inductor calls
# the same MKL / oneDNN kernels), attention (SDPA) and our WKV kernel (custom operators).
# Matched against the profiler's operator names, by prefix.
EXTERN_KERNELS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm",
                  "mkldnn::_linear_pointwise", "aten::mkldnn_convolution",
                  "aten::convolution_backward", "aten::_scaled_dot_product",
                  "rwkv_clip_wkv6")  # the kernels' library; its Python wrappers count as glue
# The optimizer step and gradient clipping: outside the compiled model (train.py and the
# benchmark compile the model, as open_clip's --torchcompile does). An operator counts as
# theirs when it runs inside the optimizer's step or is a multi-tensor (foreach) one,
# which clip_grad_norm_ uses and the models do not.
OPTIMIZER_SCOPE = "Optimizer."
FOREACH = "aten::_foreach_"


def _outside_model(event: Any) -> bool:
    if event.name.startswith(FOREACH):
        return True
    while event is not None:
        if event.name.startswith(OPTIMIZER_SCOPE):
            return True
        event = event.cpu_parent
    return False


def kernel_breakdown(run: Callable[[], float]) -> dict[str, float | None]:
    """Profile one call of ``run`` (a warmed-up runner): seconds of operator self time in
    the kernels compilation cannot change (:data:`EXTERN_KERNELS`), in the optimizer and
    gradient clipping, and in everything else (the glue a compiler could fuse), and
    ``compile_ceiling``: profiled total / (kernels + optimizer), the speed-up compiling
    would give if it made the glue free (None when nothing is fixed). The profiler's
    per-operator overhead lands in the glue, so the ceiling errs high."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    kernels = outside = other = 0.0
    for event in prof.events():
        seconds = event.self_cpu_time_total / 1e6
        if _outside_model(event):
            outside += seconds
        elif event.name.startswith(EXTERN_KERNELS):
            kernels += seconds
        else:
            other += seconds
    total = kernels + outside + other
    fixed = kernels + outside
    return {"profiled_s": total, "kernels_s": kernels, "optimizer_s": outside,
            "glue_s": other, "kernel_share": fixed / total if total else 0.0,
            "compile_ceiling": total / fixed if fixed else None}  # None: JSON has no inf


@dataclass
class Case:
    """One row of the table: a task at a batch size, precision and mode."""

    task: str  # "train" or "infer"
    batch: int
    precision: str
    mode: str
    result: dict[str, Any] = field(default_factory=dict)


def interleaved(runners: dict[str, Callable[[], float]], warmup: int, repeats: int,
                probe: Callable[[str, Callable[[], float]], float] | None = None
                ) -> dict[str, Any]:
    """Warm the runners up in turn, then time them in ABBA order; per-name step times,
    the warm-up seconds and whether every returned value was finite. ``probe(name, run)``,
    if given, makes each runner's last warm-up call (untimed, so a probe such as
    :func:`peak_memory` may slow it down)."""
    names = list(runners)
    out: dict[str, Any] = {n: {"step_s": [], "finite": True, "warmup_s": 0.0} for n in names}
    # warm-ups alternate too: a model's first steps (optimizer state, compilation) reshape
    # the process's heap, and the other model's first timed step must not be the one
    # that pays for it
    for w in range(warmup):
        for name in names:
            t = time.perf_counter()
            if probe is not None and w == warmup - 1:
                value = probe(name, runners[name])
            else:
                value = runners[name]()
            out[name]["finite"] &= bool(torch.isfinite(torch.tensor(value)))
            out[name]["warmup_s"] += time.perf_counter() - t
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            value = runners[name]()
            out[name]["step_s"].append(time.perf_counter() - t)
            out[name]["finite"] &= bool(torch.isfinite(torch.tensor(value)))
    return out


def resident_bytes(*objects: Any) -> int:
    """Bytes of the distinct tensor storages held by ``objects``: modules (parameters,
    their gradients, buffers), optimizers (their state) and tensors."""
    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    for obj in objects:
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                add(p)
                add(p.grad)
            for b in obj.buffers():
                add(b)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for value in state.values():
                    add(value)
        else:
            add(obj)
    return sum(seen.values())


MEMORY_METHODS = {
    "cuda": "torch.cuda.max_memory_allocated during the call minus memory_allocated before "
            "it, plus the bytes the case holds at its start (parameters, gradients, "
            "optimizer state, inputs): the peak of live tensor bytes, as the caching "
            "allocator counts them",
    "cpu": "torch.profiler profile_memory (every allocation and free of torch's CPU "
           "allocator during the call, summed in time order: the rise to the peak) plus "
           "the bytes the case holds at its start (parameters, gradients, optimizer state, "
           "inputs): the peak of live tensor bytes, not RSS (no allocator slack, code "
           "pages or library scratch outside torch's allocator)",
}


def peak_memory(run: Callable[[], float], device: torch.device,
                held: Callable[[], int]) -> tuple[float, int, int]:
    """(value, held bytes, rise in bytes) of one call of ``run``: ``held()`` is what the
    case holds when the call starts (e.g. :func:`resident_bytes` of its model, optimizer
    and inputs), the rise is how far live tensor bytes climb above their level at the
    start during the call (:data:`MEMORY_METHODS`); their sum is the case's peak, with
    none of what other objects in the process hold."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        start = held()
        value = run()
        torch.cuda.synchronize(device)
        return value, start, torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile
    start = held()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        value = run()
    from torch.autograd import DeviceType
    host = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)  # what torch counts as CPU
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() in host]
    now = rise = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        now += e.nbytes()
        rise = max(rise, now)
    return value, start, rise


RATIO_STATISTIC = ("ABBA per repeat; ratio = median over repeats of the paired (their step "
                   "time / our step time), ratio_range = their min and max; gain = 'ours' or "
                   "'theirs' only when ratio_range excludes 1.0")


def machine(device: torch.device) -> dict[str, Any]:
    """What the figures ran on: the CPU's model and the ISA extensions that decide its
    GEMM speed (torch's CPU capability, AVX-512, AVX512-BF16, AMX, the level the project
    ran at), and the GPU's name."""
    cpu = cpu_info()
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")
    info: dict[str, Any] = {"cpu": cpu.model or cpu.arch,
                            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                            "isa": [f for f in wanted if f in cpu.flags],
                            "isa_level": cpu.level, "cores": os.cpu_count()}
    if cpu.caps:
        info["isa_caps"] = list(cpu.caps)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def paired_ratios(ours_s: Sequence[float], theirs_s: Sequence[float]) -> dict[str, Any]:
    """The one speed statistic of every comparison: ``ratio``, the median over repeats of
    the paired ratio (their step time / ours, > 1: ours is faster), with its spread
    ``ratio_range`` (min, max of the paired ratios) and ``gain``: "ours" or "theirs" when
    the whole range lies on one side of 1.0, None when it includes 1.0 (within noise)."""
    paired = [b / a for a, b in zip(ours_s, theirs_s, strict=True)]
    low, high = min(paired), max(paired)
    return {"ratio": statistics.median(paired), "ratio_range": [low, high],
            "paired_ratios": paired,
            "gain": "ours" if low > 1.0 else "theirs" if high < 1.0 else None}


def summarise(timings: dict[str, Any], batch: int, ours: str, theirs: str | None) -> dict:
    """pairs/s per side (batch / median step time) and the paired ratio with its spread
    (:func:`paired_ratios`)."""
    result: dict[str, Any] = {}
    for name, t in timings.items():
        result[name] = {"pairs_per_s": batch / statistics.median(t["step_s"]),
                        "step_s": t["step_s"], "warmup_s": t["warmup_s"],
                        "finite": t["finite"]}
    if theirs is not None:
        result.update(paired_ratios(timings[ours]["step_s"], timings[theirs]["step_s"]))
    return result


def run_cases(cases: Sequence[Case], ours: nn.Module, theirs: nn.Module | None,
              inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
              warmup: int, repeats: int, log: Callable[[str], None] = lambda s: None,
              breakdown: bool = False) -> Sequence[Case]:
    """Fill ``case.result`` for every case, ours (key "rwkv_clip") beside theirs
    ("open_clip") when given. Compiled wrappers are made once per model and reused
    (dynamic=False: each batch size / precision / grad mode is its own graph).
    ``breakdown``: eager cases also get one profiled call per model after the timed ones
    (:func:`kernel_breakdown`, under ``"breakdown"``)."""
    models = {"rwkv_clip": ours} | ({"open_clip": theirs} if theirs is not None else {})
    compiled: dict[str, Callable[..., Any]] = {}
    for case in cases:
        images, tokens = inputs(case.batch)
        runners = {}
        for name, model in models.items():
            if case.mode == "compiled":
                compiled.setdefault(name, maybe_compile(model, "compiled"))
            forward = compiled[name] if case.mode == "compiled" else model
            model.train(case.task == "train")
            if case.task == "train":
                runners[name] = training_runner(model, forward, case.precision, images, tokens)
            else:
                runners[name] = inference_runner(forward, case.precision, images, tokens)
        timings = interleaved(runners, warmup, repeats)
        case.result = summarise(timings, case.batch, "rwkv_clip",
                                "open_clip" if theirs is not None else None)
        if breakdown and case.mode == "eager":
            case.result["breakdown"] = {name: kernel_breakdown(run)
                                        for name, run in runners.items()}
        log(format_row(case))
        del runners
        gc.collect()
    return cases


def format_row(case: Case) -> str:
    r = case.result
    cells = [f"{case.task} b{case.batch} {case.precision} {case.mode}",
             f"ours {r['rwkv_clip']['pairs_per_s']:.2f} pairs/s"]
    if "open_clip" in r:
        low, high = r["ratio_range"]
        cells += [f"open_clip {r['open_clip']['pairs_per_s']:.2f}",
                  f"ratio {r['ratio']:.2f}x ({low:.2f}-{high:.2f})"]
    for name, parts in r.get("breakdown", {}).items():
        ceiling = parts["compile_ceiling"]
        cells.append(f"{name}: kernels + optimizer {parts['kernel_share']:.0%} of the profiled "
                     "step, compile ceiling "
                     + ("unbounded" if ceiling is None else f"{ceiling:.2f}x"))
    return " | ".join(cells)


def table(cases: Sequence[Case]) -> dict[str, Any]:
    """The cases as JSON-ready rows, plus compiled-over-eager speed-ups per side
    (ratio of median pairs/s of the same task, batch and precision)."""
    rows = [{"task": c.task, "batch": c.batch, "precision": c.precision, "mode": c.mode,
             **c.result} for c in cases]
    eager = {(c.task, c.batch, c.precision): c.result for c in cases if c.mode == "eager"}
    speedups: list[dict[str, Any]] = []
    for c in cases:
        base = eager.get((c.task, c.batch, c.precision))
        if c.mode != "compiled" or base is None:
            continue
        speedups.append({"task": c.task, "batch": c.batch, "precision": c.precision,
                         **{name: c.result[name]["pairs_per_s"] / base[name]["pairs_per_s"]
                            for name in ("rwkv_clip", "open_clip") if name in c.result}})
    return {"rows": rows, "compiled_over_eager": speedups}


def parse_list(text: str, kind: Callable[[str], Any], allowed: Sequence | None,
               flag: str) -> list:
    """A comma-separated flag value, each item converted and checked."""
    try:
        items = [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:  # int("x")
        items = []
    bad = [i for i in items if allowed is not None and i not in allowed]
    if not items or bad:
        what = list(allowed) if allowed else getattr(kind, "__name__", "values")
        raise ConfigError(f"{flag} {text!r}: expected a comma-separated list of {what}")
    return items


def add_versus_flags(ap, default_batches: str, default_config: str,
                     versus_default: str | None = OPEN_CLIP_DEFAULT) -> None:
    """The comparison's flags, shared by bench_train.py --versus and bench_infer.py
    (``--versus`` alone means ViT-B-32; 'none' runs ours only)."""
    group = ap.add_argument_group("side by side with open_clip")
    group.add_argument("--versus", nargs="?", const=OPEN_CLIP_DEFAULT, default=versus_default,
                       metavar="OPEN_CLIP_MODEL",
                       help=f"open_clip model to run beside ours ({OPEN_CLIP_DEFAULT} if no "
                            "name is given; 'none': ours only)")
    group.add_argument("--versus-config", default=default_config,
                       help="our model config for the comparison (default B/32)")
    group.add_argument("--batch-sizes", default=default_batches,
                       help=f"comma-separated batch sizes (default {default_batches})")
    group.add_argument("--precisions", default="fp32,bf16", help="fp32 and/or bf16")
    group.add_argument("--modes", default="eager,compiled", help="eager and/or compiled")
    group.add_argument("--repeats", type=int, default=2,
                       help="timed repeats per model and case (default 2: a quick run)")
    group.add_argument("--versus-warmup", type=int, default=2,
                       help="untimed calls per model and case, alternating (default 2; "
                            "compilation happens in the first)")
    group.add_argument("--versus-threads", type=int, default=2, help="torch.set_num_threads")
    group.add_argument("--versus-out", default=None, help="also write the JSON here")
    group.add_argument("--breakdown", action="store_true",
                       help="profile one more call per model and eager case: the share of "
                            "matmul / convolution / attention / WKV kernels and optimizer, "
                            "which compiling leaves as they are, and the speed-up compiling "
                            "could give at most (compile_ceiling)")


def run_versus(ns, tasks: Sequence[str]) -> int:
    """Run the comparison the flags describe; prints one JSON object (progress and a
    readable table on stderr). Returns 0 when every loss / output was finite."""
    import json
    import sys

    from ..host_memory import configure_host_malloc
    from ..memory.measure import build_measured_model
    batches = parse_list(ns.batch_sizes, int, None, "--batch-sizes")
    if any(b < 1 for b in batches):
        raise ConfigError(f"--batch-sizes {ns.batch_sizes!r}: batch sizes must be >= 1")
    precisions = parse_list(ns.precisions, str, PRECISIONS, "--precisions")
    modes = parse_list(ns.modes, str, MODES, "--modes")
    if ns.repeats < 1 or ns.versus_warmup < 1:
        raise ConfigError("--repeats and --versus-warmup must be at least 1 (compiled models "
                          "compile during warm-up)")
    torch.set_num_threads(ns.versus_threads)
    # as train.py on the CPU: for both models
    host_malloc = configure_host_malloc("cpu", ns.host_malloc)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    args, ours = build_measured_model(ns.versus_config, "cpu", False, None)
    theirs = None if ns.versus == "none" else build_open_clip(ns.versus)
    size, ctx_len, vocab = args.input_size, args.ctx_len, args.vocab_size
    if theirs is not None:
        shapes = open_clip_shapes(theirs)
        if shapes != (size, ctx_len, vocab):
            raise ConfigError(f"{Path(ns.versus_config).name} takes (image size, context, "
                              f"vocabulary) = {(size, ctx_len, vocab)} but open_clip "
                              f"{ns.versus} takes {shapes}; the comparison needs one batch "
                              "both can read")
    cases = [Case(task, b, p, m) for m in modes for task in tasks for b in batches
             for p in precisions]
    t0 = time.perf_counter()
    run_cases(cases, ours, theirs, lambda b: make_inputs(b, size, ctx_len, vocab),
              ns.versus_warmup, ns.repeats, log, breakdown=ns.breakdown)
    result = {"config": Path(ns.versus_config).name, "versus": ns.versus,
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "repeats": ns.repeats, "warmup": ns.versus_warmup, "host_malloc": host_malloc,
              "machine": machine(torch.device("cpu")),
              "interleaving": RATIO_STATISTIC,
              "total_s": time.perf_counter() - t0, **measured(),
              **table(cases)}
    text = json.dumps(result)
    print(text)
    if ns.versus_out:
        Path(ns.versus_out).write_text(text + "\n")
    finite = all(row[name]["finite"] for row in result["rows"]
                 for name in ("rwkv_clip", "open_clip") if name in row)
    return 0 if finite else 1
