"""compile_model: the inductor options per torch release, a cache folder per CPU level,
the CUDA branch of the WKV op traced whole, and (on a GPU) the compiled training step equal
to the eager one."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from train_util import REPO

from rwkv_clip import create_RWKV_Model, load_model_configs
from rwkv_clip.compiling import (
    INDUCTOR_CACHE_ENV,
    compile_model,
    inductor_cache_dir,
    inductor_options,
    isolate_inductor_cache,
    torch_release,
)
from rwkv_clip.cpu_isa import cpu_info
from rwkv_clip.loss import ClipLoss
from rwkv_clip.ops import kernels


@pytest.mark.parametrize("version,off", [("2.11.0+cu130", True), ("2.12.1", True),
                                         ("2.13.0", False), ("2.14.1+cpu", False),
                                         ("3.0.0a0+git", False)])
def test_mix_order_reduction_off_before_the_fix(version, off):
    assert (inductor_options(version) == {"triton.mix_order_reduction": False}) == off


def test_release_parsing():
    assert torch_release("2.11.0+cu130") == (2, 11)
    assert torch_release("2.12.0a0+git1234") == (2, 12)


def test_the_option_exists_in_this_torch():
    # compile_model passes the option by name; a renamed option would fail every compile
    import torch._inductor.config as inductor_config
    assert isinstance(inductor_config.triton.mix_order_reduction, bool)


def test_each_cpu_level_has_its_own_cache_folder(monkeypatch):
    assert inductor_cache_dir("avx2").endswith("_avx2")
    assert inductor_cache_dir("AVX2") == inductor_cache_dir("avx2")
    assert inductor_cache_dir("default") != inductor_cache_dir("avx2")
    level = torch.backends.cpu.get_cpu_capability().lower()
    assert os.path.basename(inductor_cache_dir()).split("_", 2)[-1].startswith(level)
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    assert isolate_inductor_cache() == inductor_cache_dir() == os.environ[INDUCTOR_CACHE_ENV]
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, "/somewhere/of/the/users")
    assert isolate_inductor_cache() == "/somewhere/of/the/users"


CACHED_GRAPH = """
import sys, torch
from rwkv_clip.compiling import compile_model
torch.manual_seed(0)
x = torch.randn(64, 1000)
f = compile_model(lambda t: torch.tanh(t) * 2 + t.sum(-1, keepdim=True), fullgraph=True,
                  dynamic=False)
print(float((f(x) - (torch.tanh(x) * 2 + x.sum(-1, keepdim=True))).abs().max()))
"""


@pytest.mark.slow
@pytest.mark.skipif(not cpu_info().x86 or torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="needs an x86 CPU running at AVX-512, above the AVX2 level forced")
def test_a_graph_compiled_at_avx2_is_not_reused_at_avx512(tmp_path):
    """Inductor keys its cache without the vector width: a graph written by an
    ATEN_CPU_CAPABILITY=avx2 process and loaded by an AVX-512 one gives wrong numbers
    (here about 19 off). compile_model keeps the two apart."""
    env = {k: v for k, v in os.environ.items()
           if k not in (INDUCTOR_CACHE_ENV, "ATEN_CPU_CAPABILITY")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=str(REPO))
    for extra in ({"ATEN_CPU_CAPABILITY": "avx2"}, {}):
        out = subprocess.run([sys.executable, "-c", CACHED_GRAPH], env={**env, **extra},
                             capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        assert float(out.stdout.split()[-1]) < 1e-3, (extra, out.stdout)
    names = [p.name for p in tmp_path.glob("torchinductor_*")]
    assert any(n.endswith("_avx2") for n in names) and any("_avx512" in n for n in names)


def test_cuda_branch_of_the_wkv_op_traces_whole():
    """run_native("cuda", ...) on CPU tensors runs the CPU kernel through the same Python
    as on a GPU (variant choice, head-size check, the operator): one graph, same values."""
    g = torch.Generator().manual_seed(0)
    B, T, H, N = 2, 5, 2, 8
    xs = [torch.randn(B, T, H * N, generator=g).requires_grad_() for _ in range(4)]
    u = torch.randn(H, N, generator=g).requires_grad_()

    def run(*args):
        return kernels.run_native("cuda", *args)
    eager = run(*xs, u)
    grads = torch.autograd.grad(eager.square().sum(), [*xs, u])
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)(*xs, u)
    cgrads = torch.autograd.grad(compiled.square().sum(), [*xs, u])
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(cgrads, grads, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


def _b32_two_layers() -> torch.nn.Module:
    args = load_model_configs(str(REPO / "model_config" / "RWKV_CLIP_B32.json"))
    args.image_depth = args.n_layer = 2  # widths and heads of B/32, two blocks per tower
    args.drop_path_rate = 0.0  # deterministic: the two steps must see the same graph
    torch.manual_seed(0)
    return create_RWKV_Model(args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_training_step_equals_eager_on_cuda(precision):
    """Both towers, ClipLoss and the backward, compiled whole (fullgraph, inductor) at
    B/32's widths and batch 64: the loss and every gradient as in eager mode (bf16:
    within autocast's rounding). The (1, 1, C) parameters' gradients are the ones that
    came back as (C,) where mix-order reduction lost their shape."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = _b32_two_layers().cuda().train()
    loss_fn = ClipLoss()
    g = torch.Generator().manual_seed(0)
    images = torch.randn(64, 3, 224, 224, generator=g).cuda()
    tokens = torch.randint(1, 49408, (64, 77), generator=g).cuda()

    def step(forward):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(*forward(images, tokens)[:3])
        loss.backward()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()
                                       if p.grad is not None}

    eager_loss, eager = step(model)
    compiled_loss, compiled = step(compile_model(model, fullgraph=True))
    # bf16: the fused kernels round at other places; the worst parameter on the CPU
    # (aot_eager) is logit_scale's one summed gradient at 4e-2
    loss_tol, grad_tol = (1e-4, 1e-4) if precision == "fp32" else (3e-2, 0.1)
    assert abs(compiled_loss - eager_loss) <= loss_tol * max(1.0, abs(eager_loss.item()))
    assert compiled.keys() == eager.keys()
    errors = {n: (compiled[n] - eager[n]).norm().item() / max(eager[n].norm().item(), 1e-12)
              for n in eager}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= grad_tol, (worst, errors[worst])
