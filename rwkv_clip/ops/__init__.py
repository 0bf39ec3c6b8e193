"""The bidirectional WKV6 operator behind both RWKV-CLIP towers.

One entry point, :func:`wkv6_bidirectional`; its implementations sit in the dispatch
table (:mod:`.dispatch`), op ``wkv``: ``reference`` (pure PyTorch, the oracle), ``cpu``
(the native CPU kernel, :mod:`.kernels`), and on CUDA ``cuda-fast``, ``cuda-faithful``
(nvcc builds) and ``chunked`` (Triton). The table chooses per device, dtype and shape
class (docs/wkv.md, "Choosing an implementation"). Nothing is compiled at import.
"""
from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable

import torch

from ..cpu_isa import cpu_info
from ..errors import WKVError
from . import build, cache, dispatch, kernels
from .reference import wkv6_bidirectional_reference

# the old backend names, kept as pins: "cpu" and "reference" are implementations
LEGACY_ALIASES = {"cuda": {"cuda": "cuda-fast"}}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CHECK_SIZES = dict(B=1, T=20, H=2, N=16)  # two chunks of the chunked kernel, N % 16 == 0


def _wkv_check_inputs(device: torch.device, dtype: torch.dtype, attrs, shape) -> tuple[list, dict]:
    """Small WKV inputs in the ranges the model feeds (decay logits around -1.5)."""
    B, T, H, N = _CHECK_SIZES.values()
    g = torch.Generator().manual_seed(0)
    shape = (B, T, H * N)
    r, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    k = torch.randn(shape, generator=g) * 0.5
    w = torch.randn(shape, generator=g) * 0.7 - 1.5
    u = torch.randn(H, N, generator=g) * 0.5
    return [x.to(device=device, dtype=dtype) for x in (r, k, v, w, u)], {}


def _wkv_shape_class(r, k, v, w, u) -> dict[str, int]:
    return {"T": int(r.shape[1]), "N": int(u.shape[1])}


def _on(device_type: str, device: torch.device) -> str | None:
    if device.type != device_type:
        return f"needs {device_type.upper()} tensors, got tensors on {device}"
    return None


def _float_dtype(dtype: torch.dtype) -> str | None:
    return None if dtype in _FLOATS else f"takes {', '.join(map(str, _FLOATS))}, not {dtype}"


def _reference_supports(device, dtype, shape) -> str | None:
    return None if dtype.is_floating_point else f"takes floating dtypes, not {dtype}"


def _cpu_supports(device, dtype, shape) -> str | None:
    return _on("cpu", device) or _float_dtype(dtype)


def _cuda_supports(device, dtype, shape) -> str | None:
    return _on("cuda", device) or _float_dtype(dtype) or build.cuda_head_size_problem(shape["N"])


def _chunked_supports(device, dtype, shape) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "needs Triton, which is not installed"
    return (_on("cuda", device) or _float_dtype(dtype)
            or build.chunked_head_size_problem(shape["N"]))


def _wkv_cpu(r, k, v, w, u):
    return kernels.wkv6_forward(r, k, v, w, u)


def _wkv_cuda_fast(r, k, v, w, u):
    return kernels.wkv6_forward(r, k, v, w, u, "fast")


def _wkv_cuda_faithful(r, k, v, w, u):
    return kernels.wkv6_forward(r, k, v, w, u, "faithful")


def _wkv_chunked(r, k, v, w, u):
    return kernels.wkv6_forward(r, k, v, w, u, "chunked")


WKV = dispatch.register_op(dispatch.Op(
    name="wkv", reference=wkv6_bidirectional_reference, check_inputs=_wkv_check_inputs,
    # relative to max |reference|: the kernels accumulate in float32 and return float32;
    # bf16/fp16 gradients are rounded to their input's dtype
    tolerance={torch.float64: 1e-5, torch.float32: 1e-4, torch.float16: 1e-2,
               torch.bfloat16: 2e-2},
    shape_class=_wkv_shape_class, error=WKVError, aliases=LEGACY_ALIASES))
# registration order: the default under torch.compile tracing, fastest kinds first
WKV.register(dispatch.Implementation("cuda-fast", _wkv_cuda_fast, _cuda_supports, ("cuda",),
                                     takes_float64=False))
WKV.register(dispatch.Implementation("cuda-faithful", _wkv_cuda_faithful, _cuda_supports,
                                     ("cuda",), takes_float64=False))
WKV.register(dispatch.Implementation("chunked", _wkv_chunked, _chunked_supports, ("cuda",),
                                     takes_float64=False))
WKV.register(dispatch.Implementation("cpu", _wkv_cpu, _cpu_supports, ("cpu",)))
WKV.register(dispatch.Implementation("reference", wkv6_bidirectional_reference,
                                     _reference_supports, ("cpu", "cuda", "mps", "xpu")))


def check_wkv_environment() -> None:
    """``$RWKV_CLIP_DISPATCH`` names known ops and implementations: a :class:`WKVError`
    (unknown implementation) or :class:`rwkv_clip.ops.dispatch.DispatchError` (unknown
    op) naming the allowed ones otherwise, on every device."""
    dispatch.override()


def _pinned_wkv(backend: str | None) -> tuple[str | None, str]:
    """The WKV implementation pinned by ``backend``, the override or :func:`dispatch.pin`,
    and by which (None: the table chooses)."""
    if backend and backend != dispatch.AUTO:
        return backend, "pinned"
    if "wkv" in dispatch.override():
        return dispatch.override()["wkv"], f"{dispatch.OVERRIDE_ENV_VAR}"
    return dispatch.pins().get("wkv"), "pinned"


