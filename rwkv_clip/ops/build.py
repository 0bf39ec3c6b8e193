"""Lazy, cached builds of the native WKV kernels.

Nothing here runs at import. :func:`get_cpu_kernel` and :func:`get_cuda_kernel` compile
on first use with ``torch.utils.cpp_extension.load`` (ninja) and keep the result on disk,
one build folder per variant:

* CPU  - one build for every head size (the head size is a runtime argument; 32, 64,
  80 and 128 have compile-time specialisations), tagged with the instruction set used.
* CUDA - one build per (variant, head size N, T_max bucket). T_max buckets are 256,
  then powers of two up to :data:`CUDA_T_MAX` (4096).

Cache root: ``$RWKV_CLIP_KERNEL_CACHE`` if set, else ``$TORCH_EXTENSIONS_DIR/rwkv_clip``
if that is set, else ``~/.cache/rwkv_clip/kernels``; below it one folder per torch
version and CUDA version. Concurrent builders (torchrun ranks, parallel pytest runs)
are serialised by cpp_extension's lock file in the build folder: the first process
builds, the others wait and then load the finished module.

Every size or toolchain problem is raised as :class:`rwkv_clip.ops.WKVError` before
any compiler runs.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.resources
import logging
import os
import re
import shutil
import sys
import threading
from pathlib import Path

import torch

CUDA_T_MAX = 4096
CUDA_T_BUCKETS = (256, 512, 1024, 2048, 4096)
CUDA_MAX_HEAD_SIZE = 256
CUDA_VARIANTS = ("faithful", "fast")
DEFAULT_CUDA_VARIANT = "faithful"
CUDA_VARIANT_ENV_VAR = "RWKV_CLIP_WKV_CUDA_VARIANT"

_lock = threading.Lock()
_loaded: dict[tuple, object] = {}


def _error(msg: str) -> Exception:
    from . import WKVError  # late import: ops/__init__ imports nothing from here
    return WKVError(msg)


# ---------------------------------------------------------------------------- sources
def source_dir() -> Path:
    """The folder holding the kernel sources: the checkout's cuda/ or the installed package."""
    here = Path(__file__).resolve().parents[2] / "cuda"
    if (here / "wkv6_cpu.cpp").is_file():
        return here
    try:
        pkg = importlib.resources.files("rwkv_clip.cuda")
        path = Path(str(pkg))
        if (path / "wkv6_cpu.cpp").is_file():
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    raise _error("rwkv_clip: kernel sources not found (expected cuda/wkv6_cpu.cpp in the source "
                 "checkout or in the installed package rwkv_clip.cuda)")


# ------------------------------------------------------------------------------ cache
def cache_root() -> Path:
    base = os.environ.get("RWKV_CLIP_KERNEL_CACHE")
    if base:
        root = Path(base)
    elif os.environ.get("TORCH_EXTENSIONS_DIR"):
        root = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "rwkv_clip"
    else:
        root = Path.home() / ".cache" / "rwkv_clip" / "kernels"
    tag = "torch" + torch.__version__.replace("+", "_")
    tag += "_py%d%d" % sys.version_info[:2]
    return root / tag


def _build_dir(name: str) -> Path:
    d = cache_root() / name
    d.mkdir(parents=True, exist_ok=True)
    return d


