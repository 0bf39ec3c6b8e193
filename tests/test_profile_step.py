"""scripts/profile_step.py: kernel names sorted into kinds, the per-step summary, and a
profiled tiny CPU training step's JSON."""
from __future__ import annotations

import importlib.util
import json
import math

import pytest
from train_util import REPO, TINY_CONFIG


def _script():
    spec = importlib.util.spec_from_file_location("profile_step", REPO / "scripts" / "profile_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


profile_step = _script()


@pytest.mark.parametrize("name,kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_nn>", "matmul"),
    ("triton_tem_fused_mm_0", "matmul"),
    ("aten::mm", "matmul"),
    ("void wkv_forward<float, 64>(int, int, int, int, float const*)", "wkv"),
    ("void fast_backward_scans<__nv_bfloat16, 80>(int, int, int)", "wkv"),
    ("chunk_rwkv6_fwd_kernel_h", "wkv"),
    ("rwkv_clip::wkv6_forward", "wkv"),
    ("rwkv_clip::q_shift", "copy_cast"),
    ("void at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)", "copy_cast"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::"
     "TensorIteratorBase&)::{lambda()#3}::operator()() const>", "copy_cast"),
    ("Memcpy DtoD (Device -> Device)", "copy_cast"),
    ("Memset (Device)", "copy_cast"),
    ("aten::_to_copy", "copy_cast"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", "norm"),
    ("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>", "norm"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<float, float>", "norm"),
    ("triton_red_fused_native_layer_norm_backward_3", "norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
     "elementwise"),
    ("triton_poi_fused_add_lerp_mul_2", "elementwise"),
    ("aten::lerp", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "reduction"),
    ("triton_per_fused_sum_4", "reduction"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
     "optimizer"),
    ("aten::_fused_adamw_", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "other"),
])
def test_kernel_names_sorted_into_kinds(name, kind):
    assert profile_step.classify(name) == kind


def test_summary_per_step_and_shares():
    events = [("ampere_bf16_s16816gemm_tn", 30.0), ("ampere_bf16_s16816gemm_tn", 30.0),
              ("void wkv_forward<float, 64>", 20.0), ("Memcpy DtoD", 10.0),
              ("triton_poi_fused_mul_0", 10.0)]
    out = profile_step.summarise(events, steps=2, top=2)
    assert out["launches_per_step"] == 2.5
    assert out["time_ms_per_step"] == pytest.approx(0.05)
    assert out["shares"]["matmul"] == pytest.approx(0.6)
    assert out["shares"]["wkv"] == pytest.approx(0.2)
    assert math.isclose(sum(out["shares"].values()), 1.0)
    assert out["launches_per_step_by_kind"]["matmul"] == 1.0
    assert [t["name"] for t in out["top"]] == ["ampere_bf16_s16816gemm_tn",
                                               "void wkv_forward<float, 64>"]
    with pytest.raises(ValueError, match="steps"):
        profile_step.summarise(events, steps=0)


def test_profiled_cpu_step_json(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert profile_step.main(["--device", "cpu", "--config", TINY_CONFIG, "--batch-size", "2",
                              "--precision", "fp32", "--warmup", "1", "--steps", "1",
                              "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == res
    assert set(res["shares"]) == set(profile_step.KINDS)
    assert math.isclose(sum(res["shares"].values()), 1.0, rel_tol=1e-9)
    # the step's work is there: products, both towers' WKV, the optimizer
    assert res["shares"]["matmul"] > 0 and res["shares"]["wkv"] > 0
    assert res["launches_per_step_by_kind"]["optimizer"] >= 1
    assert res["launches_per_step"] == sum(res["launches_per_step_by_kind"].values()) > 100
    assert res["steps"] == 1 and res["batch"] == 2 and res["device"] == "cpu"


def test_default_device_runs_without_a_gpu_and_cuda_is_one_line(tmp_path):
    import subprocess
    import sys

    import torch
    script = str(REPO / "scripts" / "profile_step.py")
    common = ["--config", TINY_CONFIG, "--batch-size", "2", "--precision", "fp32",
              "--warmup", "0", "--steps", "1", "--threads", "1"]
    ok = subprocess.run([sys.executable, script, *common], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert json.loads(ok.stdout)["device"].startswith(expected)
    if torch.cuda.is_available():
        return
    bad = subprocess.run([sys.executable, script, "--device", "cuda", *common],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].count("CUDA is not available") == 1
    assert "Traceback" not in bad.stderr
