"""The dispatch table: for each fast op, its implementations, the reference each is
checked against, and the one function that chooses among them (:func:`choose`).

An :class:`Op` states its reference, how to make small check inputs, the tolerance per
dtype and its shape class (what a choice depends on besides device and dtype). An
:class:`Implementation` is a callable with the op's signature and a ``supports(device,
dtype, shape)`` that returns None or the reason it cannot run. A call passes tensors
(``args``, the first one's device and dtype count) and static attributes (``attrs``: a
head count, a shift's geometry), which every implementation and the reference take as
keywords.

For one (op, device, dtype, shape class, pass) the choice is, first that applies (the
pass: ``pass=fwd+bwd`` joins the shape class where the call needs gradients, so a choice
timed on inference is not reused for training):

1. a pinned name: the caller's argument, ``$RWKV_CLIP_DISPATCH`` (a debugging override,
   ``op=name[,op=name]``), or :func:`pin`;
2. the choice already made in this process;
3. the on-disk cache (``<kernel cache>/dispatch.json``, :func:`cache_key`);
4. ``auto``: each supported candidate is checked against the reference at a small shape
   (forward and gradients; one line names a candidate that raises or misses and drops
   it), the survivors are timed at the real shape (the reference only when nothing
   else survives), the fastest is cached on disk.

Each choice is reported once per process in one line (:func:`set_reporter`), e.g.
``wkv: cuda-fast (0.11 ms) over chunked (0.2 ms), bfloat16, T=197 N=64``; :func:`choices` returns
them for the run folder. Nothing is timed or read at import.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import ConfigError, DispatchError, RWKVCLIPError
from .cache import cache_root

OVERRIDE_ENV_VAR = "RWKV_CLIP_DISPATCH"
AUTO = "auto"  # as a pin: no pin, the table chooses
CACHE_FILE = "dispatch.json"
CACHE_FORMAT = 2  # bump when a record's layout or the key's contents change
TIMED_ITERATIONS = 5  # rounds, the candidates in turn; each one's best run counts
# a candidate whose first timed run is this many times slower than the best so far is
# not run again: its one run is its time (the reference can be very slow at full size)
GIVE_UP_FACTOR = 20.0

ShapeClass = Mapping[str, "int | str"]
Attrs = Mapping[str, Any]
Supports = Callable[[torch.device, torch.dtype, ShapeClass], "str | None"]


@dataclass(frozen=True)
class Implementation:
    """One way to compute an op. ``device_types``: where it can run at all (the default
    under ``torch.compile`` tracing, where nothing is checked or timed); ``supports``:
    the full test for one call; ``takes_float64``: whether it is checked on float64
    inputs (else on the call's dtype)."""

    name: str
    fn: Callable[..., Any]  # a tensor or a tuple of tensors
    supports: Supports
    device_types: tuple[str, ...]
    takes_float64: bool = True


@dataclass
class Op:
    """An op of the table. ``tolerance``: per check dtype, the largest error allowed
    relative to the largest magnitude of the reference's result (forward and each
    gradient). ``aliases``: other names accepted for a pin, per device type.
    ``check_inputs(device, dtype, attrs, shape)``: small tensors and the attributes to
    check with, of the same kind as the call (its ``attrs`` and shape class); the check is
    kept per the check's attributes and shapes. The tolerance is the looser of the check
    dtype's and the result dtype's;
    ``shape_class(*args, **attrs)``: what the choice depends on besides device and dtype.
    ``on_export``: the implementation traced by ``torch.export`` and TorchScript (None:
    as under ``torch.compile``). ``reference_competes``: the reference is timed with the
    others (plain torch ops that may well win) rather than only stand in when nothing else
    survives (a slow oracle, as the WKV's scan). An op returns a tensor or a tuple of
    tensors."""

    name: str
    reference: Callable[..., Any]
    check_inputs: Callable[[torch.device, torch.dtype, Attrs, ShapeClass],
                           tuple[Sequence[Tensor], Attrs]]
    tolerance: Mapping[torch.dtype, float]
    shape_class: Callable[..., dict[str, Any]]
    error: type[RWKVCLIPError] = ConfigError
    aliases: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    on_export: str | None = None
    reference_competes: bool = False
    implementations: dict[str, Implementation] = field(default_factory=dict)

    def register(self, impl: Implementation) -> Implementation:
        """Add ``impl``; the order of registration is the default order under tracing."""
        self.implementations[impl.name] = impl
        return impl

    def allowed_names(self) -> list[str]:
        return [AUTO, *self.implementations,
                *(a for a in self.aliases if a not in self.implementations)]

    def resolve(self, name: str, device_type: str | None = None, source: str = "argument") -> str:
        """The implementation ``name`` (or an alias, on ``device_type``) stands for."""
        if name in self.implementations:
            return name
        if name in self.aliases:
            target = self.aliases[name].get(device_type or "", "")
            if not target:  # an alias with nothing on this device: its first target
                target = next(iter(self.aliases[name].values()))
            return target
        raise self.error(f"unknown {self.name} implementation {name!r} (from {source}); "
                         f"expected one of {', '.join(self.allowed_names())}")


@dataclass(frozen=True)
class Choice:
    """One decision: which implementation runs, how it was decided (``auto``, ``cache``,
    ``pinned``, ``override``, ``traced``), and the times (ms) it was decided on."""

    op: str
    implementation: str
    device: str
    dtype: str
    shape: str
    how: str
    times_ms: Mapping[str, float] = field(default_factory=dict)

    def line(self) -> str:
        """``wkv: cuda-fast (0.11 ms) over chunked (0.2 ms), bfloat16, T=197 N=64``."""
        def ms(name: str) -> str:
            return f"{self.times_ms[name]:.3g} ms"
        if self.implementation in self.times_ms:
            cached = ", cached" if self.how == "cache" else ""
            head = f"{self.implementation} ({ms(self.implementation)}{cached})"
            others = [f"{n} ({ms(n)})" for n in sorted(self.times_ms, key=self.times_ms.__getitem__)
                      if n != self.implementation]
            if others:
                head += " over " + ", ".join(others)
        else:
            head = f"{self.implementation} ({self.how})"
        return f"{self.op}: {head}, {self.dtype}, {self.shape}"

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "implementation": self.implementation, "device": self.device,
                "dtype": self.dtype, "shape": self.shape, "how": self.how,
                "times_ms": dict(self.times_ms)}


