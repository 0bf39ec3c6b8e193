"""Toolchain discovery for the native WKV kernels: the kernel sources, the C++ compiler and
ninja, the CUDA toolkit root and the CUDA architectures to build for."""
from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import importlib.resources
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from ..cpu_isa import LEVELS, cpu_info
from ..errors import WKVError

# With no GPU visible (a login node, a CPU-only build job) and no TORCH_CUDA_ARCH_LIST,
# build for these; the last one also as PTX, so newer cards JIT-compile it. 7.5 covers T4s.
DEFAULT_CUDA_ARCHS = ("7.5", "8.0", "9.0")


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
    raise WKVError("rwkv_clip: kernel sources not found (expected cuda/wkv6_cpu.cpp in the source "
                 "checkout or in the installed package rwkv_clip.cuda)")


def _cpu_flags() -> set[str]:
    """The feature flags /proc/cpuinfo lists for the first CPU (empty where there is none)."""
    return set(cpu_info().flags)


# Instruction-set levels, best first: (tag, cpuinfo flags it needs, explicit compiler flags).
ISA_LEVELS = (
    ("avx512bf16", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx2", "fma"},
     ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
      "-mavx512bf16"]),
    ("avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"},
     ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]),
    ("avx2", {"avx2", "fma"}, ["-mavx2", "-mfma"]),
)


def cpu_isa_flags() -> tuple[str, list[str]]:
    """The portable build: the best level of :data:`ISA_LEVELS` /proc/cpuinfo shows, at
    most the project's level (:func:`rwkv_clip.cpu_isa.cpu_info`), as explicit ``-m``
    flags (tag, flags); ``("base", [])`` when none applies. The tag goes into the cache
    name so a shared cache never hands AVX code to an older CPU."""
    flags = _cpu_flags()
    cap = LEVELS.index(cpu_info().level)
    for tag, needs, isa in ISA_LEVELS:
        if needs <= flags and LEVELS.index(tag) <= cap:
            return tag, isa
    return "base", []


def cpu_level_capped() -> bool:
    """Whether the project runs below the CPU's own level (``ATEN_CPU_CAPABILITY`` or
    ``ONEDNN_MAX_CPU_ISA`` set lower): then no ``-march=native`` build, the portable one."""
    info = cpu_info()
    return info.level != info.hardware_level


def _isa_level(features: set[str]) -> str:
    """A readable name for a set of enabled compiler features (``avx512bf16``, ``amx``...)."""
    if {"amx-tile", "amx-bf16"} <= features:
        return "amx"
    if "avx512bf16" in features:
        return "avx512bf16"
    if "avx512f" in features:
        return "avx512"
    if "avx2" in features:
        return "avx2"
    return "base"


@functools.cache
def _native_target(cxx: str) -> tuple[str, tuple[str, ...]] | None:
    """What ``cxx -march=native`` selects on this machine: (CPU name, enabled features),
    read from the driver's expanded command line (GCC: ``-march=X -mFEATURE``; Clang:
    ``-target-cpu X -target-feature +FEATURE``). None when the compiler does not take
    ``-march=native`` or says nothing usable."""
    try:
        res = subprocess.run([cxx, "-march=native", "-###", "-x", "c++", "-c", os.devnull,
                              "-o", os.devnull], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    tokens = [t.strip('"') for t in res.stderr.split()]
    cpu, features = "", set()
    for prev, tok in zip(["", *tokens], tokens, strict=False):
        if tok.startswith("-march=") and tok != "-march=native":
            cpu = tok.split("=", 1)[1]
        elif prev == "-target-cpu":
            cpu = tok
        elif prev == "-target-feature" and tok.startswith("+"):
            features.add(tok[1:])
        elif tok.startswith("-m") and not tok.startswith(("-mno-", "-mtune", "-march", "-m64",
                                                          "-m32")):
            features.add(tok[2:])
    if not cpu or not features:
        return None
    return cpu, tuple(sorted(features))


def cpu_native_isa() -> tuple[str, list[str]] | None:
    """The build for this machine's own instruction set: (tag, ``["-march=native"]``), or
    None where the compiler cannot do it. The tag names the level and hashes the exact
    feature set the compiler enables, so two CPUs share a cached build only when the
    code is valid on both."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        cxx = "g++"
    target = _native_target(cxx)
    if target is None:
        return None
    cpu, features = target
    digest = hashlib.sha256(" ".join((cpu, *features)).encode()).hexdigest()[:10]
    name = re.sub(r"[^A-Za-z0-9]", "_", cpu)  # the tag is part of a module name
    return f"{_isa_level(set(features))}_{name}_{digest}", ["-march=native"]


def check_cxx() -> None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        raise WKVError(f"rwkv_clip: building the WKV kernel needs a C++ compiler ({cxx!r} or g++) "
                     "on PATH; install one (e.g. apt-get install g++) or use backend='reference'")
    if shutil.which("ninja") is None:
        try:
            import ninja
            bindir = Path(ninja.BIN_DIR)
        except (ImportError, AttributeError):
            raise WKVError("rwkv_clip: building the WKV kernel needs ninja (pip install ninja)"
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


@contextlib.contextmanager
def quiet_logger(name: str):
    """Raise ``name``'s log level to ERROR for the block (torch's import-time warnings)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def prepare_cuda_toolchain() -> Path:
    if torch.version.cuda is None:
        raise WKVError("rwkv_clip: this torch build has no CUDA support, so the CUDA WKV kernel "
                     "cannot be built")
    home = find_cuda_home()
    if home is None:
        raise WKVError("rwkv_clip: building the CUDA WKV kernel needs the CUDA toolkit (a folder "
                     "with bin/nvcc and lib64/libcudart*); set CUDA_HOME or put nvcc on PATH")
    if not os.environ.get("CUDA_HOME"):
        os.environ["CUDA_HOME"] = str(home)
    with quiet_logger("torch.utils.cpp_extension"):  # "No CUDA runtime" on CPU hosts
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
            raise WKVError(f"rwkv_clip: CUDA arch {arch!r} (from TORCH_CUDA_ARCH_LIST or the GPU) "
                         "is not of the form MAJOR.MINOR[+PTX], e.g. '8.0;9.0+PTX'")
        num = f"{m.group(1)}{m.group(2)}{m.group(3)}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if m.group(4):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    if not flags:
        raise WKVError("rwkv_clip: the CUDA arch list is empty; set TORCH_CUDA_ARCH_LIST, "
                     "e.g. '8.0;9.0+PTX'")
    return flags
