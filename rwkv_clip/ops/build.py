"""Lazy, cached builds of the native WKV kernels.

Nothing here runs at import. :func:`get_cpu_kernel` and :func:`get_cuda_kernel` compile
on first use with ``torch.utils.cpp_extension`` (ninja) and keep the result on disk:

* CPU  - one build for every head size (the head size is a runtime argument; 32, 64,
  80 and 128 have compile-time specialisations), tagged with the instruction set used.
* CUDA - one build per (variant, head size N, T_max bucket). T_max buckets are 256,
  then powers of two up to :data:`CUDA_T_MAX` (4096).

Cache root: ``$RWKV_CLIP_KERNEL_CACHE`` if set, else ``$TORCH_EXTENSIONS_DIR/rwkv_clip``
if that is set, else ``~/.cache/rwkv_clip/kernels``. Below it each build has its own
folder named after a hash (:meth:`KernelSpec.key`) of everything that changes the
binary: source and header contents, compiler flags, the CUDA arch list, the compiler,
and the torch / CUDA / Python versions. Two checkouts with different sources therefore
never rebuild each other's kernels, and identical ones share a build. A finished build
is marked by ``built.json`` and loaded directly, without running ninja again.

Concurrent builders (torchrun ranks, parallel pytest runs) are serialised by an
``flock`` on ``build.lock`` in the build folder, which the OS releases when its holder
dies, so a killed builder never blocks the others; a live builder that takes longer than
``$RWKV_CLIP_KERNEL_LOCK_TIMEOUT`` seconds (default 1800) makes the waiters fail with an
error naming the lock file.

Size and toolchain problems raise :class:`rwkv_clip.errors.WKVError` before any compiler
runs; a failed compile raises :class:`rwkv_clip.errors.KernelBuildError` ending with the
compiler's last lines.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.resources
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import KernelBuildError, WKVError

CUDA_T_MAX = 4096
CUDA_T_BUCKETS = (256, 512, 1024, 2048, 4096)
CUDA_MAX_HEAD_SIZE = 256
CUDA_VARIANTS = ("faithful", "fast")
DEFAULT_CUDA_VARIANT = "faithful"
CUDA_VARIANT_ENV_VAR = "RWKV_CLIP_WKV_CUDA_VARIANT"

_lock = threading.Lock()
_loaded: dict[tuple, object] = {}


LOCK_TIMEOUT_ENV_VAR = "RWKV_CLIP_KERNEL_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT_S = 1800.0
# With no GPU visible (a login node, a CPU-only build job) and no TORCH_CUDA_ARCH_LIST,
# build for these; the last one also as PTX, so newer cards JIT-compile it. 7.5 covers T4s.
DEFAULT_CUDA_ARCHS = ("7.5", "8.0", "9.0")
COMPILER_TAIL_LINES = 25
CACHE_FORMAT = 3  # bump when the folder layout or the key's contents change


def _error(msg: str) -> Exception:
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
    return root  # versions are part of each build's key (KernelSpec.key_inputs)


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
            import ninja
            bindir = Path(ninja.BIN_DIR)
        except (ImportError, AttributeError):
            raise _error("rwkv_clip: building the WKV kernel needs ninja (pip install ninja)"
                         ) from None
        os.environ["PATH"] = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"


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
    with _quiet_logger("torch.utils.cpp_extension"):  # "No CUDA runtime" on CPU hosts
        import torch.utils.cpp_extension as ext
    cur = getattr(ext, "CUDA_HOME", None)
    if cur is None or not _is_toolkit_root(Path(cur)):
        ext.CUDA_HOME = str(home)  # cpp_extension guessed wrongly at import (wrapper nvcc)
    return home


_ARCH_RE = re.compile(r"^(\d+)\.(\d+)([a-z]?)(\+PTX)?$")


def cuda_arch_list() -> str:
    """The CUDA architectures to build for, e.g. ``"7.5;8.0;9.0+PTX"``.

    ``$TORCH_CUDA_ARCH_LIST`` is used as given. Otherwise the visible GPUs' capabilities
    (clamped to what this torch supports), else :data:`DEFAULT_CUDA_ARCHS`; either way the
    highest one also as PTX, so a card newer than any listed can still run the kernel.
    """
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env and env != "native":
        return ";".join(a for a in env.replace(" ", ";").split(";") if a)
    archs: list[tuple[int, int]] = []
    if torch.cuda.is_available():
        supported = [int(a.split("_")[1]) for a in torch.cuda.get_arch_list()
                     if a.startswith("sm_") and a.split("_")[1].isdigit()]
        top = max(((sm // 10, sm % 10) for sm in supported), default=(99, 9))
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            cap = min(top, (major, minor))
            if cap not in archs:
                archs.append(cap)
    if not archs:
        archs = [(int(a.split(".")[0]), int(a.split(".")[1])) for a in DEFAULT_CUDA_ARCHS]
    names = [f"{major}.{minor}" for major, minor in sorted(archs)]
    names[-1] += "+PTX"
    return ";".join(names)


def cuda_gencode_flags(arch_list: str) -> list[str]:
    """nvcc ``-gencode`` flags for an arch list such as ``"8.0;9.0+PTX"``.

    Passed explicitly, so cpp_extension adds none of its own and the list is the one in
    the cache key (nothing is written to ``TORCH_CUDA_ARCH_LIST``)."""
    flags: list[str] = []
    for arch in filter(None, arch_list.split(";")):
        m = _ARCH_RE.match(arch)
        if m is None:
            raise _error(f"rwkv_clip: CUDA arch {arch!r} (from TORCH_CUDA_ARCH_LIST or the GPU) "
                         "is not of the form MAJOR.MINOR[+PTX], e.g. '8.0;9.0+PTX'")
        num = f"{m.group(1)}{m.group(2)}{m.group(3)}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if m.group(4):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    if not flags:
        raise _error("rwkv_clip: the CUDA arch list is empty; set TORCH_CUDA_ARCH_LIST, "
                     "e.g. '8.0;9.0+PTX'")
    return flags


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


_env_overrides: dict[str, str | None] = {}


def env_override(name: str) -> str | None:
    """``os.environ[name]`` (None when unset or empty), read once per process and cached.

    The WKV op runs thousands of times per step and inside ``torch.compile``d graphs; an
    environment lookup per call costs time and, under tracing, a guard or a graph break.
    Tests that change the variable call :func:`reset_env_overrides`."""
    try:
        return _env_overrides[name]
    except KeyError:
        value = _env_overrides[name] = os.environ.get(name) or None
        return value


def reset_env_overrides() -> None:
    """Forget the cached environment overrides (read again on the next call)."""
    _env_overrides.clear()


def resolve_cuda_variant(variant: str | None = None) -> str:
    choice = variant or env_override(CUDA_VARIANT_ENV_VAR) or DEFAULT_CUDA_VARIANT
    if choice not in CUDA_VARIANTS:
        raise _error(f"rwkv_clip: unknown CUDA WKV variant {choice!r}; expected one of "
                     f"{CUDA_VARIANTS}")
    return choice


# ------------------------------------------------------------------------ cache key
@dataclass(frozen=True)
class KernelSpec:
    """Everything that decides one native build; :meth:`key` hashes it into the folder name."""

    what: str                       # for messages: "CPU (avx2)", "CUDA faithful, N=64, T<=256"
    base_name: str                  # module name before the hash
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()  # included files: not compiled, but part of the key
    cflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    arch_list: str | None = None    # CUDA builds only
    toolkit: str | None = None      # CUDA toolkit root, CUDA builds only
    # False: the sources register operators with TORCH_LIBRARY(TORCH_EXTENSION_NAME, ...)
    # instead of defining a pybind11 module; they are loaded with torch.ops.load_library
    python_module: bool = True

    def key_inputs(self) -> dict:
        """What goes into the key (also written to ``built.json`` for whoever looks)."""
        def digest(p: Path) -> str:
            try:
                return hashlib.sha256(p.read_bytes()).hexdigest()
            except OSError as e:
                raise _error(f"rwkv_clip: kernel source {p} cannot be read ({e})") from e
        return {
            "format": CACHE_FORMAT,
            # by file name, not path: identical sources in two checkouts share one build
            "sources": [[p.name, digest(p)] for p in self.sources],
            "headers": [[p.name, digest(p)] for p in self.headers],
            "cflags": list(self.cflags), "cuda_cflags": list(self.cuda_cflags),
            "ldflags": list(self.ldflags), "arch_list": self.arch_list,
            "toolkit": self.toolkit, "python_module": self.python_module,
            "cxx": os.environ.get("CXX", "c++"),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "python": platform.python_version(), "machine": platform.machine(),
        }

    def key(self) -> str:
        blob = json.dumps(self.key_inputs(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def name(self) -> str:
        return f"{self.base_name}_{self.key()}"


# ---------------------------------------------------------------------------- locking
def lock_timeout() -> float:
    raw = os.environ.get(LOCK_TIMEOUT_ENV_VAR)
    if not raw:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise _error(f"rwkv_clip: {LOCK_TIMEOUT_ENV_VAR}={raw!r} is not a positive number of "
                     "seconds")
    return value


@contextlib.contextmanager
def build_lock(path: Path, timeout: float):
    """Hold an exclusive ``flock`` on ``path`` for one build.

    The OS drops the lock when its holder exits or is killed, so a dead builder never
    blocks anyone; a live holder that keeps it past ``timeout`` seconds raises
    :class:`KernelBuildError` naming the lock file and its holder."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _lock_holder(path)
                if time.monotonic() >= deadline:
                    raise KernelBuildError(
                        f"rwkv_clip: timed out after {timeout:.0f}s waiting for the kernel build "
                        f"lock {path} (held by {holder}); stop that process if it hangs, or raise "
                        f"{LOCK_TIMEOUT_ENV_VAR}") from None
                if not announced:
                    print(f"rwkv_clip: waiting for {holder} to finish building the WKV kernel "
                          f"(lock {path})", file=sys.stderr, flush=True)
                    announced = True
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        os.ftruncate(fd, 0)
        os.write(fd, (f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}").encode())
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the flock


def _lock_holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "another process"
    except OSError:
        return "another process"


# ---------------------------------------------------------------------------- builders
@contextlib.contextmanager
def _quiet_logger(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def library_namespace(name: str, build_dir: Path) -> str:
    """The operator namespace of the library built in ``build_dir``.

    A namespace can be registered once per process (a second ``TORCH_LIBRARY`` of the
    same name aborts it), and the same build (same ``name``) may be loaded from two cache
    folders in one process (``$RWKV_CLIP_KERNEL_CACHE`` changed, tests). So the folder's
    path joins the name. It is the library's file name and ``TORCH_EXTENSION_NAME`` (the
    build key does not see it); a moved cache folder therefore builds afresh."""
    where = hashlib.sha256(str(build_dir.resolve()).encode()).hexdigest()[:8]
    return f"{name}_{where}"


class OperatorLibrary:
    """A build registered with ``TORCH_LIBRARY(namespace, ...)``: its operators as
    attributes (``lib.forward(...)`` calls ``torch.ops.<namespace>.forward``)."""

    def __init__(self, namespace: str, so: Path):
        self.name, self.path = namespace, so
        self._ops = getattr(torch.ops, namespace)
        if not hasattr(self._ops, "forward"):
            raise ImportError(f"{so} does not register the operators {namespace}.*")

    def __getattr__(self, op: str):
        if op.startswith("_"):
            raise AttributeError(op)
        try:
            return getattr(self._ops, op)
        except (AttributeError, RuntimeError) as e:
            raise AttributeError(f"{self.path} defines no operator {op!r}") from e


def _import_built(name: str, so: Path, python_module: bool = True):
    if not python_module:  # the library's name is its operator namespace
        if not hasattr(getattr(torch.ops, name), "forward"):  # not loaded yet
            try:
                torch.ops.load_library(str(so))
            except OSError as e:  # not a loadable library (half-written, foreign)
                raise ImportError(str(e)) from e
        return OperatorLibrary(name, so)
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {so}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiler_tail(exc: BaseException) -> str:
    text = str(exc)
    out = getattr(exc, "output", None)
    if isinstance(out, bytes):
        text += "\n" + out.decode(errors="replace")
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[-COMPILER_TAIL_LINES:])


def build_kernel(spec: KernelSpec, verbose: bool = False):
    """Load the module of ``spec`` from the cache, building it first when absent.

    Prints one line ``building the WKV kernel for ... (first use)`` to stderr before a
    build. Compiler and loader failures raise :class:`KernelBuildError`."""
    import subprocess

    build_dir = cache_root() / spec.name
    name = _module_name(spec, build_dir)
    so = build_dir / f"{name}.so"
    marker = build_dir / "built.json"
    with build_lock(build_dir / "build.lock", lock_timeout()):
        if marker.is_file() and so.is_file():
            try:
                return _import_built(name, so, spec.python_module)
            except ImportError as e:  # a half-written or foreign file: build it again
                print(f"rwkv_clip: cached WKV kernel {so} does not load ({e}); rebuilding",
                      file=sys.stderr, flush=True)
        marker.unlink(missing_ok=True)
        # cpp_extension's own baton; one left by a killed builder would make load() wait
        # forever. We hold build.lock, so nobody else is building in this folder.
        (build_dir / "lock").unlink(missing_ok=True)
        print(f"rwkv_clip: building the WKV kernel for {spec.what} (first use) in {build_dir}",
              file=sys.stderr, flush=True)
        if not os.environ.get("CUDA_HOME"):
            # cpp_extension guesses the toolkit root at import and warns when the guess
            # (from an nvcc wrapper) is wrong; point it at the real root first
            home = find_cuda_home()
            if home is not None:
                os.environ["CUDA_HOME"] = str(home)
        with _quiet_logger("torch.utils.cpp_extension"):  # "No CUDA runtime" on CPU hosts
            from torch.utils.cpp_extension import load
        t0 = time.time()
        try:
            with _quiet_logger("torch.utils.cpp_extension"):
                module = load(name=name, sources=[str(s) for s in spec.sources],
                              build_directory=str(build_dir), verbose=verbose,
                              extra_cflags=list(spec.cflags),
                              extra_cuda_cflags=list(spec.cuda_cflags) or None,
                              extra_ldflags=list(spec.ldflags),
                              is_python_module=spec.python_module)
        except (RuntimeError, ImportError, OSError, subprocess.CalledProcessError) as e:
            raise KernelBuildError(
                f"rwkv_clip: building the WKV kernel for {spec.what} failed (build folder "
                f"{build_dir}); last lines of the compiler output:\n{_compiler_tail(e)}") from e
        info = dict(spec.key_inputs(), what=spec.what, seconds=round(time.time() - t0, 1))
        marker.write_text(json.dumps(info, indent=1))
        # without a Python module, load() has loaded the library and returns its path
        return module if spec.python_module else OperatorLibrary(name, so)


def _loaded_or_build(cache_key: tuple, make_spec, verbose: bool):
    mod = _loaded.get(cache_key)  # fast path: no lock, no file system
    if mod is not None:
        return mod
    with _lock:
        mod = _loaded.get(cache_key)
        if mod is None:
            mod = build_kernel(make_spec(), verbose=verbose)
            _loaded[cache_key] = mod
        return mod


def cpu_kernel_name() -> str:
    tag, _ = _cpu_isa_flags()
    return f"rwkv_clip_wkv6_cpu_{tag}"


def cpu_kernel_spec() -> KernelSpec:
    tag, isa = _cpu_isa_flags()
    return KernelSpec(what=f"CPU ({tag})", base_name=cpu_kernel_name(),
                      sources=(source_dir() / "wkv6_cpu.cpp",),
                      # -fno-trapping-math lets the kernel's exp polynomial vectorise
                      cflags=("-O3", "-fopenmp", "-fno-trapping-math", *isa),
                      ldflags=("-fopenmp",), python_module=False)


def _module_name(spec: KernelSpec, build_dir: Path) -> str:
    """The module's or library's name, also its file's (``NAME.so``)."""
    return spec.name if spec.python_module else library_namespace(spec.name, build_dir)


def is_built(spec: KernelSpec) -> bool:
    """True when ``spec``'s kernel is in the cache (loading it compiles nothing)."""
    build_dir = cache_root() / spec.name
    so = build_dir / f"{_module_name(spec, build_dir)}.so"
    return (build_dir / "built.json").is_file() and so.is_file()


def cpu_kernel_cached() -> bool:
    return is_built(cpu_kernel_spec())


def get_cpu_kernel(verbose: bool = False):
    """The compiled CPU kernel module (forward, backward); builds it on first use."""
    def make():
        _check_cxx()
        return cpu_kernel_spec()
    return _loaded_or_build(("cpu",), make, verbose)


def cuda_kernel_name(N: int, t_max: int, variant: str) -> str:
    cu = (torch.version.cuda or "none").replace(".", "")
    return f"rwkv_clip_wkv6_cuda{cu}_{variant}_N{N}_T{t_max}"


def cuda_kernel_spec(N: int, t_max: int, variant: str) -> KernelSpec:
    home = _prepare_cuda_toolchain()
    src = source_dir()
    cu_file = "wkv6_cuda.cu" if variant == "faithful" else "wkv6_cuda_fast.cu"
    defines = [f"-DWKV_N={N}", f"-DWKV_TMAX={t_max}"]
    if variant == "fast":
        defines.append("-DWKV_VARIANT_FAST")
    archs = cuda_arch_list()
    return KernelSpec(
        what=f"CUDA ({variant}, head size {N}, T <= {t_max}, archs {archs})",
        base_name=cuda_kernel_name(N, t_max, variant),
        sources=(src / "wkv6_op.cpp", src / cu_file), headers=(src / "wkv6_common.cuh",),
        cflags=("-O3", *defines),
        cuda_cflags=("-O3", "-Xptxas", "-O3", "--use_fast_math", "--extra-device-vectorization",
                     *defines, *cuda_gencode_flags(archs)),
        arch_list=archs, toolkit=str(home))


def get_cuda_kernel(N: int, T: int, variant: str | None = None, verbose: bool = False):
    """The compiled CUDA kernel for head size N and sequence length T (T_max bucket)."""
    variant = resolve_cuda_variant(variant)
    check_cuda_head_size(N)
    t_max = cuda_t_bucket(T)

    def make():
        _check_cxx()
        return cuda_kernel_spec(N, t_max, variant)
    return _loaded_or_build(("cuda", variant, N, t_max), make, verbose)