TABLE: dict[str, Op] = {}
_pins: dict[str, str] = {}
_preferred: dict[str, str] = {}              # prefer(): used where it runs, else auto
_adopted: dict[str, str] = {}                # adopt(): "op|device type|dtype|shape" -> name
_override: dict[str, str] | None = None      # $RWKV_CLIP_DISPATCH, parsed once
_memo: dict[str, Choice] = {}                # one per (op, device, dtype, shape class)
_by_device_type: dict[str, str] = {}         # "op:cpu" -> the last choice there (tracing)
_checked: dict[tuple[str, str, str, str, str], str | None] = {}
_reported: set[str] = set()
counters = {"checked": 0, "timed": 0}
# bumped whenever the choices are forgotten or may change (pins, adoptions, reset): what a
# caller that keeps a choice of its own (rwkv_clip.ops.products) compares against
generation = 0


def _forget_choices() -> None:
    global generation
    _memo.clear()
    generation += 1


def _print_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


_report: Callable[[str], None] = _print_line
_warn: Callable[[str], None] = _print_line


def set_reporter(info: Callable[[str], None] | None = None,
                 warn: Callable[[str], None] | None = None) -> None:
    """Where the choice lines (``info``) and the dropped-candidate lines (``warn``) go;
    None: standard error."""
    global _report, _warn
    _report = info or _print_line
    _warn = warn or info or _print_line


def register_op(op: Op) -> Op:
    TABLE[op.name] = op
    return op


def _pinnable() -> str:
    return ", ".join(TABLE)


def get_op(name: str) -> Op:
    try:
        return TABLE[name]
    except KeyError:
        raise DispatchError(f"unknown op {name!r} in the dispatch table; expected one of "
                            f"{', '.join(TABLE)}") from None


