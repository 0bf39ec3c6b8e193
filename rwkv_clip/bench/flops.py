"""Floating-point operations of a model call, counted rather than timed.

torch's ``FlopCounterMode`` over fake tensors (shapes only: nothing is computed, so any
image size counts in well under a second), with formulas for the operators it does not
know: our oneDNN linear and WKV kernels, and the CPU flash attention of open_clip's ViT. A
multiply-add counts 2; elementwise work is not counted, as in torch's and fvcore's counts.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..distributed import model_device

# The WKV recurrence per token, head and direction on an (N x N) state: the outer product
# k v^T (N^2), the decayed state plus it (2 N^2: a multiply-add) and the read-out r S
# (2 N^2); two directions. The bonus term is O(N) and not counted.
WKV_FLOPS_PER_STATE_ELEMENT = 2 * 5


def _linear(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """x (..., in) times a (out, in) weight."""
    return 2 * math.prod(x_shape[:-1]) * w_shape[0] * w_shape[1]


def _wkv_forward(r_shape, k_shape, v_shape, w_shape, u_shape, *args, out_shape=None,
                 **kwargs) -> int:
    batch, tokens, channels = r_shape
    head_size = u_shape[1]
    return WKV_FLOPS_PER_STATE_ELEMENT * batch * tokens * channels * head_size


def _wkv_backward(r_shape, k_shape, v_shape, w_shape, u_shape, *args, out_shape=None,
                  **kwargs) -> int:
    """Twice the forward: torch's convention for a product's two gradients."""
    return 2 * _wkv_forward(r_shape, k_shape, v_shape, w_shape, u_shape)


def _attention(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(q_shape, k_shape, v_shape)


def _attention_backward(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None,
                        **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape)


def formulas() -> dict[Any, Callable[..., int]]:
    """Counts for the operators torch's registry lacks, keyed by operator packet."""
    from ..layers import linear  # noqa: F401  registers rwkv_clip::onednn_linear
    from ..ops import kernels  # noqa: F401  registers rwkv_clip::wkv6_*
    ops = torch.ops
    return {ops.rwkv_clip.onednn_linear: _linear,
            ops.mkldnn._linear_pointwise: _linear,  # the oneDNN linear's input gradient
            ops.rwkv_clip.wkv6_forward: _wkv_forward,
            ops.rwkv_clip.wkv6_backward: _wkv_backward,
            ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention,
            ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward}


def count_flops(call: Callable[[], Any]) -> dict[str, Any]:
    """FLOPs of ``call()`` run on fake tensors: ``{"total": n, "by_op": {op: n}}``.

    ``call`` builds its inputs itself (inside the fake mode, so they are fake too); the
    models' parameters may be real (they are read as fake)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False, custom_mapping=formulas())
    with FakeTensorMode(allow_non_fake_inputs=True), counter:
        call()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return {"total": counter.get_total_flops(), "by_op": by_op}


def image_inference_flops(model: Any, batch: int, side: int) -> dict[str, Any]:
    """FLOPs of ``model.encode_image`` on a (batch, 3, side, side) batch. Counted with
    autograd on, so ``nn.MultiheadAttention`` takes its composite path (its inference
    fast path does the same products in one opaque operator)."""
    device = model_device(model)
    return count_flops(lambda: model.encode_image(torch.zeros(batch, 3, side, side,
                                                              device=device)))


def training_flops(model: Any, batch: int, side: int, ctx_len: int) -> dict[str, Any]:
    """FLOPs of a training step's forward (both towers and the contrastive loss) and
    backward (the gradients of every trainable parameter); the optimizer's elementwise
    update is not counted."""
    from ..loss import ClipLoss
    params = [p for p in model.parameters() if p.requires_grad]
    device = model_device(model)

    def step() -> None:
        images = torch.zeros(batch, 3, side, side, device=device)
        tokens = torch.zeros(batch, ctx_len, dtype=torch.long, device=device)
        image_f, text_f, scale = model(images, tokens)[:3]
        loss = ClipLoss()(image_f, text_f, scale)
        torch.autograd.grad(loss, params, allow_unused=True)
    return count_flops(step)
