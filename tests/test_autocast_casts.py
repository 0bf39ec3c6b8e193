"""Dtype conversions in a bf16-autocast forward of both towers: counted at the dispatcher
(aten._to_copy between floating dtypes), bounded to the ones autocast's rules and the
original's arithmetic make, and none of them a round trip (a conversion of a converted
tensor)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from train_util import tiny_model


class _Conversions(TorchDispatchMode):
    """Records (source shape, source dtype, result dtype, round trip) of every floating
    conversion of a tensor that is not one of ``params``."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params = params
        self.converted: set[int] = set()  # storages written by a conversion
        self.seen: list[tuple[tuple[int, ...], torch.dtype, torch.dtype, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            src = args[0]
            if (src.is_floating_point() and out.dtype != src.dtype
                    and src.data_ptr() not in self.params):
                self.seen.append((tuple(src.shape), src.dtype, out.dtype,
                                  src.data_ptr() in self.converted))
                self.converted.add(out.data_ptr())
        return out


def test_bf16_autocast_forward_converts_each_activation_once():
    model = tiny_model().train()
    params = {p.data_ptr() for p in model.parameters()}
    B = 4
    images = torch.randn(B, 3, 16, 16)
    tokens = torch.randint(1, 49408, (B, 77))
    with torch.autocast("cpu", dtype=torch.bfloat16), _Conversions(params) as mode:
        model(images, tokens)
    C = 64
    image_tokens, text_tokens = (16 // 4) ** 2, 77
    activations = [s for s in mode.seen if s[0] in ((B, image_tokens, C), (B, text_tokens, C))]
    # per block: the time mix's and the channel mix's input (the layer norm's fp32 output
    # under autocast), cast once to the glue dtype (time_mix.glue_dtype), and the head
    # norm's fp32 output cast once before the gate; nothing else of activation size
    blocks = {image_tokens: 2, text_tokens: 2}
    expected = sorted(((B, T, C), torch.float32, torch.bfloat16, False)
                      for T, n in blocks.items() for _ in range(3 * n))
    assert sorted(activations, key=str) == sorted(expected, key=str)
    others = [s for s in mode.seen if s not in activations]
    # the image itself, into the patch embedding's convolution; the rest parameter-sized
    # (the stacked lerp weights, cast once per mix)
    assert ((B, 3, 16, 16), torch.float32, torch.bfloat16, False) in others
    big = [s for s in others if s[0] != (B, 3, 16, 16)
           and torch.Size(s[0]).numel() >= B * image_tokens * C]
    assert big == [], big
    assert not any(s[3] for s in mode.seen), "a converted tensor converted again"
