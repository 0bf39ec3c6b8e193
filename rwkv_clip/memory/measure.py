"""Measuring: one real training step (or inference forward) and its peak memory.

The step is the trainer's own (:func:`make_step`). Each measurement runs in a fresh
Python process so that earlier allocations do not blur the peak (:func:`measure`).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from argparse import Namespace
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import MeasurementError
from ..precision import get_precision
from .walk import _cfg

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding rwkv_clip/
WORKER_CODE = ("import sys; from rwkv_clip.memory.measure import worker_main; "
               "sys.exit(worker_main(sys.argv[1:]))")


# ----------------------------------------------------------------------------- the step
def trainer_defaults() -> Namespace:
    """The trainer's settings with no flags given (optimizer, betas, weight decay,
    clipping, loss options): ``train.py``'s own argparse defaults."""
    from ..train.args import build_train_parser
    return build_train_parser().parse_args([])


def make_step(model: torch.nn.Module, precision: str, device_type: str,
              lr: float | None = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One training step exactly as the training loop runs it on one micro-batch:
    :func:`rwkv_clip.train.accumulation.train_step` with the trainer's optimizer
    (:func:`rwkv_clip.train.loop.build_optimizer` on the trainer's default flags), its
    ClipLoss, GradScaler and autocast (:func:`rwkv_clip.precision.get_precision`) and its
    gradient clipping. Returns ``step(images, tokens) -> loss``; ``step.optimizer`` and
    ``step.scaler`` are the objects it uses."""
    from ..loss import ClipLoss
    from ..train.accumulation import MicroBatch, train_step
    from ..train.loop import build_optimizer
    settings = trainer_defaults()
    if lr is not None:
        settings.lr = lr
    optimizer = build_optimizer(model, settings)
    loss_fn = ClipLoss(local_loss=settings.local_loss,
                       gather_with_grad=settings.gather_with_grad, cache_labels=True)
    prec = get_precision(precision, device_type)
    scaler = prec.scaler()

    def step(images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        result = train_step(model, [MicroBatch(images, tokens)], loss_fn, optimizer,
                            scaler=scaler, autocast=prec.autocast_factory,
                            mode=settings.accum_mode, clip_grad_norm=settings.grad_clip_norm)
        return torch.tensor(result.loss)
    step.optimizer = optimizer  # type: ignore[attr-defined]
    step.scaler = scaler  # type: ignore[attr-defined]
    return step


def synthetic_batch(args: Any, batch: int, device: torch.device | str,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (B, 3, S, S) and token ids (B, ctx_len) for ``args``."""
    g = torch.Generator().manual_seed(seed)
    S = _cfg(args, "input_size")
    images = torch.randn(batch, 3, S, S, generator=g).to(device)
    tokens = torch.randint(0, _cfg(args, "vocab_size"), (batch, _cfg(args, "ctx_len")),
                           generator=g).to(device)
    return images, tokens


def build_measured_model(config: str | Any, device: torch.device | str, checkpointing: bool,
                         wkv_backend: str | None) -> tuple[Any, torch.nn.Module]:
    """(args, model) for a config (path, shipped name or loaded args), seeded, on
    ``device``."""
    from ..config import load_model_configs
    from ..factory import build_model
    args = load_model_configs(config) if isinstance(config, str | Path) else config
    model = build_model(args, seed=0, wkv_backend=wkv_backend, device=device)
    model.set_grad_checkpointing(checkpointing)
    return args, model


# ----------------------------------------------------------------------------- CPU peak
def rss_kib(field_name: str = "VmRSS") -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now; VmHWM: peak)."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"{field_name}:\s+(\d+)", text)
    if match is None:
        raise MeasurementError(f"/proc/self/status has no {field_name} field")
    return int(match.group(1))


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak resident set during a block: the kernel's VmHWM after resetting it, or a
    sampling thread on VmRSS where the reset is not allowed."""

    def __enter__(self) -> PeakRSS:
        self.by_hwm = _reset_hwm()
        self.peak = rss_kib()
        self._stop = threading.Event()
        if not self.by_hwm:
            self._t = threading.Thread(target=self._sample, daemon=True)
            self._t.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_kib())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.by_hwm:
            self.peak = rss_kib("VmHWM")
        else:
            self._t.join()
            self.peak = max(self.peak, rss_kib())


def _warm_up_cpu(wkv_backend: str | None, finetune: dict | None = None) -> None:
    """Touch the code paths (libraries, kernels, thread pools; peft's LoRA layers) with a
    throwaway tiny model, so the measured RSS growth is tensors rather than code pages."""
    from ..config import config_dir
    tiny = config_dir() / "RWKV_CLIP_tiny.json"
    if not tiny.is_file():
        return
    args, model = build_measured_model(str(tiny), "cpu", False, wkv_backend)
    apply_finetune(model, finetune)
    step = make_step(model, "fp32", "cpu")
    images, tokens = synthetic_batch(args, 2, "cpu")
    for _ in range(2):
        step(images, tokens)
    with torch.no_grad():
        model.eval()(images, tokens)
    del model, step, images, tokens
    gc.collect()


# ----------------------------------------------------------------------------- worker
@dataclass(frozen=True)
class MeasureSpec:
    """What one measuring run does; travels to the worker as JSON."""
    config: str
    batch: int
    precision: str
    checkpointing: bool
    device: str
    mode: str = "train"  # "train" (one warm step, then the measured one) or "inference"
    wkv_backend: str | None = None
    finetune: dict | None = None  # a .finetune.FineTune as a dict (None: full training)
    input_size: int | None = None  # image side in pixels (None: the config's)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> MeasureSpec:
        return cls(**json.loads(text))


def apply_finetune(model: torch.nn.Module, finetune: dict | None) -> None:
    """Lock towers / add LoRA adapters as ``train.py`` does (:mod:`rwkv_clip.lora`)."""
    if not finetune:
        return
    from ..lora import LoraSettings, add_adapters
    from .finetune import FineTune
    ft = FineTune(**{**finetune, "lora_targets": tuple(finetune.get("lora_targets", ()))
                     or FineTune.lora_targets})
    if ft.lora_rank:
        add_adapters(model, LoraSettings(ft.lora_rank, 2.0 * ft.lora_rank, ft.lora_dropout,
                                         ft.lora_targets, ft.lora_base_precision),
                     ft.towers())
        return
    for tower, locked in (("image_model", ft.lock_image), ("text_model", ft.lock_text)):
        if locked:
            getattr(model, tower).requires_grad_(False)


def run_measurement(spec: MeasureSpec) -> dict:
    """One warm step, then one measured step (or an inference forward), in this process
    (call it in a fresh one: :func:`measure`). CUDA: max_memory_allocated; CPU: peak RSS
    minus the RSS before the model was built (so parameters are included on both)."""
    from ..config import load_model_configs
    if spec.mode not in ("train", "inference"):
        raise MeasurementError(f"measure mode {spec.mode!r}: expected train or inference")
    args = load_model_configs(spec.config)  # a bad config fails before the warm-up
    if spec.input_size is not None:
        args = dataclasses.replace(args, input_size=spec.input_size)
    dev = torch.device(spec.device)
    if dev.type == "cpu":
        _warm_up_cpu(spec.wkv_backend, spec.finetune)
        base_kib = rss_kib()
    else:
        torch.cuda.init()
        base = torch.cuda.memory_allocated(dev)
    args, model = build_measured_model(args, dev, spec.checkpointing, spec.wkv_backend)
    apply_finetune(model, spec.finetune)
    images, tokens = synthetic_batch(args, spec.batch, dev)
    t0 = time.perf_counter()
    if spec.mode == "train":
        model.train()
        step = make_step(model, spec.precision, dev.type)
        step(images, tokens)                       # warm: AdamW moments now exist
        run = lambda: step(images, tokens)
    else:
        model.eval()
        autocast = get_precision(spec.precision, dev).autocast

        def run() -> Any:
            with torch.no_grad(), autocast():
                return model(images, tokens)
        run()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        t1 = time.perf_counter()
        run()
        torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - t1
        measured = torch.cuda.max_memory_allocated(dev) - base
        extra = {"max_reserved_bytes": torch.cuda.max_memory_reserved(dev),
                 "method": "torch.cuda.max_memory_allocated after reset_peak_memory_stats"}
    else:
        with PeakRSS() as peak:
            t1 = time.perf_counter()
            run()
            elapsed = time.perf_counter() - t1
        measured = (peak.peak - base_kib) * 1024
        extra = {"method": "peak RSS (VmHWM after clear_refs)" if peak.by_hwm
                 else "peak RSS (1 ms VmRSS sampling)",
                 "baseline_rss_bytes": base_kib * 1024}
    return dict(measured_peak_bytes=int(measured), step_seconds=elapsed,
                warm_seconds=t1 - t0, torch=torch.__version__, **extra)


def worker_main(argv: list[str]) -> int:
    """The child's side of the protocol: ``argv`` = [SPEC.json, RESULT.json]."""
    spec_path, result_path = argv
    spec = MeasureSpec.from_json(Path(spec_path).read_text())
    Path(result_path).write_text(json.dumps(run_measurement(spec)))
    return 0


def worker_env() -> dict[str, str]:
    """The child's environment: this checkout importable, and glibc malloc settings under
    which large tensors come straight from mmap and freed memory goes back to the OS at
    once, so RSS follows the live tensors (glibc otherwise keeps freed heap pages)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT),
                                                    env.get("PYTHONPATH")) if p)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    env.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")
    return env


def measure(config: str, batch: int, precision: str, checkpointing: bool, device: str,
            mode: str = "train", wkv_backend: str | None = None,
            timeout: float = 1800, finetune: Any = None, input_size: int | None = None) -> dict:
    """Run :func:`run_measurement` in a fresh subprocess; returns its dict.
    ``finetune``: a :class:`.finetune.FineTune`.

    The protocol with the child (:func:`worker_main`):

    1. the parent writes a :class:`MeasureSpec` as JSON to a file;
    2. it runs ``python -c WORKER_CODE SPEC.json RESULT.json`` (``WORKER_CODE`` calls
       :func:`worker_main`), with glibc malloc settings that make RSS follow live tensors;
    3. the child runs :func:`run_measurement` and writes its result dict as JSON to
       ``RESULT.json``; a failure is its exit status and traceback on stderr;
    4. the parent reads the result, or raises :class:`MeasurementError` with the child's
       last lines of stderr.
    """
    ft = None if finetune is None else {**asdict(finetune),
                                        "lora_targets": list(finetune.lora_targets)}
    spec = MeasureSpec(str(config), batch, precision, checkpointing, device, mode,
                       wkv_backend, ft, input_size)
    with tempfile.TemporaryDirectory(prefix="rwkv_clip_measure_") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(spec.to_json())
        try:
            proc = subprocess.run([sys.executable, "-c", WORKER_CODE, str(spec_path),
                                   str(result_path)], env=worker_env(), capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise MeasurementError(f"measuring {spec}: no result after {timeout:.0f} s"
                                   ) from None
        if proc.returncode != 0 or not result_path.is_file():
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise MeasurementError(f"measuring {spec} failed (exit {proc.returncode}):\n{tail}")
        return json.loads(result_path.read_text())
