"""Dtype conversions in a bf16-autocast forward of both towers: counted at the dispatcher
(aten._to_copy between floating dtypes), bounded to the ones autocast's rules and the
original's arithmetic make, and none of them a round trip (a conversion of a converted
tensor), on both CPU product paths (rwkv_clip.ops.products): native bf16 GEMMs (CPUs
with AVX512-BF16 or AMX) and fp32 GEMMs of the rounded operands (the others)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from train_util import tiny_model

pytestmark = pytest.mark.cpu_isa

_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default}


class _Conversions(TorchDispatchMode):
    """Records every floating conversion of a tensor that is not one of ``params``:
    (source shape, source dtype, result dtype, round trip, across the fp32 GEMM), the last
    true for a bf16 operand (or bias) converted up into a product and for a product's fp32
    result converted down. Producers are tracked per address by the last op that wrote it
    (views and in-place ops keep their source's producer), so a reused address is not
    mistaken for the tensor that lived there before."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params = params
        self.producer: dict[int, tuple[str, int]] = {}  # address -> (kind, conversion index)
        self.seen: list[list] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        # the operands of a product, and the bias added into its fp32 result
        into_product = func in _PRODUCTS or (
            func is torch.ops.aten.add_.Tensor
            and self.producer.get(inputs[0].data_ptr(), ("",))[0] == "product")
        if into_product:
            for a in inputs:
                kind, index = self.producer.get(a.data_ptr(), ("", -1))
                if kind == "conversion" and self.seen[index][2] == torch.float32:
                    self.seen[index][4] = True  # a rounded operand into an fp32 product
        if func is torch.ops.aten._to_copy.default:
            src = args[0]
            if (src.is_floating_point() and out.dtype != src.dtype
                    and src.data_ptr() not in self.params):
                kind = self.producer.get(src.data_ptr(), ("", -1))[0]
                self.seen.append([tuple(src.shape), src.dtype, out.dtype,
                                  kind == "conversion",
                                  kind == "product" and out.dtype != torch.float32])
                self.producer[out.data_ptr()] = ("conversion", len(self.seen) - 1)
                return out
        if not (func.is_view or func._schema.is_mutable
                or func is torch.ops.aten._unsafe_view.default):
            kind = "product" if func in _PRODUCTS else "other"
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.producer[t.data_ptr()] = (kind, -1)
        return out


@pytest.mark.parametrize("path", ["native", "fp32"])
def test_bf16_autocast_forward_converts_each_activation_once(path, choose):
    """``native``: bf16 operands straight into the GEMMs; ``fp32``: the same, plus each
    product's rounded operands converted up into the fp32 GEMM and its result rounded back
    (that rounding is the path's arithmetic, so those are the only round trips)."""
    choose("lowp_matmul", path)
    model = tiny_model().train()
    params = {p.data_ptr() for p in model.parameters()}
    B = 4
    images = torch.randn(B, 3, 16, 16)
    tokens = torch.randint(1, 49408, (B, 77))
    with torch.autocast("cpu", dtype=torch.bfloat16), _Conversions(params) as mode:
        model(images, tokens)
    seen = [tuple(s) for s in mode.seen]
    boundary = [s for s in seen if s[4]]
    rest = [s[:4] for s in seen if not s[4]]
    if path == "native":
        assert boundary == []
    else:
        # every product of the towers: operands up, results down; nothing else
        ups = [s for s in boundary if (s[1], s[2]) == (torch.bfloat16, torch.float32)]
        downs = [s for s in boundary if (s[1], s[2]) == (torch.float32, torch.bfloat16)]
        assert len(ups) + len(downs) == len(boundary)
        assert len(ups) >= len(downs) > 0  # a product has one or two rounded operands
        assert not any(s[3] for s in downs), "a product's result converted twice"
    C = 64
    image_tokens, text_tokens = (16 // 4) ** 2, 77
    activations = [s for s in rest if s[0] in ((B, image_tokens, C), (B, text_tokens, C))]
    # per block: the time mix's and the channel mix's input (the layer norm's fp32 output
    # under autocast), cast once to the glue dtype (time_mix.glue_dtype), and the head
    # norm's fp32 output cast once before the gate; nothing else of activation size
    blocks = {image_tokens: 2, text_tokens: 2}
    expected = sorted(((B, T, C), torch.float32, torch.bfloat16, False)
                      for T, n in blocks.items() for _ in range(3 * n))
    assert sorted(activations, key=str) == sorted(expected, key=str)
    others = [s for s in rest if s not in activations]
    # the image itself, into the patch embedding's convolution; the rest parameter-sized
    # (the stacked lerp weights, cast once per mix)
    assert ((B, 3, 16, 16), torch.float32, torch.bfloat16, False) in others
    big = [s for s in others if s[0] != (B, 3, 16, 16)
           and torch.Size(s[0]).numel() >= B * image_tokens * C]
    assert big == [], big
    assert [s for s in rest if s[3]] == [], "a converted tensor converted again"