# --------------------------------------------------------------------------- pins
def parse_pins(text: str, source: str) -> dict[str, str]:
    """``"wkv=reference,glue=triton"`` -> {"wkv": "reference", ...}, every name checked."""
    pins: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        op_name, sep, impl = (s.strip() for s in item.partition("="))
        if not sep or not impl:
            raise DispatchError(f"{source}: {item!r} is not op=implementation (ops: "
                                f"{_pinnable()})")
        op = TABLE.get(op_name)
        if op is None:
            raise DispatchError(f"{source}: unknown op {op_name!r}; expected one of "
                                f"{_pinnable()}")
        if impl != AUTO:
            op.resolve(impl, source=source)
            pins[op_name] = impl
    return pins


# RWKV_CLIP_* variables no longer read -> what to use instead. Set, one stops the run with
# one line rather than be ignored (checked with the override, which every command-line
# program reads before any set-up). The variables read: ENV_VARS.
LEGACY_KERNEL_CACHE_ENV = "RWKV_CLIP_KERNEL_CACHE"  # what older checkouts read for kernels
REPLACED_ENV_VARS = {
    "RWKV_CLIP_WKV_BACKEND": "RWKV_CLIP_DISPATCH=wkv=reference|cpu|cuda-fast|...",
    "RWKV_CLIP_WKV_CUDA_VARIANT": "RWKV_CLIP_DISPATCH=wkv=cuda-fast|cuda-faithful|chunked",
    "RWKV_CLIP_CPU_LINEAR": "RWKV_CLIP_DISPATCH=linear=onednn|mkl",
    "RWKV_CLIP_CPU_LOWP_MATMUL": "RWKV_CLIP_DISPATCH=lowp_matmul=native|fp32",
    "RWKV_CLIP_WKV_CPU_ISA": "ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA below the CPU's "
                             "level (the CPU kernel's portable build of that level)",
    LEGACY_KERNEL_CACHE_ENV: "RWKV_CLIP_CACHE (kernels in $RWKV_CLIP_CACHE/kernels)",
    "RWKV_CLIP_REBUILD": "the config key rebuild or train.py --rebuild auto|always|never",
    "RWKV_CLIP_HOST_MALLOC": "the flag --host-malloc auto|retain|system",
    "RWKV_CLIP_DATA_ROOT": "the flag --data-root DIR",
    "RWKV_CLIP_INSTALLER": "bash scripts/bootstrap.sh --pip",
    "RWKV_CLIP_EXTRAS": "bash scripts/bootstrap.sh --extras LIST",
}
# every RWKV_CLIP_* variable the package reads (docs/training.md#environment-variables)
ENV_VARS = ("RWKV_CLIP_CACHE", "RWKV_CLIP_DISPATCH", "RWKV_CLIP_KERNEL_LOCK_TIMEOUT")


def check_replaced_env_vars() -> None:
    """A :class:`DispatchError` naming the replacement if a variable of
    :data:`REPLACED_ENV_VARS` is set."""
    for name, instead in REPLACED_ENV_VARS.items():
        if os.environ.get(name):
            raise DispatchError(f"{name} is not read; use {instead} instead "
                                f"(docs/training.md#environment-variables)")


def override() -> dict[str, str]:
    """``$RWKV_CLIP_DISPATCH``, read and checked once per process (with
    :func:`check_replaced_env_vars`)."""
    global _override
    if _override is None:
        check_replaced_env_vars()
        _override = parse_pins(os.environ.get(OVERRIDE_ENV_VAR, ""), OVERRIDE_ENV_VAR)
    return _override


def pinned(name: str) -> str | None:
    """The name pinned for op ``name`` by the override or :func:`pin` (None:
    ``auto``)."""
    return override().get(name) or _pins.get(name)


def pin(choices: Mapping[str, str] | str) -> None:
    """Pin implementations for every later call (``{"wkv": "cpu"}`` or ``"wkv=cpu"``),
    e.g. the choices a run stored, for a reproducible run; ``{}`` clears the pins."""
    text = choices if isinstance(choices, str) else ",".join(f"{k}={v}" for k, v in choices.items())
    pins = parse_pins(text, "pin")
    _pins.clear()
    _pins.update(pins)
    _forget_choices()


