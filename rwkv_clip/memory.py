"""Memory planner: what a training step or inference of RWKV-CLIP needs, per GPU.

    python -m rwkv_clip.memory --config model_config/RWKV_CLIP_B32.json --batch-size 256 \
        --precision bf16 [--checkpointing] [--gradient-acc K] [--gpus N] [--measure] [--json]

The estimate is analytic: it walks the architecture op by op (the same ops as
:mod:`rwkv_clip.image_rwkv`, :mod:`rwkv_clip.text_rwkv` and
:mod:`rwkv_clip.layers.time_mix`) and, for each op, counts the tensors autograd saves
for backward, in the dtype autocast gives them (linear/matmul/bmm/conv in the low
precision; layer_norm, group_norm, pow and the loss in fp32 on CUDA; plain type
promotion elsewhere). A tensor saved by several ops is counted once. Backward is then
simulated segment by segment in the order autograd runs it (text tower first, it was
built last): saved activations of not-yet-processed segments + gradients produced so
far + the working set of the segment being differentiated. Nothing is fitted to a
measurement; ``--measure`` runs one real step and prints the measured peak beside it.

Conventions: ``--batch-size`` is per GPU (the original's recipe: 512 per GPU x 8);
with ``--gradient-acc K`` each micro-batch has batch/K samples, the gradients stay
alive across micro-batches and the loss still scores the whole batch (the training
loop's exact accumulation caches every micro-batch's features); the loss is in fp32; ``--gpus N`` makes the ClipLoss logits (N*B) x (N*B) (no
``local_loss``) and adds DDP's gradient buckets (one more copy of the gradients).
Steady state is assumed (AdamW moments already exist, gradients set to None between
steps). The optimizer is AdamW: two moments per parameter in the parameter's dtype,
plus its temporaries (foreach on CUDA: one parameter-sized sqrt buffer; per-tensor on
CPU: two buffers of the largest parameter).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GiB = 1024 ** 3
MiB = 1024 ** 2

# Memory torch reports for each card (total_memory), in GiB; the planner keeps a
# margin for the CUDA context, cuBLAS workspaces and allocator fragmentation.
CARDS = {
    "T4 16GB": 14.58,
    "L4 24GB": 22.03,
    "A100 40GB": 39.39,
    "A100 80GB": 79.15,
    "H100 80GB": 79.11,
    "H200 141GB": 139.81,
}
CARD_RESERVE_GIB = 1.0      # CUDA context + cuBLAS/cuDNN workspaces (not in max_allocated)
CARD_USABLE_FRACTION = 0.92  # allocator fragmentation / caching headroom

TIME_MIX_EXTRA_DIM = 32   # must match rwkv_clip.layers.time_mix
TIME_DECAY_EXTRA_DIM = 64

_SIZES = {"fp32": 4, "bf16": 2, "fp16": 2, "i64": 8}
# Ops that CUDA autocast runs in fp32 (torch's autocast fp32 lists); CPU autocast only
# forces the loss to fp32 (layer_norm/group_norm/pow stay in the input dtype there).
_FP32_OPS = {"cuda": {"layer_norm", "group_norm", "pow", "norm", "log_softmax", "cross_entropy"},
             "cpu": {"cross_entropy", "log_softmax"}}


def _promote(a: str, b: str) -> str:
    if a == b:
        return a
    return "fp32"  # bf16 x fp16 -> fp32 too


# ----------------------------------------------------------------------------- walker
class Sym:
    """A symbolic tensor: element count and dtype. Identity = Python identity."""
    __slots__ = ("n", "dtype", "param", "__weakref__")

    def __init__(self, n: int, dtype: str, param: bool = False) -> None:
        self.n, self.dtype, self.param = int(n), dtype, param

    @property
    def nbytes(self) -> int:
        return self.n * _SIZES[self.dtype]


class Walker:
    """Walks ops, recording what autograd saves (``saved``) for one segment at a time.

    amp: None (fp32) or "bf16"/"fp16"; device: "cuda" or "cpu" (autocast op lists).
    """

    def __init__(self, amp: str | None, device: str) -> None:
        self.amp, self.device = amp, device
        self.saved: dict[int, Sym] = {}
        self.weight_cast_bytes = 0  # low-precision copies of weights (autocast cache)
        self._casts_taken = 0

    # bookkeeping
    def new(self, n: int, dtype: str) -> Sym:
        return Sym(n, dtype)

    def save(self, *tensors: Sym) -> None:
        for t in tensors:
            if not t.param:
                self.saved[id(t)] = t

    def take_saved(self) -> int:
        """Bytes saved since the last call (the finished segment); resets the record."""
        total = sum(t.nbytes for t in self.saved.values())
        self.saved = {}
        return total

    def take_casts(self) -> int:
        """Bytes of weight copies autocast made since the last call."""
        total, self._casts_taken = self.weight_cast_bytes - self._casts_taken, self.weight_cast_bytes
        return total

    # casting rules
    def _lowp_in(self, x: Sym) -> Sym:
        if self.amp is None or x.dtype == self.amp:
            return x
        if x.param:
            # autocast caches one low-precision copy per weight for the autocast region;
            # counted in weight_cast_bytes (kept apart from `saved`: under checkpointing
            # the cache, not the graph, keeps them alive). Each weight feeds one matmul.
            self.weight_cast_bytes += x.n * _SIZES[self.amp]
            return Sym(x.n, self.amp, param=True)
        return Sym(x.n, self.amp)

    def _fp32_in(self, op: str, x: Sym) -> Sym:
        if self.amp is not None and op in _FP32_OPS[self.device] and x.dtype != "fp32":
            return Sym(x.n, "fp32")
        return x

    def _out_dtype_fp32_op(self, op: str, x: Sym) -> str:
        if self.amp is not None and op in _FP32_OPS[self.device]:
            return "fp32"
        return x.dtype

    # ops (saved tensors follow torch's derivatives.yaml)
    def matmul(self, x: Sym, w: Sym, n_in: int, n_out: int) -> Sym:
        """linear / x @ W / bmm / conv as a matmul: saves input and weight."""
        xi, wi = self._lowp_in(x), self._lowp_in(w)
        self.save(xi, wi)
        return self.new(x.n // n_in * n_out, self.amp or _promote(x.dtype, w.dtype))

    def add(self, a: Sym, b: Sym) -> Sym:  # add/sub save nothing
        return self.new(max(a.n, b.n), _promote(a.dtype, b.dtype))

    def mul(self, a: Sym, b: Sym) -> Sym:  # both require grad: both saved
        self.save(a, b)
        return self.new(max(a.n, b.n), _promote(a.dtype, b.dtype))

    def unary_saves_result(self, x: Sym) -> Sym:  # tanh, sigmoid, relu
        out = self.new(x.n, x.dtype)
        self.save(out)
        return out

    def silu(self, x: Sym) -> Sym:  # saves its input
        self.save(x)
        return self.new(x.n, x.dtype)

    def pow2(self, x: Sym) -> Sym:  # torch.square / ** 2: pow saves self
        xi = self._fp32_in("pow", x)
        self.save(xi)
        return self.new(x.n, self._out_dtype_fp32_op("pow", x))

    def norm_layer(self, op: str, x: Sym, rows: int) -> Sym:
        """layer_norm / group_norm: saves input, mean and rstd (fp32 per row/group)."""
        xi = self._fp32_in(op, x)
        self.save(xi, Sym(2 * rows, "fp32"))
        return self.new(x.n, self._out_dtype_fp32_op(op, x))


@dataclass
class Segment:
    """A piece of the forward: bytes autograd saves, its parameters' gradient bytes, and
    the extra working memory its backward needs (gradient buffers)."""
    name: str
    saved: int
    grad_bytes: int
    workspace: int
    ckpt_input: int = 0   # bytes a checkpointed block keeps (its input)
    inference_peak: int = 0  # working set of this segment under no_grad
    casts: int = 0        # autocast low-precision weight copies made in this segment


# ----------------------------------------------------------------------------- params
@dataclass
class ParamTable:
    """Every parameter as (name, numel, dtype), from the config alone."""
    items: list[tuple[str, int, str]] = field(default_factory=list)

    def add(self, name: str, numel: int, dtype: str = "fp32") -> None:
        self.items.append((name, int(numel), dtype))

    def count(self, prefix: str = "") -> int:
        return sum(n for name, n, _ in self.items if name.startswith(prefix))

    def nbytes(self, prefix: str = "") -> int:
        return sum(n * _SIZES[d] for name, n, d in self.items if name.startswith(prefix))

    def largest_bytes(self) -> int:
        return max(n * _SIZES[d] for _, n, d in self.items)


def _cfg(args: Any, name: str, default=None):
    return getattr(args, name, default) if not isinstance(args, dict) else args.get(name, default)


def _patch_grid(input_size: int, patch_size: int) -> int:
    """Patches per side: the patch embedding pads a partial patch (ceil division)."""
    return -(-input_size // patch_size)


def parameter_table(args: Any) -> ParamTable:
    """Parameters of create_RWKV_Model(args), computed from the config."""
    t = ParamTable()
    C = _cfg(args, "image_embed_dims")
    p = _cfg(args, "image_patch_size")
    S = _cfg(args, "input_size")
    D = _cfg(args, "image_depth")
    F = _cfg(args, "image_hidden_rate") * C
    grid = _patch_grid(S, p)
    t.add("image.patch_embed", C * 3 * p * p + C)
    t.add("image.pos_embed", grid * grid * C)
    if _cfg(args, "image_with_cls_token", False):
        t.add("image.cls_token", C)
    for i in range(D):
        pre = f"image.layers.{i}."
        t.add(pre + "ln", (6 if i == 0 else 4) * C)
        t.add(pre + "att.time_maa", 6 * C + C * 5 * TIME_MIX_EXTRA_DIM + 5 * TIME_MIX_EXTRA_DIM * C)
        t.add(pre + "att.time_decay", C + 2 * C * TIME_DECAY_EXTRA_DIM + C)  # + faaaa
        t.add(pre + "att.linears", 5 * C * C)
        t.add(pre + "att.ln_x", 2 * C)
        t.add(pre + "ffn", 2 * C + 2 * C * F + C * C)
    t.add("image.ln1", 2 * C)

    E = _cfg(args, "n_embd")
    A = _cfg(args, "dim_att")
    Fx = _cfg(args, "dim_ffn")
    L = _cfg(args, "n_layer")
    V = _cfg(args, "vocab_size")
    for bad in ("head_qk", "tiny_att_dim", "pos_emb"):
        if (_cfg(args, bad, 0) or 0) > 0:
            raise ValueError(f"memory planner: text option {bad} > 0 is not modelled")
    t.add("text.emb", V * E)
    for i in range(L):
        pre = f"text.blocks.{i}."
        t.add(pre + "ln", (6 if i == 0 else 4) * E)
        t.add(pre + "att.time_maa", 6 * E + E * 5 * TIME_MIX_EXTRA_DIM + 5 * TIME_MIX_EXTRA_DIM * E)
        t.add(pre + "att.time_decay_lora", E * TIME_DECAY_EXTRA_DIM + TIME_DECAY_EXTRA_DIM * A)
        t.add(pre + "att.time_decay", A, "bf16")
        t.add(pre + "att.time_faaaa", A, "bf16")
        t.add(pre + "att.linears", 4 * E * A + A * E)
        t.add(pre + "att.ln_x", 2 * A)
        t.add(pre + "ffn", 2 * E + E * Fx + E * E + Fx * E)
    t.add("text.ln_out", 2 * E)
    t.add("logit_scale", 1)
    return t


# ----------------------------------------------------------------------------- towers
def _time_mix(w: Walker, a: Sym, C: int, A: int, H: int, decay_dtype: str, amp_grad: str) -> tuple[Sym, int, int]:
    """RWKV-6 time mix (both towers); returns (output, backward workspace, inference peak)."""
    n = a.n
    na = n // C * A
    P = lambda numel, dt="fp32": Sym(numel, dt, param=True)  # noqa: E731
    sh = w.new(n, a.dtype)                               # token shift output
    xx = w.add(sh, a)                                    # shift(x) - x
    xxx = w.add(a, w.mul(xx, P(C)))                      # x + xx * time_maa_x
    m1 = w.matmul(xxx, P(C * 5 * TIME_MIX_EXTRA_DIM), C, 5 * TIME_MIX_EXTRA_DIM)
    t1 = w.unary_saves_result(m1)                        # tanh
    mm = w.matmul(t1, P(5 * TIME_MIX_EXTRA_DIM * C), TIME_MIX_EXTRA_DIM, C)  # bmm -> 5 x (B,T,C)
    mixes = {}
    for name in "wkvrg":
        s = w.add(P(C), Sym(n, mm.dtype))                # time_maa_* + m*
        mixes[name] = w.add(a, w.mul(xx, s))
    r = w.matmul(mixes["r"], P(C * A), C, A)
    k = w.matmul(mixes["k"], P(C * A), C, A)
    v = w.matmul(mixes["v"], P(C * A), C, A)
    g = w.silu(w.matmul(mixes["g"], P(C * A), C, A))
    d1 = w.matmul(mixes["w"], P(C * TIME_DECAY_EXTRA_DIM), C, TIME_DECAY_EXTRA_DIM)
    d2 = w.matmul(w.unary_saves_result(d1), P(TIME_DECAY_EXTRA_DIM * A),
                  TIME_DECAY_EXTRA_DIM, A)
    decay = w.add(P(A, decay_dtype), d2)
    # WKV: the native kernels save r, k, v, w as given (bf16/fp16/fp32 read directly)
    w.save(r, k, v, decay)
    y = w.new(na, "fp32")
    yn = w.norm_layer("group_norm", y, (na // A) * H)  # mean/rstd per (row, head)
    out = w.matmul(w.mul(yn, g), P(A * C), A, C)
    b = _SIZES
    # backward working set: the five lerp gradients plus their stacked copy (bmm
    # backward), the gradients of xx and x; WKV backward: gr/gk/gv/gw + gy in fp32 and
    # their casts back to the input dtypes.
    ws_lerp = 10 * n * b[mm.dtype] + 2 * n * 4
    ws_wkv = 5 * na * 4 + 3 * na * b[amp_grad]
    # no_grad working set inside the projections: x, a, xx, the five lerped inputs and
    # the decay (dtype of a), the bmm output (5), r, k, v, g, d2 and one cast input.
    inf = (3 + 6) * n * b[a.dtype] + 5 * n * b[mm.dtype] + 5 * na * b[r.dtype] + n * b[r.dtype]
    return out, max(ws_lerp, ws_wkv), inf


def _channel_mix(w: Walker, bx: Sym, C: int, Fh: int, image: bool, amp_grad: str) -> tuple[Sym, int, int]:
    n = bx.n
    nf = n // C * Fh
    P = lambda numel: Sym(numel, "fp32", param=True)  # noqa: E731
    sh = w.new(n, bx.dtype)
    if image:   # xk = x * m + shift(x) * (1 - m)
        one_minus = Sym(C, "fp32")
        xk = w.add(w.mul(bx, P(C)), w.mul(sh, one_minus))
        xr = w.add(w.mul(bx, P(C)), w.mul(sh, Sym(C, "fp32")))
    else:       # xk = x + (shift(x) - x) * time_maa_k
        xx = w.add(sh, bx)
        xk = w.add(bx, w.mul(xx, P(C)))
        xr = w.add(bx, w.mul(xx, P(C)))
    kk = w.unary_saves_result(w.matmul(xk, P(C * Fh), C, Fh))   # relu
    k2 = w.pow2(kk)
    val = w.matmul(k2, P(Fh * C), Fh, C)
    rr = w.unary_saves_result(w.matmul(xr, P(C * C), C, C))    # sigmoid
    out = w.mul(rr, val)
    b = _SIZES
    ws = 3 * nf * b[k2.dtype] + 2 * n * 4
    inf = 5 * n * b[bx.dtype] + nf * b[kk.dtype] + 2 * nf * b[k2.dtype]
    return out, ws, inf


def _block(w: Walker, x: Sym, C: int, A: int, H: int, Fh: int, first: bool, image: bool,
           decay_dtype: str, amp_grad: str) -> tuple[Sym, int, int]:
    rows = x.n // C
    inf0 = x.n * _SIZES[x.dtype]
    if first:
        x = w.norm_layer("layer_norm", x, rows)           # ln0
    a = w.norm_layer("layer_norm", x, rows)               # ln1
    o, ws1, inf1 = _time_mix(w, a, C, A, H, decay_dtype, amp_grad)
    x1 = w.add(x, o)
    bx = w.norm_layer("layer_norm", x1, rows)             # ln2
    c, ws2, inf2 = _channel_mix(w, bx, C, Fh, image, amp_grad)
    x2 = w.add(x1, c)
    return x2, max(ws1, ws2), inf0 + max(inf1, inf2 + x1.n * _SIZES[x1.dtype])


@dataclass
class Plan:
    segments: list[Segment]
    weight_cast_bytes: int
    micro_batch: int


def _append(w: Walker, segs: list, seg: Segment) -> None:
    seg.casts = w.take_casts()
    segs.append(seg)


def activation_segments(args: Any, batch: int, amp: str | None, device: str,
                        world_size: int = 1, local_loss: bool = False,
                        loss_batch: int | None = None) -> Plan:
    """Forward, segment by segment, for one micro-batch of ``batch`` samples; the loss
    scores ``loss_batch`` samples per rank (the whole accumulated batch: the training
    loop's exact accumulation caches every micro-batch's features)."""
    w = Walker(amp, device)
    params = parameter_table(args)
    grads = lambda prefix: params.nbytes(prefix)  # noqa: E731
    amp_grad = amp or "fp32"
    segs: list[Segment] = []
    C = _cfg(args, "image_embed_dims")
    p = _cfg(args, "image_patch_size")
    S = _cfg(args, "input_size")
    D = _cfg(args, "image_depth")
    Fh = _cfg(args, "image_hidden_rate") * C
    grid = _patch_grid(S, p)
    T = grid * grid + (1 if _cfg(args, "image_with_cls_token", False) else 0)
    B = batch
    img = Sym(B * 3 * S * S, "fp32")                       # input: no grad, saved by conv
    conv = w.matmul(img, Sym(C * 3 * p * p, "fp32", param=True), 3 * p * p, C)
    w.saved.pop(id(img), None)                            # the input itself is not an activation
    x = w.add(Sym(B * T * C, conv.dtype), Sym(T * C, "fp32", param=True))  # + pos_embed
    _append(w, segs, Segment("image.embed", w.take_saved(), grads("image.patch_embed")
                        + grads("image.pos_embed"), x.n * 4 * 2, inference_peak=
                        img.nbytes + 2 * x.n * 4))
    for i in range(D):
        xin = x
        x, ws, inf = _block(w, x, C, C, _cfg(args, "image_num_heads"), Fh, i == 0, True,
                            "fp32", amp_grad)
        _append(w, segs, Segment(f"image.block{i}", w.take_saved(), grads(f"image.layers.{i}."), ws,
                            ckpt_input=xin.nbytes, inference_peak=inf))
    w.norm_layer("layer_norm", x, B * T)                  # final ln1, then mean (saves nothing)
    _append(w, segs, Segment("image.head", w.take_saved(), grads("image.ln1"), 2 * x.n * 4,
                        ckpt_input=0, inference_peak=2 * x.n * 4))

    E = _cfg(args, "n_embd")
    A = _cfg(args, "dim_att")
    Fx = _cfg(args, "dim_ffn")
    L = _cfg(args, "n_layer")
    Tt = _cfg(args, "ctx_len")
    tok = Sym(B * Tt, "i64")
    w.save(tok)  # embedding saves its indices (the input tensor: counted as input below)
    w.saved.pop(id(tok))
    x = Sym(B * Tt * E, "fp32")                            # embedding output (param dtype)
    V = _cfg(args, "vocab_size")
    _append(w, segs, Segment("text.emb", w.take_saved(), grads("text.emb"),
                        V * E * 4 + x.n * 4, inference_peak=x.nbytes))
    for i in range(L):
        xin = x
        x, ws, inf = _block(w, x, E, A, A // _cfg(args, "head_size"), Fx, i == 0, False,
                            "bf16", amp_grad)
        _append(w, segs, Segment(f"text.block{i}", w.take_saved(), grads(f"text.blocks.{i}."), ws,
                            ckpt_input=xin.nbytes, inference_peak=inf))
    t = w.norm_layer("layer_norm", x, B * Tt)             # ln_out
    w.save(t, Sym(B * Tt, "fp32"))                        # F.normalize: norm saves t, result
    _append(w, segs, Segment("text.head", w.take_saved(), grads("text.ln_out"), 3 * t.n * 4,
                        inference_peak=3 * t.n * 4))
    # ClipLoss over the gathered batch, in fp32 (the loop casts the features to float):
    # logit matmul(s) + two log_softmax results
    glob = (loss_batch or B) * world_size
    rows = (loss_batch or B) if (local_loss and world_size > 1) else glob
    n_logits = rows * glob
    n_mm = 2 if (world_size == 1 or local_loss) else 1
    loss_saved = n_mm * n_logits * 4 + 2 * n_logits * 4 + 4 * glob * C * 4
    _append(w, segs, Segment("loss", loss_saved, grads("logit_scale"), 2 * n_logits * 4))
    return Plan(segs, w.weight_cast_bytes, B)


# ----------------------------------------------------------------------------- estimate
@dataclass
class Estimate:
    config: str
    batch_size: int
    micro_batch: int
    precision: str
    checkpointing: bool
    gradient_acc: int
    gpus: int
    device: str
    parameters: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    ddp_bucket_bytes: int
    input_bytes: int
    activation_bytes: int       # saved for backward at the peak (incl. autocast weight copies)
    workspace_bytes: int        # backward / optimizer temporaries at the peak
    training_peak_bytes: int
    training_peak_phase: str
    inference_batch: int
    inference_activation_bytes: int
    inference_peak_bytes: int
    max_batch: dict[str, int]


def _amp(precision: str) -> str | None:
    if precision in ("fp32", "float32", "32"):
        return None
    if precision in ("bf16", "amp_bf16", "bfloat16"):
        return "bf16"
    if precision in ("fp16", "amp", "float16", "16"):
        return "fp16"
    raise ValueError(f"unknown precision {precision!r} (fp32, bf16 or fp16)")


def _input_bytes(args: Any, batch: int) -> int:
    S = _cfg(args, "input_size")
    return batch * 3 * S * S * 4 + batch * _cfg(args, "ctx_len") * 8


def training_peak(args: Any, batch: int, precision: str, checkpointing: bool = False,
                  gradient_acc: int = 1, gpus: int = 1, device: str = "cuda",
                  local_loss: bool = False) -> dict:
    """Peak bytes of one steady-state training step and its parts."""
    amp = _amp(precision)
    table = parameter_table(args)
    pbytes = table.nbytes()
    grad_b = pbytes
    opt_b = 2 * pbytes
    ddp_b = grad_b if gpus > 1 else 0
    micro = max(1, batch // max(1, gradient_acc))
    plan = activation_segments(args, micro, amp, device, gpus, local_loss, loss_batch=batch)
    inputs = _input_bytes(args, batch)
    persistent = pbytes + opt_b + ddp_b + inputs
    grads_alive = grad_b if gradient_acc > 1 else 0   # later micro-batches: grads exist
    segs = plan.segments
    best = (0, "", 0, 0)  # total, phase, activations, workspace
    produced = 0
    if not checkpointing:
        held = sum(s.saved + s.casts for s in segs)
        best = max(best, (persistent + grads_alive + held, "end of forward", held, 0))
        for i in range(len(segs) - 1, -1, -1):
            acts = sum(s.saved + s.casts for s in segs[:i + 1])
            total = persistent + max(grads_alive, produced) + acts + segs[i].workspace
            best = max(best, (total, f"backward of {segs[i].name}", acts, segs[i].workspace))
            produced += segs[i].grad_bytes
    else:
        # forward: block inputs, the rest's saved tensors, the autocast weight cache
        # (held until autocast exits) and one block's no_grad working set
        fwd = sum(s.ckpt_input if s.ckpt_input else s.saved for s in segs)
        fwd += sum(s.casts for s in segs) + max(s.inference_peak for s in segs if s.ckpt_input)
        best = max(best, (persistent + grads_alive + fwd, "forward", fwd, 0))
        for i in range(len(segs) - 1, -1, -1):
            s = segs[i]
            acts = sum(x.ckpt_input if x.ckpt_input else x.saved + x.casts for x in segs[:i + 1])
            if s.ckpt_input:   # this block is recomputed: its saved tensors and casts
                acts += s.saved + s.casts
            total = persistent + max(grads_alive, produced) + acts + s.workspace
            phase = f"backward of {s.name}" + (" (recomputed)" if s.ckpt_input else "")
            best = max(best, (total, phase, acts, s.workspace))
            produced += s.grad_bytes
    # optimizer step: all gradients + AdamW temporaries
    opt_tmp = pbytes if device == "cuda" else 2 * table.largest_bytes()
    clip_tmp = 0
    opt_total = persistent + grad_b + opt_tmp + clip_tmp
    best = max(best, (opt_total, "optimizer step", 0, opt_tmp))
    total, phase, acts, ws = best
    return dict(parameter_bytes=pbytes, gradient_bytes=grad_b, optimizer_bytes=opt_b,
                ddp_bucket_bytes=ddp_b, input_bytes=inputs, activation_bytes=acts,
                workspace_bytes=ws, training_peak_bytes=total, training_peak_phase=phase,
                micro_batch=micro, parameters=table.count())


def inference_peak(args: Any, batch: int, precision: str, device: str = "cuda") -> dict:
    """model.eval() under torch.no_grad: parameters + inputs + the largest per-layer set."""
    amp = _amp(precision)
    plan = activation_segments(args, batch, amp, device)
    acts = max(s.inference_peak for s in plan.segments) + plan.weight_cast_bytes
    pbytes = parameter_table(args).nbytes()
    total = pbytes + _input_bytes(args, batch) + acts
    return dict(inference_activation_bytes=acts, inference_peak_bytes=total)


def card_capacity(total_gib: float) -> int:
    return int((total_gib * CARD_USABLE_FRACTION - CARD_RESERVE_GIB) * GiB)


def max_batch(args: Any, capacity: int, precision: str, checkpointing: bool,
              gradient_acc: int, gpus: int, device: str = "cuda") -> int:
    """Largest per-GPU batch (a multiple of gradient_acc) whose training peak fits."""
    def fits(b: int) -> bool:
        return training_peak(args, b, precision, checkpointing, gradient_acc, gpus,
                             device)["training_peak_bytes"] <= capacity
    k = max(1, gradient_acc)
    if not fits(k):
        return 0
    lo, hi = 1, 2
    while fits(hi * k):
        lo, hi = hi, hi * 2
        if hi > 1 << 22:
            return lo * k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * k) else (lo, mid)
    return lo * k


def estimate(args: Any, batch: int, precision: str, checkpointing: bool = False,
             gradient_acc: int = 1, gpus: int = 1, device: str = "cuda",
             config_name: str = "", inference_batch: int | None = None,
             cards: bool = True) -> Estimate:
    tr = training_peak(args, batch, precision, checkpointing, gradient_acc, gpus, device)
    ib = batch if inference_batch is None else inference_batch
    inf = inference_peak(args, ib, precision, device)
    fit = {}
    if cards:
        for card, gib in CARDS.items():
            fit[card] = max_batch(args, card_capacity(gib), precision, checkpointing,
                                  gradient_acc, gpus, "cuda")
    return Estimate(config=config_name, batch_size=batch, precision=precision,
                    checkpointing=checkpointing, gradient_acc=gradient_acc, gpus=gpus,
                    device=device, inference_batch=ib, max_batch=fit, **tr, **inf)


# ----------------------------------------------------------------------------- measuring
def synthetic_batch(args: Any, batch: int, device, seed: int = 0):
    import torch
    g = torch.Generator().manual_seed(seed)
    S = _cfg(args, "input_size")
    images = torch.randn(batch, 3, S, S, generator=g).to(device)
    tokens = torch.randint(0, _cfg(args, "vocab_size"), (batch, _cfg(args, "ctx_len")),
                           generator=g).to(device)
    return images, tokens


def _null_context():
    import contextlib
    return contextlib.nullcontext()


def autocast_context(precision: str, device_type: str):
    import contextlib

    import torch
    amp = _amp(precision)
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def make_step(model, precision: str, device_type: str, lr: float = 1e-4):
    """One training step exactly as the training loop runs it
    (:func:`rwkv_clip.train.accumulation.train_step`: forward both towers under autocast,
    L2-normalise, fp32 ClipLoss, backward, clip grad norm 1.0, AdamW betas 0.9/0.98 step,
    logit-scale clamp) on one micro-batch; returns step(images, tokens) -> loss."""
    import functools

    import torch

    from .loss import ClipLoss
    from .train.accumulation import MicroBatch, train_step
    amp = _amp(precision)
    autocast = (functools.partial(torch.autocast, device_type=device_type,
                                  dtype=torch.bfloat16 if amp == "bf16" else torch.float16)
                if amp else _null_context)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.2)
    loss_fn = ClipLoss()
    scaler = torch.amp.GradScaler(device_type, init_scale=128) if amp == "fp16" else None

    def step(images, tokens):
        result = train_step(model, [MicroBatch(images, tokens)], loss_fn, opt, scaler=scaler,
                            autocast=autocast, clip_grad_norm=1.0)
        return torch.tensor(result.loss)
    step.optimizer = opt
    return step


def _rss_kib(field_name: str = "VmRSS") -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field_name}:\s+(\d+)", text).group(1))


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak resident set during a block: the kernel's VmHWM after resetting it, or a
    sampling thread on VmRSS where the reset is not allowed."""

    def __enter__(self):
        self.by_hwm = _reset_hwm()
        self.peak = _rss_kib()
        self._stop = threading.Event()
        if not self.by_hwm:
            self._t = threading.Thread(target=self._sample, daemon=True)
            self._t.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_kib())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        if self.by_hwm:
            self.peak = _rss_kib("VmHWM")
        else:
            self._t.join()
            self.peak = max(self.peak, _rss_kib())
        return False