# --------------------------------------------------------------------------- toolchain
def _cpu_isa_flags() -> tuple[str, list[str]]:
    """Instruction-set flags the build machine supports (tag, flags). The tag goes into
    the cache name so a shared cache never hands AVX2 code to an older CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set()
            for line in f:
                if line.startswith("flags"):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        flags = set()
    if {"avx2", "fma"} <= flags:
        return "avx2", ["-mavx2", "-mfma"]
    return "base", []


def _check_cxx() -> None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        raise _error(f"rwkv_clip: building the WKV kernel needs a C++ compiler ({cxx!r} or g++) "
                     "on PATH; install one (e.g. apt-get install g++) or use backend='reference'")
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
            bindir = Path(ninja.BIN_DIR)
            os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
        except Exception:
            raise _error("rwkv_clip: building the WKV kernel needs ninja (pip install ninja)")


def _is_toolkit_root(p: Path) -> bool:
    """A CUDA toolkit root: bin/nvcc, include/cuda_runtime.h and a libcudart."""
    if not ((p / "bin" / "nvcc").is_file() and (p / "include" / "cuda_runtime.h").is_file()):
        return False
    libs = [*p.glob("lib64/libcudart*"), *p.glob("lib/libcudart*"),
            *p.glob("targets/*/lib/libcudart*")]
    return bool(libs)


def find_cuda_home() -> Path | None:
    """The real CUDA toolkit root (bin/nvcc + libcudart), or None.

    Honours CUDA_HOME / CUDA_PATH; otherwise follows ``nvcc`` on PATH through symlinks
    and through simple wrapper scripts (``exec /usr/local/cuda-X/bin/nvcc "$@"``), then
    falls back to /usr/local/cuda*."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and _is_toolkit_root(Path(os.environ[var])):
            return Path(os.environ[var])
    candidates: list[Path] = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(os.path.realpath(nvcc))
        candidates.append(real.parent.parent)
        try:
            if real.stat().st_size < 64 * 1024:
                text = real.read_text(errors="ignore")
                for m in re.finditer(r"(/[^\s'\"]+)/bin/nvcc\b", text):
                    candidates.append(Path(m.group(1)))
        except OSError:
            pass
    want = (torch.version.cuda or "").split(".")[0]
    local = sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    local.sort(key=lambda p: not Path(p).name.startswith(f"cuda-{want}."))  # matching major first
    candidates += [Path("/usr/local/cuda")] + [Path(p) for p in local]
    for c in candidates:
        if _is_toolkit_root(c):
            return c.resolve()
    return None


def _prepare_cuda_toolchain() -> Path:
    if torch.version.cuda is None:
        raise _error("rwkv_clip: this torch build has no CUDA support, so the CUDA WKV kernel "
                     "cannot be built")
    home = find_cuda_home()
    if home is None:
        raise _error("rwkv_clip: building the CUDA WKV kernel needs the CUDA toolkit (a folder "
                     "with bin/nvcc and lib64/libcudart*); set CUDA_HOME or put nvcc on PATH")
    if not os.environ.get("CUDA_HOME"):
        os.environ["CUDA_HOME"] = str(home)
    import torch.utils.cpp_extension as ext
    cur = getattr(ext, "CUDA_HOME", None)
    if cur is None or not _is_toolkit_root(Path(cur)):
        ext.CUDA_HOME = str(home)  # cpp_extension guessed wrongly at import (wrapper nvcc)
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        if torch.cuda.is_available():
            archs = sorted({"%d.%d" % torch.cuda.get_device_capability(i)
                            for i in range(torch.cuda.device_count())})
            os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
    return home


# ----------------------------------------------------------------------------- sizes
def cuda_t_bucket(T: int) -> int:
    for b in CUDA_T_BUCKETS:
        if T <= b:
            return b
    raise _error(f"rwkv_clip: sequence length T={T} exceeds the CUDA WKV kernel's maximum "
                 f"T_max={CUDA_T_MAX}; use shorter sequences or backend='reference'")


def check_cuda_head_size(N: int) -> None:
    if N % 4 != 0 or N < 4 or N > CUDA_MAX_HEAD_SIZE:
        raise _error(f"rwkv_clip: head size N={N} is not supported by the CUDA WKV kernel "
                     f"(expected a multiple of 4 between 4 and {CUDA_MAX_HEAD_SIZE})")


