"""The on-disk cache of native WKV kernel builds: where it lives (:func:`cache_root`), the
key that names each build's folder (:meth:`KernelSpec.key`), the ``flock`` that serialises
concurrent builders, and whether a build is there (``built.json``, :func:`is_built`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import KernelLockTimeoutError, WKVError

LOCK_TIMEOUT_ENV_VAR = "RWKV_CLIP_KERNEL_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT_S = 1800.0
CACHE_FORMAT = 3  # bump when the folder layout or the key's contents change


def cache_root() -> Path:
    """``$RWKV_CLIP_CACHE/kernels`` if that is set (the root of every rwkv_clip cache,
    :func:`rwkv_clip.data.builtin.default_cache_root`), else
    ``$TORCH_EXTENSIONS_DIR/rwkv_clip`` if that is set, else ``~/.cache/rwkv_clip/kernels``."""
    base = os.environ.get("RWKV_CLIP_CACHE")
    if base:
        root = Path(base) / "kernels"
    elif os.environ.get("TORCH_EXTENSIONS_DIR"):
        root = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "rwkv_clip"
    else:
        root = Path.home() / ".cache" / "rwkv_clip" / "kernels"
    return root  # versions are part of each build's key (KernelSpec.key_inputs)


def _build_dir(name: str) -> Path:
    d = cache_root() / name
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass(frozen=True)
class KernelSpec:
    """Everything that decides one native build; :meth:`key` hashes it into the folder name."""

    what: str                       # for messages: "CPU (native, avx2)", "CUDA (faithful, head size 64, ...)"
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
                raise WKVError(f"rwkv_clip: kernel source {p} cannot be read ({e})") from e
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


def lock_timeout() -> float:
    raw = os.environ.get(LOCK_TIMEOUT_ENV_VAR)
    if not raw:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise WKVError(f"rwkv_clip: {LOCK_TIMEOUT_ENV_VAR}={raw!r} is not a positive number of "
                     "seconds")
    return value


@contextlib.contextmanager
def build_lock(path: Path, timeout: float):
    """Hold an exclusive ``flock`` on ``path`` for one build.

    The OS drops the lock when its holder exits or is killed, so a dead builder never
    blocks anyone; a live holder that keeps it past ``timeout`` seconds raises
    :class:`KernelLockTimeoutError` naming the lock file and its holder."""
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
                    raise KernelLockTimeoutError(
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


def library_namespace(name: str, build_dir: Path) -> str:
    """The operator namespace of the library built in ``build_dir``.

    A namespace can be registered once per process (a second ``TORCH_LIBRARY`` of the
    same name aborts it), and the same build (same ``name``) may be loaded from two cache
    folders in one process (``$RWKV_CLIP_CACHE`` changed, tests). So the folder's
    path joins the name. It is the library's file name and ``TORCH_EXTENSION_NAME`` (the
    build key does not see it); a moved cache folder therefore builds afresh."""
    where = hashlib.sha256(str(build_dir.resolve()).encode()).hexdigest()[:8]
    return f"{name}_{where}"


def module_name(spec: KernelSpec, build_dir: Path) -> str:
    """The module's or library's name, also its file's (``NAME.so``)."""
    return spec.name if spec.python_module else library_namespace(spec.name, build_dir)


def is_built(spec: KernelSpec) -> bool:
    """True when ``spec``'s kernel is in the cache (loading it compiles nothing)."""
    build_dir = cache_root() / spec.name
    so = build_dir / f"{module_name(spec, build_dir)}.so"
    return (build_dir / "built.json").is_file() and so.is_file()
