"""FLOP counts (rwkv_clip.bench.flops): our oneDNN linear and WKV operator counted as their
maths says, open_clip's ViT against its closed form (attention included), the same count
whichever CPU kernel runs the products, and a count that leaves the model as it was."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rwkv_clip.bench.flops import count_flops, image_inference_flops, training_flops
from rwkv_clip.bench.resolution import build_ours
from rwkv_clip.config import load_model_configs
from rwkv_clip.ops import wkv6_bidirectional
from rwkv_clip.ops.products import linear


@pytest.fixture
def cpu_linear(choose):
    """Pick the fp32 Linear kernel for one test."""
    return lambda choice: choose("linear", choice)


@pytest.mark.parametrize("kernel", ["onednn", "mkl"])
def test_a_linear_counts_its_product_and_both_gradients(cpu_linear, kernel):
    cpu_linear(kernel)
    x = torch.randn(3, 50, 512, requires_grad=True)
    w = torch.randn(640, 512, requires_grad=True)
    b = torch.randn(640, requires_grad=True)
    forward = count_flops(lambda: linear(x, w, b))
    both = count_flops(lambda: torch.autograd.grad(linear(x, w, b).sum(), [x, w, b]))
    product = 2 * 150 * 512 * 640
    assert forward["total"] == product
    assert both["total"] == 3 * product  # the input's and the weight's gradient
    assert ("rwkv_clip.onednn_linear" in forward["by_op"]) == (kernel == "onednn")
    plain = count_flops(lambda: torch.autograd.grad(F.linear(x, w, b).sum(), [x, w, b]))
    assert plain["total"] == both["total"]


def test_the_wkv_operator_counts_its_recurrence_both_ways():
    B, T, H, N = 2, 7, 3, 16
    r, k, v, w = (torch.randn(B, T, H * N, requires_grad=True) for _ in range(4))
    u = torch.randn(H, N, requires_grad=True)
    forward = count_flops(lambda: wkv6_bidirectional(r, k, v, w, u, backend="cpu"))
    # per token, head and direction: k v^T, the decayed state plus it, the read-out r S
    assert forward == {"total": 2 * 5 * B * T * H * N * N,
                       "by_op": {"rwkv_clip.wkv6_forward": 2 * 5 * B * T * H * N * N}}
    both = count_flops(lambda: torch.autograd.grad(
        wkv6_bidirectional(r, k, v, w, u, backend="cpu").sum(), [r, k, v, w, u]))
    assert both["total"] == 3 * forward["total"]


def test_open_clip_vit_matches_its_closed_form_attention_included():
    from rwkv_clip.bench.versus import build_open_clip
    pytest.importorskip("open_clip")
    side, patch, width, layers, embed = 96, 32, 768, 12, 512
    vit = build_open_clip("ViT-B-32", force_image_size=side).eval()
    tokens = (side // patch) ** 2 + 1  # the class token
    per_layer = (2 * tokens * width * (3 * width + width + 2 * 4 * width)  # qkv, out, MLP
                 + 2 * 2 * tokens * tokens * width)  # q k^T and the weighted sum of v
    expected = (2 * (tokens - 1) * 3 * patch * patch * width  # the patch convolution
                + layers * per_layer + 2 * width * embed)  # the projection of the pooled token
    counted = image_inference_flops(vit, 1, side)
    assert counted["total"] == expected
    assert counted["by_op"]["aten._scaled_dot_product_flash_attention_for_cpu"] == (
        layers * 4 * tokens * tokens * width)


def test_our_count_is_the_same_whichever_kernel_runs_the_products(cpu_linear):
    args = load_model_configs("RWKV_CLIP_B32")  # wide enough for the oneDNN linear
    model = build_ours(args, 64, torch.device("cpu")).train()
    counts = {}
    for kernel in ("onednn", "mkl"):
        cpu_linear(kernel)
        counts[kernel] = (image_inference_flops(model, 1, 64)["total"],
                          training_flops(model, 2, 64, args.ctx_len)["total"])
    assert counts["onednn"] == counts["mkl"]
    assert counts["onednn"][1] > 3 * 2 * counts["onednn"][0]  # plus the text tower


def test_counting_leaves_the_model_as_it_was():
    args = load_model_configs("RWKV_CLIP_tiny")
    model = build_ours(args, 16, torch.device("cpu")).train()
    images, tokens = torch.randn(2, 3, 16, 16), torch.randint(0, 100, (2, args.ctx_len))
    torch.manual_seed(0)
    before = model(images, tokens)
    training_flops(model, 2, 16, args.ctx_len)
    image_inference_flops(model, 1, 16)
    assert all(p.grad is None and type(p) is torch.nn.Parameter for p in model.parameters())
    torch.manual_seed(0)
    after = model(images, tokens)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_inputs_go_where_the_model_is():
    """A model off the CPU (meta here, CUDA on a GPU machine) counts the same: the inputs
    are made on its device, since fake tensors on two devices do not mix."""
    from rwkv_clip.bench.versus import build_open_clip
    pytest.importorskip("open_clip")
    vit = build_open_clip("ViT-B-32", force_image_size=64).train()
    on_cpu = (image_inference_flops(vit, 2, 64)["total"],
              training_flops(vit, 2, 64, 77)["total"])
    vit.to("meta")
    assert image_inference_flops(vit, 2, 64)["total"] == on_cpu[0]
    # off the CPU, attention's backward is another kernel, with torch's own count of it
    assert training_flops(vit, 2, 64, 77)["total"] == pytest.approx(on_cpu[1], rel=0.01)
