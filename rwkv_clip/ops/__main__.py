"""``python -m rwkv_clip.ops build``: compile the native WKV kernels ahead of time.

What gets built is at :func:`_build`. A failed build prints one line ``error: ...`` (the
compiler's last lines folded onto it) and exits with status 2.
"""
from __future__ import annotations

import argparse
import sys
import time

# (what, head size N) for the published configs
PUBLISHED = (
    ("text tower", 64),
    ("image towers", 80),
)


def _built_file(kernel) -> str:
    """The file a loaded kernel came from: an operator library's ``path`` or a module's."""
    return str(getattr(kernel, "path", None) or kernel.__file__)


def _build(args: argparse.Namespace) -> None:
    """Build every requested kernel (the module docstring says which); the first failure
    propagates (one error line)."""
    import torch

    from . import build, cache, toolchain

    print(f"kernel cache: {cache.cache_root()}")
    print(f"kernel sources: {toolchain.source_dir()}")
    if not args.no_cpu:
        t0 = time.time()
        mod = build.get_cpu_kernel(verbose=args.verbose)
        name = build.cpu_kernel_name()
        isa = name.removeprefix("rwkv_clip_wkv6_cpu_")
        how = ("-march=native" if any(s.base_name == name and "-march=native" in s.cflags
                                      for s in build.cpu_kernel_specs()) else "portable flags")
        print(f"[ok] cpu kernel built for instruction set {isa} ({how}; any head size, any T) "
              f"-> {_built_file(mod)} ({time.time() - t0:.0f}s)")
    if args.no_cuda:
        print("[skipped] CUDA kernels: --no-cuda")
        return
    if torch.version.cuda is None:
        print(f"[skipped] CUDA kernels: this torch ({torch.__version__}) is a CPU-only build")
        return
    home = toolchain.find_cuda_home()
    if home is None:
        print("[skipped] CUDA kernels: no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)")
        return
    print(f"CUDA archs: {toolchain.cuda_arch_list()} (set TORCH_CUDA_ARCH_LIST to change)")
    if not torch.cuda.is_available():
        print("no GPU visible: the CUDA kernels are compiled and loaded here, and run where a "
              "GPU is (same cache folder)")
    variants = build.CUDA_VARIANTS if args.variant == "all" else (args.variant,)
    for variant in variants:
        for what, N in PUBLISHED:
            t0 = time.time()
            mod = build.get_cuda_kernel(N, variant, verbose=args.verbose)
            print(f"[ok] cuda {variant} N={N} ({what}, any T) -> {_built_file(mod)} "
                  f"({time.time() - t0:.0f}s, toolkit {home})")


def main(argv: list[str] | None = None) -> int:
    from .build import CUDA_VARIANTS, DEFAULT_CUDA_VARIANT
    parser = argparse.ArgumentParser(
        prog="python -m rwkv_clip.ops",
        description="Native WKV kernel tools. 'build' compiles every variant the published "
                    "configs need into the on-disk cache (CUDA too when nvcc exists, even "
                    "without a GPU).")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the CPU and CUDA WKV kernels into the cache")
    b.add_argument("--no-cpu", action="store_true", help="skip the CPU kernel")
    b.add_argument("--no-cuda", action="store_true", help="skip the CUDA kernels")
    b.add_argument("--variant", default=DEFAULT_CUDA_VARIANT, choices=(*CUDA_VARIANTS, "all"),
                   help=f"which CUDA variant(s) to build (default: {DEFAULT_CUDA_VARIANT}, "
                        "the one the operator uses)")
    b.add_argument("--verbose", action="store_true", help="show compiler output")
    args = parser.parse_args(argv)
    _build(args)
    print("done")
    return 0


if __name__ == "__main__":
    from ..errors import run_cli

    sys.exit(run_cli(main, prog="python -m rwkv_clip.ops"))