def _build(config: str, device, checkpointing: bool, wkv_backend: str | None):
    import torch

    from .config import load_model_configs
    from .model import create_RWKV_Model
    args = load_model_configs(config)
    torch.manual_seed(0)
    model = create_RWKV_Model(args).to(device)
    model.set_grad_checkpointing(checkpointing)
    model.set_wkv_backend(wkv_backend)
    return args, model


def _warm_up_cpu(wkv_backend: str | None) -> None:
    """Touch the code paths (libraries, kernels, thread pools) with a throwaway tiny
    model, so the measured RSS growth is tensors rather than code pages."""
    import torch
    tiny = Path(__file__).resolve().parents[1] / "model_config" / "RWKV_CLIP_tiny.json"
    if not tiny.is_file():
        return
    args, model = _build(str(tiny), "cpu", False, wkv_backend)
    step = make_step(model, "fp32", "cpu")
    images, tokens = synthetic_batch(args, 2, "cpu")
    for _ in range(2):
        step(images, tokens)
    with torch.no_grad():
        model.eval()(images, tokens)
    del model, step, images, tokens
    gc.collect()


def measure_worker(config: str, batch: int, precision: str, checkpointing: bool,
                   device: str, mode: str, wkv_backend: str | None = None) -> dict:
    """Run in a fresh process: one warm step, then one measured step (or an inference
    forward). CUDA: max_memory_allocated; CPU: peak RSS minus the RSS before the model
    was built (so parameters are included on both)."""
    import torch
    dev = torch.device(device)
    if dev.type == "cpu":
        _warm_up_cpu(wkv_backend)
        base_kib = _rss_kib()
    else:
        torch.cuda.init()
        base = torch.cuda.memory_allocated(dev)
    args, model = _build(config, dev, checkpointing, wkv_backend)
    images, tokens = synthetic_batch(args, batch, dev)
    t0 = time.perf_counter()
    if mode == "train":
        model.train()
        step = make_step(model, precision, dev.type)
        step(images, tokens)                       # warm: AdamW moments now exist
        step.optimizer.zero_grad(set_to_none=True)
        run = lambda: step(images, tokens)  # noqa: E731
    else:
        model.eval()

        def run():
            with torch.no_grad(), autocast_context(precision, dev.type):
                return model(images, tokens)
        run()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        t1 = time.perf_counter()
        run()
        torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - t1
        measured = torch.cuda.max_memory_allocated(dev) - base
        extra = {"max_reserved_bytes": torch.cuda.max_memory_reserved(dev),
                 "method": "torch.cuda.max_memory_allocated after reset_peak_memory_stats"}
    else:
        with PeakRSS() as peak:
            t1 = time.perf_counter()
            run()
            elapsed = time.perf_counter() - t1
        measured = (peak.peak - base_kib) * 1024
        extra = {"method": "peak RSS (VmHWM after clear_refs)" if peak.by_hwm
                 else "peak RSS (1 ms VmRSS sampling)",
                 "baseline_rss_bytes": base_kib * 1024}
    return dict(measured_peak_bytes=int(measured), step_seconds=elapsed,
                warm_seconds=t1 - t0, torch=torch.__version__, **extra)


