"""Every custom autograd Function's backward returns, for each input, a gradient of that
input's exact shape and dtype, called directly (autograd's engine would reduce a
broadcast gradient for an eager caller and hide the mismatch that a compiled graph, which
takes the backward's shapes as they are, turns into "returned an invalid gradient").
Broadcast operands, such as the (1, 1, C) lerp weights, are the cases that matter."""
from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import rwkv_clip

head_norm = importlib.import_module("rwkv_clip.ops.head_norm")
lerp = importlib.import_module("rwkv_clip.ops.lerp")
linear = importlib.import_module("rwkv_clip.ops.products")
relu_square = importlib.import_module("rwkv_clip.ops.relu_square")

# Functions whose backward needs more than one process (tested with their collectives)
NEEDS_PROCESS_GROUP = {"rwkv_clip.loss.NeighbourExchange"}


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def _cases():
    """(Function, inputs) pairs: tensors needing grad, other arguments as they are."""
    C = 8
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        out += [
            (lerp._Lerp, (_t(2, 3, C, dtype=dtype), _t(2, 3, C, dtype=dtype),
                          _t(1, 1, C, dtype=dtype))),
            (lerp._Lerp, (_t(2, 3, C, dtype=dtype), _t(1, 3, C, dtype=dtype),
                          _t(2, 3, C, dtype=dtype))),
            (lerp._LerpSplit, (_t(2, 3, C, dtype=dtype), _t(2, 3, C, dtype=dtype),
                               _t(5, 1, 1, C, dtype=dtype))),
            (lerp._LerpSplit, (_t(2, 3, C, dtype=dtype), _t(2, 3, C, dtype=dtype),
                               _t(2, 2, 3, C, dtype=dtype))),
            (lerp._LerpSplit, (_t(2, 3, C, dtype=dtype), _t(2, 3, C, dtype=dtype),
                               _t(1, 1, 1, C, dtype=dtype).expand(3, 1, 1, C))),
            (relu_square._ReluSquare, (_t(2, 3, C, dtype=dtype),)),
        ]
    out += [
        (head_norm._HeadNorm, (_t(6, 2, 4), _t(2, 4), _t(2, 4), 1e-5)),
        (linear._UpcastMatmul, (_t(2, 3, 4, dtype=torch.bfloat16), _t(4, 5, dtype=torch.bfloat16),
                                _t(5, dtype=torch.bfloat16))),
        (linear._UpcastMatmul, (_t(2, 3, 4, dtype=torch.bfloat16), _t(2, 4, 5, dtype=torch.bfloat16),
                                _t(2, 1, 5, dtype=torch.bfloat16))),
        (linear._UpcastMatmul, (_t(3, 4, dtype=torch.float16), _t(4, 5, dtype=torch.float16),
                                None)),
        (linear._UpcastConv2d, (_t(2, 3, 8, 8, dtype=torch.bfloat16),
                                _t(4, 3, 2, 2, dtype=torch.bfloat16), _t(4, dtype=torch.bfloat16),
                                (2, 2), (0, 0))),
    ]
    return out


def _functions() -> set[str]:
    """Every autograd Function subclass defined in the package."""
    for info in pkgutil.walk_packages(rwkv_clip.__path__, "rwkv_clip."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
    found, todo = set(), list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("rwkv_clip."):
            found.add(f"{cls.__module__}.{cls.__qualname__}")
    return found


def test_every_function_has_a_case():
    covered = {f"{fn.__module__}.{fn.__qualname__}" for fn, _ in _cases()}
    missing = _functions() - covered - NEEDS_PROCESS_GROUP
    assert not missing, f"autograd Functions without a gradient-shape case here: {missing}"


@pytest.mark.parametrize("fn,inputs", _cases(),
                         ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_backward_returns_the_input_shapes(fn, inputs):
    out = fn.apply(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    with torch.no_grad():  # as the engine runs it (no create_graph)
        grads = fn.backward(outs[0].grad_fn, *(torch.randn_like(o) for o in outs))
    grads = grads if isinstance(grads, tuple) else (grads,)
    assert len(grads) == len(inputs)
    for i, (x, g) in enumerate(zip(inputs, grads, strict=True)):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            assert g is not None, f"input {i}: no gradient"
            assert g.shape == x.shape, f"input {i}: gradient {tuple(g.shape)}, input {tuple(x.shape)}"
            assert g.dtype == x.dtype, f"input {i}: gradient {g.dtype}, input {x.dtype}"
        else:
            assert g is None, f"input {i} is no tensor needing grad, yet has a gradient"