def prefer(choices: Mapping[str, str]) -> None:
    """Use these implementations (op -> name) for every later call they support, and let
    the table choose for the others (a pin that cannot run is an error instead): what a
    memory model or a comparison that assumes given implementations runs under. ``{}``
    clears; :func:`reset` keeps them."""
    parsed = parse_pins(",".join(f"{k}={v}" for k, v in choices.items()), "prefer")
    _preferred.clear()
    _preferred.update(parsed)
    _forget_choices()


def _adopted_key(op: str, device_type: str, dtype: str, shape: str) -> str:
    return f"{op}|{device_type}|{dtype}|{shape}"


def adopt(chosen: Mapping[str, Mapping[str, Any]], source: str = "choices") -> None:
    """Make the choices another process made (:func:`choices`, a run's ``dispatch.json``,
    rank 0's under DDP) this one's, per op, device type, dtype and shape class; a call
    they do not cover is chosen as usual. ``{}`` clears. A record naming an op or an
    implementation the table does not know is a :class:`DispatchError`."""
    adopted: dict[str, str] = {}
    for record in chosen.values():
        try:
            op, name = record["op"], record["implementation"]
            device_type = torch.device(record["device"]).type
            key = _adopted_key(op, device_type, record["dtype"], record["shape"])
        except (KeyError, TypeError, RuntimeError):
            raise DispatchError(f"{source}: {record!r} is not a dispatch choice (op, "
                                "implementation, device, dtype, shape)") from None
        entry = TABLE.get(op)
        if entry is None:
            raise DispatchError(f"{source}: unknown op {op!r}; expected one of {_pinnable()}")
        adopted[key] = entry.resolve(name, device_type, source)
    _adopted.clear()
    _adopted.update(adopted)
    _forget_choices()


def read_choices(path: str) -> dict[str, dict[str, Any]]:
    """The choices stored in a run's ``dispatch.json`` (:func:`choices`' form)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise DispatchError(f"cannot read the dispatch choices {path}: {exc.strerror}") from None
    except ValueError:
        raise DispatchError(f"{path}: not JSON; expected a run's dispatch.json") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise DispatchError(f"{path}: expected a run's dispatch.json (an object of choices)")
    return data


def apply_setting(setting: str, source: str) -> str:
    """The config key / flag ``dispatch``: ``op=name[,op=name]`` pins (:func:`pin`), or the
    path of a run's ``dispatch.json`` whose choices are adopted (:func:`adopt`); empty or
    ``auto``: the table chooses. Returns a description for the log."""
    setting = (setting or "").strip()
    if not setting or setting == AUTO:
        return "auto"
    if setting.endswith(".json") or os.path.isfile(setting):
        chosen = read_choices(setting)
        adopt(chosen, source=setting)
        return f"{len(chosen)} choice(s) adopted from {setting}"
    pins = parse_pins(setting, source)
    pin(pins)
    return "pinned " + ",".join(f"{k}={v}" for k, v in pins.items())


def pins() -> dict[str, str]:
    """The pins set by :func:`pin` (op -> implementation)."""
    return dict(_pins)


def reset() -> None:
    """Forget every choice, check, pin, report and the override (read again next time)."""
    global _override
    _override = None
    for d in (_pins, _adopted, _by_device_type, _checked):
        d.clear()
    _forget_choices()
    _reported.clear()
    counters.update(checked=0, timed=0)


def choices() -> dict[str, dict[str, Any]]:
    """The choices made so far in this process, by ``"op dtype shape"``."""
    return {f"{c.op} {c.device} {c.dtype} {c.shape}": c.as_dict()
            for c in _memo.values()}


# ----------------------------------------------------------------------- cache key
def device_name(device: torch.device) -> str:
    """What a timing depends on: the CPU's model and the level the kernels run at; the
    GPU's name, driver and CUDA version."""
    device = torch.device(device)
    if device.type == "cpu":
        from ..cpu_isa import cpu_info
        info = cpu_info()
        return f"cpu {info.model or info.arch} {info.level}"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        driver = getattr(torch._C, "_cuda_getDriverVersion", lambda: "?")()
        return (f"cuda {torch.cuda.get_device_name(index)} driver {driver} "
                f"CUDA {torch.version.cuda}")
    return device.type


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_text(shape: ShapeClass) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def cache_key(op: str, device: str, dtype: torch.dtype, shape: ShapeClass) -> str:
    """The on-disk key: device name (:func:`device_name`), torch version, op with its
    candidates (a new implementation is measured, not passed over), dtype, shape class."""
    entry = TABLE.get(op)
    if entry is not None:
        timed = [*entry.implementations] if entry.reference_competes else \
            [n for n, i in entry.implementations.items() if i.fn is not entry.reference]
        op = f"{op} [{','.join(timed)}]"
    return " | ".join((device, f"torch {torch.__version__}", op, dtype_name(dtype),
                       shape_text(shape)))