def measure(config: str, batch: int, precision: str, checkpointing: bool, device: str,
            mode: str = "train", wkv_backend: str | None = None, timeout: float = 1800) -> dict:
    """Run :func:`measure_worker` in a fresh subprocess (so earlier allocations and the
    allocator's history do not blur the peak); returns its dict."""
    env = dict(os.environ)
    # Large tensors straight from mmap, freed memory back to the OS at once: RSS then
    # follows the live tensors (glibc otherwise keeps freed heap pages resident).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    env.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")
    spec = json.dumps(dict(config=str(config), batch=batch, precision=precision,
                           checkpointing=checkpointing, device=device, mode=mode,
                           wkv_backend=wkv_backend))
    proc = subprocess.run([sys.executable, "-m", "rwkv_clip.memory", "--_worker", spec],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- CLI
def _fmt(b: int) -> str:
    return f"{b / GiB:8.3f} GiB" if b >= GiB else f"{b / MiB:8.1f} MiB"


def _default_device() -> str:
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rwkv_clip.memory", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="model config JSON (default: B/32)")
    ap.add_argument("--batch-size", type=int, default=256, help="per-GPU batch size")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    ap.add_argument("--gradient-acc", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=1, help="data-parallel world size")
    ap.add_argument("--local-loss", action="store_true", help="ClipLoss local_loss logits")
    ap.add_argument("--inference-batch", type=int, default=None,
                    help="batch for the inference figures (default: --batch-size)")
    ap.add_argument("--mode", choices=["train", "inference"], default="train",
                    help="what --measure runs")
    ap.add_argument("--measure", action="store_true", help="also run one real step and measure")
    ap.add_argument("--device", default=None, choices=["cpu", "cuda"],
                    help="device for --measure and the estimate's autocast rules")
    ap.add_argument("--wkv-backend", default=None, help="force a WKV backend for --measure")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns._worker:
        print(json.dumps(measure_worker(**json.loads(ns._worker))))
        return 0
    from .config import ConfigError, load_model_configs, resolve_config_path
    try:
        config = str(resolve_config_path(ns.config or "RWKV_CLIP_B32"))
        args = load_model_configs(config)
    except ConfigError as exc:
        ap.error(str(exc))  # one line and exit status 2, no traceback
    # estimate with the autocast rules of the device that will run it: the one measured
    # on, else a GPU (what the planner is for)
    device = ns.device or (_default_device() if ns.measure else "cuda")
    inf_batch = ns.inference_batch if ns.inference_batch is not None else ns.batch_size
    est = estimate(args, ns.batch_size, ns.precision, ns.checkpointing, ns.gradient_acc,
                   ns.gpus, device, Path(config).name, inf_batch)
    out: dict[str, Any] = {"estimate": asdict(est)}
    if ns.measure:
        if ns.gradient_acc != 1 or ns.gpus != 1:
            ap.error("--measure runs one single-process step without accumulation")
        m = measure(config, ns.batch_size if ns.mode == "train" else inf_batch, ns.precision,
                    ns.checkpointing, device, ns.mode, ns.wkv_backend)
        est_b = est.training_peak_bytes if ns.mode == "train" else est.inference_peak_bytes
        m["estimated_peak_bytes"] = est_b
        m["mode"] = ns.mode
        m["ratio_estimate_to_measured"] = est_b / max(1, m["measured_peak_bytes"])
        out["measured"] = m
    if ns.json:
        print(json.dumps(out))
        return 0
    e = est
    print(f"{e.config}: batch {e.batch_size} per GPU (micro-batch {e.micro_batch}), {e.precision}, "
          f"checkpointing {'on' if e.checkpointing else 'off'}, {e.gpus} GPU(s), "
          f"autocast rules of {device}")
    print(f"  parameters        {e.parameters:,}")
    print("training (steady state):")
    for label, b in (("parameters", e.parameter_bytes), ("gradients", e.gradient_bytes),
                     ("optimizer (AdamW)", e.optimizer_bytes), ("DDP buckets", e.ddp_bucket_bytes),
                     ("inputs", e.input_bytes), ("activations", e.activation_bytes),
                     ("workspace", e.workspace_bytes)):
        print(f"  {label:<18}{_fmt(b)}")
    print(f"  {'total (peak)':<18}{_fmt(e.training_peak_bytes)}   at {e.training_peak_phase}")
    print(f"inference (batch {e.inference_batch}, no grad):")
    print(f"  {'parameters':<18}{_fmt(e.parameter_bytes)}")
    print(f"  {'activations':<18}{_fmt(e.inference_activation_bytes)}")
    print(f"  {'total (peak)':<18}{_fmt(e.inference_peak_bytes)}")
    print("largest per-GPU training batch that fits (same precision/checkpointing/acc):")
    for card, b in e.max_batch.items():
        print(f"  {card:<12}{b:>8}")
    print(f"  (card memory x {CARD_USABLE_FRACTION} - {CARD_RESERVE_GIB} GiB for the CUDA "
          "context and fragmentation)")
    if "measured" in out:
        m = out["measured"]
        print(f"measured ({m['mode']}, {device}, {m['method']}): {_fmt(m['measured_peak_bytes'])}"
              f"  estimate {_fmt(m['estimated_peak_bytes'])}  "
              f"estimate/measured {m['ratio_estimate_to_measured']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
