"""Lazy builds of the native WKV kernels: nothing runs at import. :func:`get_cpu_kernel`
(one build for every head size and sequence length) and :func:`get_cuda_kernel` (one per
variant and head size) compile on first use with ``torch.utils.cpp_extension`` into the
cache (:mod:`.cache`). Size and toolchain problems raise :class:`rwkv_clip.errors.WKVError`
before any compiler runs; a failed compile, :class:`rwkv_clip.errors.KernelBuildError`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from ..errors import KernelBuildError, KernelLockTimeoutError, WKVError
from .cache import KernelSpec, build_lock, cache_root, is_built, lock_timeout, module_name
from .toolchain import (
    check_cxx,
    cpu_isa_flags,
    cpu_level_capped,
    cpu_native_isa,
    cuda_arch_list,
    cuda_gencode_flags,
    find_cuda_home,
    prepare_cuda_toolchain,
    quiet_logger,
    source_dir,
)

CUDA_MAX_HEAD_SIZE = 256
CUDA_VARIANTS = ("faithful", "fast")  # compiled here (nvcc)
# Triton kernels (JIT-compiled by Triton on first use, nothing to build here)
TRITON_CUDA_VARIANTS = ("chunked",)
# the faster of the two on an H200 (the GPU check: both pass its float64 check)
DEFAULT_CUDA_VARIANT = "fast"

_lock = threading.Lock()
_loaded: dict[tuple, object] = {}
COMPILER_TAIL_LINES = 25


# ----------------------------------------------------------------------------- sizes
def cuda_head_size_problem(N: int) -> str | None:
    """Why the nvcc-built CUDA kernels cannot take head size N (None: they can)."""
    if N % 4 != 0 or N < 4 or N > CUDA_MAX_HEAD_SIZE:
        return (f"head size N={N} is not supported by the CUDA WKV kernel (expected a "
                f"multiple of 4 between 4 and {CUDA_MAX_HEAD_SIZE})")
    return None


def chunked_head_size_problem(N: int) -> str | None:
    """Why the chunked (Triton) kernel cannot take head size N: its channel blocks are
    16 or 32 wide (:func:`rwkv_clip.ops.wkv_chunked.channel_block`)."""
    if N % 16 != 0:
        return (f"head size N={N} is not supported by the chunked CUDA WKV kernel "
                "(expected a multiple of 16)")
    return None


def check_cuda_head_size(N: int) -> None:
    problem = cuda_head_size_problem(N)
    if problem is not None:
        raise WKVError(f"rwkv_clip: {problem}")


def resolve_cuda_variant(variant: str | None = None) -> str:
    """The CUDA WKV kernel: ``variant``, else the default; an unknown name is a
    :class:`WKVError` naming the allowed ones."""
    choice = variant or DEFAULT_CUDA_VARIANT
    if choice not in CUDA_VARIANTS + TRITON_CUDA_VARIANTS:
        raise WKVError(f"unknown CUDA WKV variant {choice!r}; expected one of "
                       f"{', '.join(CUDA_VARIANTS + TRITON_CUDA_VARIANTS)}")
    return choice


# ---------------------------------------------------------------------------- builders
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
    name = module_name(spec, build_dir)
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
        with quiet_logger("torch.utils.cpp_extension"):  # "No CUDA runtime" on CPU hosts
            from torch.utils.cpp_extension import load
        t0 = time.time()
        try:
            with quiet_logger("torch.utils.cpp_extension"):
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


def _loaded_or_build(cache_key: tuple, build):
    mod = _loaded.get(cache_key)  # fast path: no lock, no file system
    if mod is not None:
        return mod
    with _lock:
        mod = _loaded.get(cache_key)
        if mod is None:
            mod = build()
            _loaded[cache_key] = mod
        return mod


NATIVE_FAILED_MARKER = "native_build_failed.txt"


def cpu_kernel_spec(portable: bool | None = None) -> KernelSpec:
    """The CPU kernel's build: for this machine's own instruction set (``-march=native``)
    unless ``portable`` (default: whether the level is capped below the CPU's,
    ``ATEN_CPU_CAPABILITY`` or ``ONEDNN_MAX_CPU_ISA``, :mod:`rwkv_clip.cpu_isa`) or the
    compiler cannot target it; the portable build has the explicit flags of the best level
    /proc/cpuinfo shows within that cap (AVX-512 with or without BF16, AVX2, or none)."""
    if portable is None:
        portable = cpu_level_capped()
    native = None if portable else cpu_native_isa()
    tag, isa = native if native is not None else cpu_isa_flags()
    kind = "native" if native is not None else "portable"
    return KernelSpec(what=f"CPU ({kind}, {tag})", base_name=f"rwkv_clip_wkv6_cpu_{tag}",
                      sources=(source_dir() / "wkv6_cpu.cpp",),
                      # -fno-trapping-math lets the kernel's exp polynomial vectorise
                      cflags=("-O3", "-fopenmp", "-fno-trapping-math", *isa),
                      ldflags=("-fopenmp",), python_module=False)


def _native_failed(spec: KernelSpec) -> Path:
    return cache_root() / spec.name / NATIVE_FAILED_MARKER


def cpu_kernel_specs() -> list[KernelSpec]:
    """The CPU builds to try in turn: the native one (unless it failed here before, or
    the portable build is asked for), then the portable one."""
    spec = cpu_kernel_spec()
    portable = cpu_kernel_spec(portable=True)
    if spec == portable or _native_failed(spec).is_file():
        return [portable]
    return [spec, portable]


def cpu_kernel_name() -> str:
    """The base name (instruction set tag included) of the CPU build that will be used."""
    specs = cpu_kernel_specs()
    built = [s for s in specs if is_built(s)]
    return (built or specs)[0].base_name


def cpu_kernel_cached() -> bool:
    return any(is_built(s) for s in cpu_kernel_specs())


def get_cpu_kernel(verbose: bool = False):
    """The compiled CPU kernel module (forward, backward); builds it on first use, for
    the machine's own instruction set, falling back to the portable build when that
    compile fails (remembered in the cache, so it is tried once)."""
    def build_first_that_compiles():
        check_cxx()
        specs = cpu_kernel_specs()
        for spec in specs[:-1]:
            try:
                return build_kernel(spec, verbose=verbose)
            except KernelLockTimeoutError:  # another builder is slow: not a failed compile
                raise
            except KernelBuildError as e:
                marker = _native_failed(spec)
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(str(e))
                print(f"rwkv_clip: the WKV kernel for {spec.what} did not compile (details in "
                      f"{marker}); building the portable one", file=sys.stderr, flush=True)
        return build_kernel(specs[-1], verbose=verbose)
    return _loaded_or_build(("cpu",), build_first_that_compiles)


def cuda_kernel_name(N: int, variant: str) -> str:
    cu = (torch.version.cuda or "none").replace(".", "")
    return f"rwkv_clip_wkv6_cuda{cu}_{variant}_N{N}"


def cuda_kernel_spec(N: int, variant: str) -> KernelSpec:
    home = prepare_cuda_toolchain()
    src = source_dir()
    cu_file = "wkv6_cuda.cu" if variant == "faithful" else "wkv6_cuda_fast.cu"
    defines = [f"-DWKV_N={N}"]
    if variant == "fast":
        defines.append("-DWKV_VARIANT_FAST")
    archs = cuda_arch_list()
    return KernelSpec(
        what=f"CUDA ({variant}, head size {N}, archs {archs})",
        base_name=cuda_kernel_name(N, variant),
        sources=(src / "wkv6_op.cpp", src / cu_file), headers=(src / "wkv6_common.cuh",),
        cflags=("-O3", *defines),
        cuda_cflags=("-O3", "-Xptxas", "-O3", "--use_fast_math", "--extra-device-vectorization",
                     *defines, *cuda_gencode_flags(archs)),
        arch_list=archs, toolkit=str(home))


def get_cuda_kernel(N: int, variant: str | None = None, verbose: bool = False):
    """The compiled CUDA kernel for head size N (any sequence length)."""
    variant = resolve_cuda_variant(variant)
    check_cuda_head_size(N)

    def build():
        check_cxx()
        return build_kernel(cuda_kernel_spec(N, variant), verbose=verbose)
    return _loaded_or_build(("cuda", variant, N), build)