def describe_wkv(device: torch.device | str, backend: str | None = None) -> str:
    """The one line that says how the WKV implementation is chosen on ``device``: the
    pinned one, or the candidates ``auto`` checks and times (and the cache it keeps). A
    pin that cannot run on ``device`` is a :class:`WKVError` here, before any set-up."""
    check_wkv_environment()
    device = torch.device(device)
    name, how = _pinned_wkv(backend)
    if name is not None:
        chosen = WKV.resolve(name, device.type, how)
        if device.type not in WKV.implementations[chosen].device_types:
            here = [i.name for i in WKV.implementations.values() if device.type in i.device_types]
            raise WKVError(f"wkv implementation {chosen!r} (from {how}) does not run on "
                           f"{device.type}; there: {', '.join(here)}")
        text = f"WKV: {chosen} ({how})"
        names = [chosen]
    else:
        names = [i.name for i in WKV.implementations.values() if device.type in i.device_types]
        text = (f"WKV: auto among {', '.join(names)} per dtype and length (cache "
                f"{dispatch.cache_path()}; override {dispatch.OVERRIDE_ENV_VAR}=wkv=NAME)")
    if "cpu" in names and device.type == "cpu":
        text += f"; cpu kernel {build.cpu_kernel_name()} on {cpu_info().describe()}"
    return text


def _nothing_to_wait_for(raise_error: bool = True) -> None:
    return None


def prepare_wkv_kernel(device: torch.device, notify: Callable[[str], None],
                       background: bool = False) -> Callable[..., None]:
    """Build (or load) the CPU WKV kernel before the first step, saying so through
    ``notify`` when it is not in the kernel cache yet (the first use compiles it). Other
    devices and the pure-PyTorch backend need nothing here.

    Returns ``wait(raise_error=True)``: it waits for the kernel and raises the build's
    error, if any (``raise_error=False`` on the way out of another error, which is the
    one to report). ``background=True`` compiles in a thread (the compiler is a
    subprocess, so the GIL is free) while the caller builds the model and the data."""
    if torch.device(device).type != "cpu":
        return _nothing_to_wait_for
    pinned, _ = _pinned_wkv(None)
    if pinned is not None and WKV.resolve(pinned, "cpu") != "cpu":
        return _nothing_to_wait_for
    if build.cpu_kernel_cached():
        return _nothing_to_wait_for
    notify(f"preparing the WKV CPU kernel (first use compiles it; cached in "
           f"{cache.cache_root()})")
    t0 = time.time()
    failure: list[BaseException] = []

    def compile_kernel() -> None:
        try:
            build.get_cpu_kernel()
            notify(f"WKV CPU kernel ready ({time.time() - t0:.0f} s)")
        except BaseException as exc:  # handed to the waiter, raised in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=compile_kernel, name="wkv-kernel-build", daemon=True)
    thread.start()

    def wait(raise_error: bool = True) -> None:
        thread.join()  # never leave a half-written build behind on exit
        if failure and raise_error:
            raise failure[0]
    if not background:
        wait()
    return wait


def check_inputs(r, k, v, w, u) -> tuple[int, int, int, int, int]:
    """Validate shapes, dtypes and devices before any kernel runs; returns (B, T, C, H, N)."""
    if r.dim() != 3:
        raise WKVError(f"wkv6: r must be (B, T, C), got shape {tuple(r.shape)}")
    B, T, C = r.shape
    for name, t in (("k", k), ("v", v), ("w", w)):
        if t.shape != r.shape:
            raise WKVError(f"wkv6: {name} has shape {tuple(t.shape)}, expected {tuple(r.shape)}")
    if u.dim() != 2:
        raise WKVError(f"wkv6: u must be (H, N), got shape {tuple(u.shape)}")
    H, N = u.shape
    if H * N != C:
        raise WKVError(f"wkv6: u is ({H}, {N}) but C = {C} is not H x N")
    if T < 1:
        raise WKVError("wkv6: sequence length T must be at least 1")
    for name, t in (("r", r), ("k", k), ("v", v), ("w", w), ("u", u)):
        if t.device != r.device:
            raise WKVError(f"wkv6: {name} is on {t.device} but r is on {r.device}")
        if not t.is_floating_point():
            raise WKVError(f"wkv6: {name} has dtype {t.dtype}, expected a floating dtype")
    return B, T, C, H, N


def wkv6_bidirectional(r, k, v, w, u, backend: str | None = None) -> torch.Tensor:
    """Bidirectional WKV6: a causal WKV6 with bonus ``u`` plus a time-reversed one without.

    r, k, v, w: (B, T, C), C = H * N, any float dtype (fp32, bf16, fp16; float64 for
    the reference); u: (H, N). Per-step decay is exp(-exp(w)). Returns float32
    (B, T, C) (float64 from the reference on float64 inputs).

    ``backend``: an implementation of the table's ``wkv`` op to pin (or ``"cuda"``, the
    fast CUDA kernel); None or ``"auto"``: the table chooses (:mod:`.dispatch`).
    """
    check_inputs(r, k, v, w, u)
    impl = dispatch.choose("wkv", (r, k, v, w, u), pinned=backend)
    return impl.fn(r, k, v, w, u)


# the rest of the table, pinnable as soon as it is: the glue ops and the products (linear,
# lowp_matmul)
from . import glue, products  # noqa: E402,F401

__all__ = ["WKV", "WKVError", "check_inputs", "check_wkv_environment", "describe_wkv",
           "dispatch", "prepare_wkv_kernel", "wkv6_bidirectional",
           "wkv6_bidirectional_reference"]