def cache_path():
    return cache_root() / CACHE_FILE


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        return {}
    entries = data.get("choices")
    return entries if isinstance(entries, dict) else {}


def _write_cache(key: str, record: dict[str, Any]) -> None:
    """Add one record; temp file + ``os.replace``, so a reader never sees half a file.
    A cache that cannot be written costs a new measurement next time, nothing else."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = _read_cache()
        entries[key] = record
        fd, tmp = tempfile.mkstemp(prefix=".dispatch-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"format": CACHE_FORMAT, "choices": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        _warn(f"dispatch: cannot write {path} ({exc}); the choice is measured again next run")


# --------------------------------------------------------------------------- checks
def _relative_error(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _stacked(y: Tensor | Sequence[Tensor]) -> Tensor:
    """An op's result as one tensor (a tuple of results stacked)."""
    return y if isinstance(y, Tensor) else torch.stack(list(y))


def _backward(y: Tensor | Sequence[Tensor], leaves: Sequence[Tensor], gy: Tensor | None):
    """The gradients of ``leaves`` for the upstream gradient ``gy`` (ones when None) of a
    result (a tuple's slice by slice)."""
    outs = [y] if isinstance(y, Tensor) else list(y)
    if gy is None:
        grads_out = [torch.ones_like(o) for o in outs]
    else:
        grads_out = [gy.to(outs[0].dtype)] if isinstance(y, Tensor) else \
            [g.to(o.dtype) for g, o in zip(gy.unbind(0), outs, strict=True)]
    return torch.autograd.grad(outs, leaves, grads_out, allow_unused=True)


def _outputs_and_grads(fn: Callable[..., Any], xs: Sequence[Tensor], attrs: Attrs,
                       gy: Tensor):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    y = fn(*leaves, **attrs)
    wants = [x for x in leaves if x.requires_grad]
    grads = _backward(y, wants, gy)
    return _stacked(y), [torch.zeros_like(x) if g is None else g
                         for x, g in zip(wants, grads, strict=True)]