def resolve_cuda_variant(variant: str | None = None) -> str:
    choice = variant or os.environ.get(CUDA_VARIANT_ENV_VAR) or DEFAULT_CUDA_VARIANT
    if choice not in CUDA_VARIANTS:
        raise _error(f"rwkv_clip: unknown CUDA WKV variant {choice!r}; expected one of {CUDA_VARIANTS}")
    return choice


# ---------------------------------------------------------------------------- builders
STALE_LOCK_SECONDS = 30 * 60


def _clear_stale_lock(build_dir: Path) -> None:
    """cpp_extension serialises builders with a 'lock' file in the build folder and waits
    for it to vanish. A builder killed mid-build leaves it behind and every later process
    would wait forever; a lock older than any real build is removed with a warning."""
    import time
    import warnings
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        warnings.warn(f"rwkv_clip: removing stale kernel build lock {lock} ({age / 60:.0f} min old)")
        try:
            lock.unlink()
        except FileNotFoundError:
            pass


@contextlib.contextmanager
def _quiet_logger(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _load(name: str, sources: list[Path], verbose: bool, **kw):
    if not os.environ.get("CUDA_HOME"):
        # cpp_extension guesses the toolkit root at import and warns when the guess (from
        # the nvcc wrapper) is wrong; point it at the real root first, even for CPU builds
        home = find_cuda_home()
        if home is not None:
            os.environ["CUDA_HOME"] = str(home)
    with _quiet_logger("torch.utils.cpp_extension"):  # "No CUDA runtime is found" on CPU hosts
        from torch.utils.cpp_extension import load
    build_dir = _build_dir(name)
    _clear_stale_lock(build_dir)
    return load(name=name, sources=[str(s) for s in sources], build_directory=str(build_dir),
                verbose=verbose, **kw)


def cpu_kernel_name() -> str:
    tag, _ = _cpu_isa_flags()
    return f"rwkv_clip_wkv6_cpu_{tag}"


def get_cpu_kernel(verbose: bool = False):
    """The compiled CPU kernel module (forward, backward); builds it on first use."""
    name = cpu_kernel_name()
    with _lock:
        mod = _loaded.get(("cpu",))
        if mod is not None:
            return mod
        _check_cxx()
        _, isa = _cpu_isa_flags()
        flags = ["-O3", "-fopenmp"] + isa
        mod = _load(name, [source_dir() / "wkv6_cpu.cpp"], verbose,
                    extra_cflags=flags, extra_ldflags=["-fopenmp"])
        _loaded[("cpu",)] = mod
        return mod


def cuda_kernel_name(N: int, t_max: int, variant: str) -> str:
    cu = (torch.version.cuda or "none").replace(".", "")
    return f"rwkv_clip_wkv6_cuda{cu}_{variant}_N{N}_T{t_max}"


def get_cuda_kernel(N: int, T: int, variant: str | None = None, verbose: bool = False):
    """The compiled CUDA kernel for head size N and sequence length T (T_max bucket)."""
    variant = resolve_cuda_variant(variant)
    check_cuda_head_size(N)
    t_max = cuda_t_bucket(T)
    key = ("cuda", variant, N, t_max)
    with _lock:
        mod = _loaded.get(key)
        if mod is not None:
            return mod
        _check_cxx()
        _prepare_cuda_toolchain()
        src = source_dir()
        cu_file = "wkv6_cuda.cu" if variant == "faithful" else "wkv6_cuda_fast.cu"
        defines = [f"-DWKV_N={N}", f"-DWKV_TMAX={t_max}"]
        if variant == "fast":
            defines.append("-DWKV_VARIANT_FAST")
        mod = _load(cuda_kernel_name(N, t_max, variant), [src / "wkv6_op.cpp", src / cu_file],
                    verbose, extra_cflags=["-O3"] + defines,
                    extra_cuda_cflags=["-O3", "-Xptxas", "-O3", "--use_fast_math",
                                       "--extra-device-vectorization"] + defines)
        _loaded[key] = mod
        return mod
