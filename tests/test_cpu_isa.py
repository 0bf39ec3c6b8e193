"""The CPU's instruction-set level (rwkv_clip.cpu_isa): read from /proc/cpuinfo, capped by
torch's and oneDNN's own switches, and followed by the WKV CPU build; the test run names
it in its first lines."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rwkv_clip import cpu_isa
from rwkv_clip.ops import build, toolchain

pytestmark = pytest.mark.cpu_isa

AVX2 = {"avx2", "fma", "sse4_2"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
BF16 = AVX512 | {"avx512_bf16"}
AMX = BF16 | {"amx_tile", "amx_bf16"}


@pytest.fixture
def fake_cpu(monkeypatch):
    """Pretend to be an x86 CPU with the given /proc/cpuinfo flags and cap variables."""
    def pretend(flags: set[str], **caps: str) -> cpu_isa.CPUInfo:
        monkeypatch.setattr(cpu_isa, "_proc_cpuinfo",
                            lambda: ("AuthenticAMD", "AMD EPYC test", frozenset(flags)))
        monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "x86_64")
        for name in cpu_isa.CAP_ENV_VARS:
            monkeypatch.delenv(name, raising=False)
        for name, value in caps.items():
            monkeypatch.setenv(name, value)
        cpu_isa._cpu_info.cache_clear()
        return cpu_isa.cpu_info()
    yield pretend
    cpu_isa._cpu_info.cache_clear()


@pytest.mark.parametrize("flags,level", [(set(), "base"), ({"sse4_2", "avx"}, "base"),
                                         (AVX2, "avx2"), (AVX2 | {"avx512f"}, "avx2"),
                                         (AVX512, "avx512"), (BF16, "avx512bf16"), (AMX, "amx")])
def test_levels_from_cpuinfo_flags(flags, level):
    assert cpu_isa.hardware_level(flags) == level


@pytest.mark.parametrize("caps,level", [
    ({}, "amx"),
    ({"ATEN_CPU_CAPABILITY": "avx2"}, "avx2"),
    ({"ATEN_CPU_CAPABILITY": "default"}, "base"),
    ({"ATEN_CPU_CAPABILITY": "avx512"}, "amx"),              # torch's best: no cap
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, "avx512"),
    ({"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"}, "avx512bf16"),
    ({"ONEDNN_MAX_CPU_ISA": "ALL"}, "amx"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx2"}, "avx2"),
    ({"ONEDNN_MAX_CPU_ISA": "NO_SUCH_ISA"}, "amx"),          # oneDNN ignores it too
])
def test_the_level_is_capped_as_torch_and_onednn_are(fake_cpu, caps, level):
    info = fake_cpu(AMX, **caps)
    assert info.hardware_level == "amx" and info.level == level
    assert (info.level != "amx") == bool(info.caps)
    line = info.describe()
    assert line.startswith("AMD EPYC test (AuthenticAMD): amx")
    if info.caps:
        assert f"running as {level} (" in line and all(c in line for c in info.caps)


def test_a_cap_above_the_cpu_changes_nothing(fake_cpu):
    info = fake_cpu(AVX2, ONEDNN_MAX_CPU_ISA="AVX512_CORE_AMX", ATEN_CPU_CAPABILITY="avx512")
    assert info.level == info.hardware_level == "avx2" and info.caps == ()
    assert cpu_isa.native_lowp_gemm("bf16") is False


def test_native_low_precision_gemms(fake_cpu):
    fake_cpu(BF16)
    assert cpu_isa.native_lowp_gemm("bf16") and not cpu_isa.native_lowp_gemm("fp16")
    fake_cpu(AMX | {"amx_fp16"})
    assert cpu_isa.native_lowp_gemm("fp16")
    fake_cpu(AMX | {"amx_fp16"}, ONEDNN_MAX_CPU_ISA="AVX2")
    assert not cpu_isa.native_lowp_gemm("bf16") and not cpu_isa.native_lowp_gemm("fp16")
    with pytest.raises(ValueError, match="expected 'bf16' or 'fp16'"):
        cpu_isa.native_lowp_gemm("fp8")


def test_the_wkv_cpu_build_follows_the_capped_level(fake_cpu, monkeypatch):
    """Capped below the CPU, the WKV kernel is the portable build of the capped level
    (no -march=native, which would use everything the CPU has)."""
    monkeypatch.setattr(build, "cpu_native_isa", lambda: ("amx_test_0123", ["-march=native"]))
    fake_cpu(AMX)
    assert build.cpu_kernel_spec().base_name == "rwkv_clip_wkv6_cpu_amx_test_0123"
    assert toolchain.cpu_isa_flags()[0] == "avx512bf16"
    for caps, tag in (({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "avx2"),
                      ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, "avx512"),
                      ({"ATEN_CPU_CAPABILITY": "default"}, "base")):
        fake_cpu(AMX, **caps)
        spec = build.cpu_kernel_spec()
        assert spec.base_name == f"rwkv_clip_wkv6_cpu_{tag}", caps
        assert "-march=native" not in spec.cflags
        assert ("-mavx512f" in spec.cflags) is (tag == "avx512")


def test_the_test_run_names_the_machine_first(repo_root):
    """The header of a test run (conftest.pytest_report_header): the CPU, the level, the
    paths it picks; with the AVX2 paths forced, says so."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "tests/test_config.py"], cwd=repo_root,
                         env=env, capture_output=True, text=True, timeout=300).stdout
    head = out.splitlines()[:6]
    cpu = [line for line in head if line.startswith("cpu: ")]
    assert cpu, head
    real = cpu_isa.hardware_level(cpu_isa._proc_cpuinfo()[2])
    if cpu_isa.cpu_info().x86 and real not in ("base", "avx2"):
        assert "running as avx2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2)" in cpu[0]
    paths = [line for line in head if line.startswith("torch cpu capability: ")]
    assert paths and "CPU bf16 autocast products: " in paths[0], head
    if cpu_isa.cpu_info().x86 and real != "base":
        assert paths[0].startswith("torch cpu capability: AVX2;"), paths
        assert "rwkv_clip_wkv6_cpu_avx2" in paths[0] and "fp32 GEMM" in paths[0], paths
