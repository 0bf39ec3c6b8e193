"""The CPU as the project's kernels see it: vendor, model, feature flags and an x86
instruction-set level, capped where torch (``ATEN_CPU_CAPABILITY``) or oneDNN
(``ONEDNN_MAX_CPU_ISA``) are told to use less than the CPU has.

Every CPU-dependent choice (the WKV kernel build, the low-precision GEMM path) reads the
level here, so setting those two variables runs the whole project as on an older CPU:
the test suite's forced-path stage does that (CONTRIBUTING.md).
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

# x86 levels, lowest first: what decides the kernels' vector width and the GEMMs' dtypes
LEVELS = ("base", "avx2", "avx512", "avx512bf16", "amx")
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"})

# torch's own switch (aten/src/ATen/native/DispatchStub.cpp): the vectorised kernels it runs
_ATEN_CAPS = {"default": "base", "avx2": "avx2", "avx512": "amx"}
# oneDNN's (its cpu_isa_t names, upper case): the GEMMs it JIT-compiles; "amx" is no cap
_ONEDNN_CAPS = {"SSE41": "base", "AVX": "base", "AVX2": "avx2", "AVX2_VNNI": "avx2",
                "AVX2_VNNI_2": "avx2", "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "avx512",
                "AVX512_CORE_BF16": "avx512bf16", "AVX512_CORE_FP16": "avx512bf16",
                "AVX10_1_512": "avx512bf16", "AVX512_CORE_AMX": "amx",
                "AVX10_1_512_AMX": "amx", "AVX512_CORE_AMX_FP16": "amx",
                "AVX10_1_512_AMX_FP16": "amx", "ALL": "amx", "DEFAULT": "amx"}
CAP_ENV_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


@dataclass(frozen=True)
class CPUInfo:
    """``level``: what the project runs at (``hardware_level`` capped by ``caps``, the
    variables that lowered it, as ``NAME=value``)."""

    arch: str
    vendor: str
    model: str
    flags: frozenset[str]
    hardware_level: str
    level: str
    caps: tuple[str, ...]

    def at_least(self, level: str) -> bool:
        return self.x86 and LEVELS.index(self.level) >= LEVELS.index(level)

    @property
    def x86(self) -> bool:
        return self.arch in ("x86_64", "amd64", "i686", "x86")

    def describe(self) -> str:
        """One line for logs and test headers."""
        text = f"{self.model or self.arch} ({self.vendor or 'unknown vendor'}): "
        if not self.x86:
            return text + f"{self.arch}, no x86 levels"
        text += f"{self.hardware_level}"
        if self.level != self.hardware_level:
            text += f", running as {self.level} ({', '.join(self.caps)})"
        return text


@functools.cache
def _proc_cpuinfo() -> tuple[str, str, frozenset[str]]:
    """(vendor, model name, flags) of the first CPU in /proc/cpuinfo ("" / empty where
    there is none)."""
    vendor = model = ""
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                elif not line.strip() and flags:
                    break  # the first processor's block is enough
    except OSError:
        pass
    return vendor, model, flags


def hardware_level(flags: frozenset[str] | set[str]) -> str:
    """The highest of :data:`LEVELS` a CPU with these /proc/cpuinfo flags has."""
    if _AVX512 <= flags and "avx512_bf16" in flags:
        return "amx" if {"amx_tile", "amx_bf16"} <= flags else "avx512bf16"
    if _AVX512 <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "base"


def cpu_info() -> CPUInfo:
    """This machine's CPU, capped by :data:`CAP_ENV_VARS` as they are set now."""
    return _cpu_info(tuple(os.environ.get(name, "") for name in CAP_ENV_VARS))


@functools.cache
def _cpu_info(cap_values: tuple[str, ...]) -> CPUInfo:
    vendor, model, flags = _proc_cpuinfo()
    hw = hardware_level(flags)
    level, caps = hw, []
    aten, onednn = (v.strip() for v in cap_values)
    for name, value, cap in (("ATEN_CPU_CAPABILITY", aten, _ATEN_CAPS.get(aten.lower())),
                             ("ONEDNN_MAX_CPU_ISA", onednn, _ONEDNN_CAPS.get(onednn.upper()))):
        if cap is not None and LEVELS.index(cap) < LEVELS.index(level):
            level = cap
        if cap is not None and LEVELS.index(cap) < LEVELS.index(hw):
            caps.append(f"{name}={value}")
    return CPUInfo(platform.machine().lower(), vendor, model, flags, hw, level, tuple(caps))


def native_lowp_gemm(dtype_name: str) -> bool:
    """Whether the CPU multiplies ``bf16`` / ``fp16`` matrices natively (AVX512-BF16 or
    AMX; AMX-FP16), where torch does not emulate them many times slower than fp32."""
    info = cpu_info()
    if dtype_name == "bf16":
        return info.at_least("avx512bf16")
    if dtype_name == "fp16":
        return info.at_least("amx") and "amx_fp16" in info.flags
    raise ValueError(f"native_lowp_gemm: expected 'bf16' or 'fp16', got {dtype_name!r}")


__all__ = ["CPUInfo", "LEVELS", "CAP_ENV_VARS", "cpu_info", "hardware_level", "native_lowp_gemm"]