def check(op: Op, impl: Implementation, device: torch.device, dtype: torch.dtype,
          attrs: Attrs | None = None, shape: ShapeClass | None = None) -> str | None:
    """None if ``impl`` matches ``op``'s reference at the small check shape (forward and
    gradients, within ``op.tolerance``), else why not. Once per process and kind of call
    (the check's attributes, from the call's ``attrs``)."""
    check_dtype = torch.float64 if impl.takes_float64 else dtype
    try:
        xs, check_attrs = op.check_inputs(device, check_dtype, dict(attrs or {}),
                                          dict(shape or {}))
    except Exception as exc:
        return f"no check inputs: {type(exc).__name__}: {exc}"
    key = (op.name, impl.name, str(device), str(check_dtype),
           repr((sorted(check_attrs.items()), [(tuple(x.shape), x.dtype) for x in xs])))
    if key in _checked:
        return _checked[key]
    counters["checked"] += 1
    problem: str | None = None
    try:
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            exact = [x.double() if x.is_floating_point() else x for x in xs]
            gen = torch.Generator(device="cpu").manual_seed(1)
            y_ref0 = _stacked(op.reference(*exact, **check_attrs))
            gy = torch.randn(y_ref0.shape, generator=gen, dtype=torch.float64).to(device)
            y_ref, g_ref = _outputs_and_grads(op.reference, exact, check_attrs, gy)
            y, g = _outputs_and_grads(impl.fn, xs, check_attrs, gy)
        tolerance = max(op.tolerance[check_dtype], op.tolerance.get(y.dtype, 0.0))
        if tuple(y.shape) != tuple(y_ref.shape):
            problem = f"output shape {tuple(y.shape)}, expected {tuple(y_ref.shape)}"
        else:
            errors = {"output": _relative_error(y, y_ref)}
            errors.update({f"gradient {i}": _relative_error(a, b)
                           for i, (a, b) in enumerate(zip(g, g_ref, strict=True))})
            worst = max(errors, key=errors.__getitem__)
            if not errors[worst] <= tolerance:  # NaN fails too
                problem = (f"{worst} differs from the reference by {errors[worst]:.2e} "
                           f"(tolerance {tolerance:.0e}, {dtype_name(check_dtype)})")
    except Exception as exc:  # any failure drops the candidate, with its reason
        problem = f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    _checked[key] = problem
    return problem


def _timer(impl: Implementation, args: Sequence[Any], attrs: Attrs,
           needs_grad: bool) -> Callable[[], float]:
    """A function that runs ``impl`` once on copies of ``args`` and returns its
    milliseconds (forward and backward when gradients are needed; copies, so an
    implementation that writes into its input, as one may without grad, leaves the
    caller's tensors alone)."""
    counters["timed"] += 1
    device = next(a.device for a in args if isinstance(a, Tensor))
    xs = [a.detach().clone().requires_grad_(needs_grad and a.requires_grad)
          if isinstance(a, Tensor) else a for a in args]

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.set_grad_enabled(needs_grad):
            y = impl.fn(*xs, **attrs)
            if needs_grad:
                _backward(y, [x for x in xs if isinstance(x, Tensor) and x.requires_grad], None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3

    return once


def _same(x: Tensor) -> Tensor:
    return x


def _auto(op: Op, args: Sequence[Any], attrs: Attrs, device: torch.device, dtype: torch.dtype,
          shape: ShapeClass) -> dict[str, float]:
    survivors = []
    for impl in op.implementations.values():
        if impl.supports(device, dtype, shape) is not None:
            continue
        problem = check(op, impl, device, dtype, attrs, shape)
        if problem is None:
            survivors.append(impl)
        elif f"{op.name} {impl.name} {problem}" not in _reported:
            _reported.add(f"{op.name} {impl.name} {problem}")
            _warn(f"dispatch: {op.name}: dropped {impl.name}: {problem}")
    if not op.reference_competes and any(impl.fn is not op.reference for impl in survivors):
        # the reference is the oracle, not a contender: timing it at the real shape (a
        # long image sequence) costs seconds and memory for a result known in advance
        survivors = [impl for impl in survivors if impl.fn is not op.reference]
    needs_grad = _needs_grad(args)
    # one warm-up run each (first-use builds; a candidate far slower than the best so far
    # keeps that run as its time), then rounds in turn, each candidate's best run: a
    # moment of load elsewhere on the machine slows one run, not one candidate
    times: dict[str, float] = {}
    timers: dict[str, Callable[[], float]] = {}
    for impl in survivors:
        best = min(times.values(), default=float("inf"))
        try:
            timer = _timer(impl, args, attrs, needs_grad)
            times[impl.name] = timer()
        except Exception as exc:  # runs at the small shape, fails at the real one
            _warn(f"dispatch: {op.name}: dropped {impl.name}: raised {type(exc).__name__} at "
                  f"{shape_text(shape)}: {str(exc).splitlines()[0] if str(exc) else ''}")
            continue
        if times[impl.name] <= best * GIVE_UP_FACTOR:
            timers[impl.name] = timer
    rounds = TIMED_ITERATIONS if len(timers) > 1 else 0  # one contender: nothing to compare
    for _ in range(rounds):
        for name, timer in timers.items():
            times[name] = min(times[name], timer())
    if not times:
        raise op.error(f"no {op.name} implementation runs {dtype} on {device} at "
                       f"{shape_text(shape)}; candidates: {', '.join(op.implementations)}")
    return times


# ------------------------------------------------------------------------ choosing
def _memo_key(op: Op, device: torch.device, dtype: torch.dtype, shape: ShapeClass) -> str:
    """The key of a choice in this process: op, device, dtype, shape class (pass included)."""
    return f"{op.name}|{device}|{dtype}|{shape_text(shape)}"


def _remember(choice: Choice, memo_key: str, device_type: str) -> None:
    _memo[memo_key] = choice
    _by_device_type[f"{choice.op}:{device_type}"] = choice.implementation
    said = f"{memo_key}|{choice.implementation}|{choice.how}"
    if said not in _reported:  # once per process, again only if the choice changes
        _reported.add(said)
        _report(choice.line())


def _abstract(args: Sequence[Any]) -> bool:
    """Meta or fake tensors (shape propagation, the memory planner): nothing to time."""
    from torch._subclasses.fake_tensor import FakeTensor
    return any(isinstance(a, FakeTensor) or (isinstance(a, Tensor) and a.device.type == "meta")
               for a in args)


def _exporting() -> bool:
    return torch.jit.is_tracing() or torch.compiler.is_exporting()


def _eager_choice(op: Op, args: Sequence[Any], attrs: Attrs) -> str | None:
    """The choice made in eager for a call of these static shapes, device and dtype
    (either pass), if any; None for symbolic shapes (reading them would specialise)."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    if not all(isinstance(d, int) for t in tensors for d in t.shape):
        return None
    try:
        shape = dict(op.shape_class(*args, **attrs))
    except Exception:  # a shape class that needs real data: the device type's choice
        return None
    for extra in ({"pass": "fwd+bwd"}, {}):
        known = _memo.get(_memo_key(op, args[0].device, args[0].dtype, {**shape, **extra}))
        if known is not None:
            return known.implementation
    return None


def _traced(op: Op, device: torch.device, pinned: str | None, args: Sequence[Any] = (),
            attrs: Attrs | None = None) -> Implementation:
    """Under ``torch.compile`` tracing, and on meta or fake tensors, nothing is checked
    or timed: a pin, else the choice made in eager for the same shape class, else the
    last choice made on this device type in eager, else the
    first implementation registered for it that is not the reference (for a device no
    implementation names, such as meta, the first registered that is not the reference:
    its fake implementation gives the shapes). Under ``torch.export`` and TorchScript
    tracing, the op's ``on_export`` where it names one."""
    if op.on_export is not None and _exporting():  # a graph of plain ops, whatever the pins
        return op.implementations[op.on_export]
    name = pinned or override().get(op.name) or _pins.get(op.name)
    if name:
        return op.implementations[op.resolve(name, device.type)]
    last = (_eager_choice(op, args, attrs or {}) if args else None) \
        or _by_device_type.get(f"{op.name}:{device.type}")
    if last is not None:
        return op.implementations[last]
    others = [impl for impl in op.implementations.values() if impl.fn is not op.reference]
    for impl in others:
        if device.type in impl.device_types:
            return impl
    return (others or list(op.implementations.values()))[0]


def _needs_grad(args: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad
                                           for a in args)


def _call_shape(op: Op, args: Sequence[Any], attrs: Attrs) -> dict[str, Any]:
    """The op's shape class of a call, with ``pass=fwd+bwd`` where it needs gradients."""
    shape = dict(op.shape_class(*args, **attrs))
    if _needs_grad(args):
        shape["pass"] = "fwd+bwd"
    return shape


def choose(op_name: str, args: Sequence[Any], pinned: str | None = None,
           attrs: Attrs | None = None) -> Implementation:
    """The implementation of ``op_name`` for a call with tensors ``args`` (the device and
    dtype of ``args[0]``; the op's shape class) and static attributes ``attrs``;
    ``pinned``: a name (or alias) to use, ``"auto"`` or None to let the table choose."""
    op = TABLE[op_name]
    attrs = attrs or {}
    device, dtype = args[0].device, args[0].dtype
    if pinned == AUTO:
        pinned = None
    if torch.compiler.is_compiling() or _abstract(args) or _exporting():
        return _traced(op, device, pinned, args, attrs)
    shape = _call_shape(op, args, attrs)
    memo_key = _memo_key(op, device, dtype, shape)
    sources = (("argument", pinned), (OVERRIDE_ENV_VAR, override().get(op.name)),
               ("pin", _pins.get(op.name)))
    source, name = next(((s, n) for s, n in sources if n), ("", None))
    if name is not None:
        impl = op.implementations[op.resolve(name, device.type, source)]
        reason = impl.supports(device, dtype, shape)
        if reason is not None:
            raise op.error(f"{op.name} implementation {impl.name!r} (from {source}) cannot run "
                           f"here: {reason}")
        how = "override" if source == OVERRIDE_ENV_VAR else "pinned"
        if _memo.get(memo_key, None) is None or _memo[memo_key].implementation != impl.name:
            _remember(Choice(op.name, impl.name, str(device), dtype_name(dtype), shape_text(shape), how),
                      memo_key, device.type)
        return impl
    known = _memo.get(memo_key)
    if known is not None and known.how not in ("pinned", "override"):
        return op.implementations[known.implementation]
    adopted = _adopted.get(_adopted_key(op.name, device.type, dtype_name(dtype),
                                        shape_text(shape)))
    if adopted is not None and op.implementations[adopted].supports(device, dtype, shape) is None:
        _remember(Choice(op.name, adopted, str(device), dtype_name(dtype), shape_text(shape),
                         "adopted"), memo_key, device.type)
        return op.implementations[adopted]
    preferred = _preferred.get(op.name)
    if preferred is not None:
        impl = op.implementations[op.resolve(preferred, device.type, "prefer")]
        if impl.supports(device, dtype, shape) is None:
            _remember(Choice(op.name, impl.name, str(device), dtype_name(dtype),
                             shape_text(shape), "preferred"), memo_key, device.type)
            return impl
    disk_key = cache_key(op.name, device_name(device), dtype, shape)
    record = _read_cache().get(disk_key)
    if (isinstance(record, dict) and record.get("implementation") in op.implementations
            and op.implementations[record["implementation"]].supports(device, dtype, shape)
            is None):
        choice = Choice(op.name, record["implementation"], str(device), dtype_name(dtype),
                        shape_text(shape), "cache", dict(record.get("times_ms", {})))
    else:
        # the caller must not see the measuring runs: identity hooks, innermost, shadow
        # its saved-tensor hooks (memory counts, activation offload), and its dispatch
        # modes are set aside (a caching one, as in selective activation checkpointing,
        # would replay their outputs in the recompute; a counting one would count them)
        with torch.autograd.graph.saved_tensors_hooks(_same, _same), _disable_current_modes():
            times = _auto(op, args, attrs, device, dtype, shape)
        winner = min(times, key=times.__getitem__)
        choice = Choice(op.name, winner, str(device), dtype_name(dtype), shape_text(shape), "auto",
                        times)
        _write_cache(disk_key, {"implementation": winner, "times_ms": times})
    _remember(choice, memo_key, device.type)
    return op.implementations[choice.implementation]


__all__ = ["CACHE_FILE", "ENV_VARS", "OVERRIDE_ENV_VAR", "REPLACED_ENV_VARS", "TABLE",
           "Choice", "DispatchError", "Implementation", "Op", "cache_key",
           "cache_path", "check", "check_replaced_env_vars", "choices", "choose", "counters",
           "adopt", "apply_setting", "device_name", "dtype_name", "get_op", "override", "parse_pins", "pin",
           "pinned", "pins", "prefer", "read_choices",
           "register_op", "reset", "set_reporter"]
