"""The model walker: the parameters the model holds and the tensors autograd saves.

Parameters are read from the model built on the meta device (:func:`parameter_table`), so
the table cannot drift from :mod:`rwkv_clip.model`; activations are walked op by op, in
segments :mod:`.estimate` replays backward over (:func:`activation_segments`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..activation_memory import rebuilds
from ..config import ModelArgs
from ..errors import ConfigError
from ..layers.time_mix import TIME_DECAY_EXTRA_DIM, TIME_MIX_EXTRA_DIM
from .params import _SIZES, ParamTable

# Ops that CUDA autocast runs in fp32 (torch's autocast fp32 lists); CPU autocast only
# forces the loss to fp32 (layer_norm/group_norm/pow stay in the input dtype there).
_FP32_OPS = {"cuda": {"layer_norm", "group_norm", "pow", "norm", "log_softmax", "cross_entropy"},
             "cpu": {"cross_entropy", "log_softmax"}}


def _promote(a: str, b: str) -> str:
    if a == b:
        return a
    return "fp32"  # bf16 x fp16 -> fp32 too


def _cfg(args: Any, name: str, default: Any = None) -> Any:
    return args.get(name, default) if isinstance(args, dict) else getattr(args, name, default)


def _patch_grid(input_size: int, patch_size: int) -> int:
    """Patches per side: the patch embedding pads a partial patch (ceil division)."""
    return -(-input_size // patch_size)


# ----------------------------------------------------------------------------- parameters
def parameter_table(args: Any, finetune: Any = None) -> ParamTable:
    """The parameters of ``create_RWKV_Model(args)``, read from the model built on the meta
    device (shapes and dtypes only: nothing is allocated, the WKV op is not called); with
    ``finetune`` (:class:`.finetune.FineTune`) its frozen names, adapters and dtypes."""
    from ..factory import build_model
    if isinstance(args, dict):
        args = ModelArgs.from_dict(args, source="memory planner config")
    with torch.device("meta"):
        model = build_model(args)
    if finetune is not None:
        from .finetune import finetune_table
        return finetune_table(model, finetune)
    return ParamTable.from_model(model)


# ----------------------------------------------------------------------------- walker
class Sym:
    """A symbolic tensor: element count and dtype. Identity = Python identity; a view
    (``base`` set) is saved as its base's storage, counted once however many views of it
    are saved."""
    __slots__ = ("n", "dtype", "param", "base", "rg", "rebuilt", "__weakref__")

    def __init__(self, n: int, dtype: str, param: bool = False,
                 base: Sym | None = None, rg: bool = True) -> None:
        self.n, self.dtype, self.param, self.base = int(n), dtype, param, base
        self.rg = rg  # requires grad (False: a frozen parameter or what only they made)
        self.rebuilt = False  # recomputed by the backward (rwkv_clip.activation_memory)

    @property
    def nbytes(self) -> int:
        return self.n * _SIZES[self.dtype]

    def split(self, parts: int) -> list[Sym]:
        """``unbind(0)`` of a stacked tensor: ``parts`` views sharing this storage."""
        return [Sym(self.n // parts, self.dtype, self.param, self, self.rg)
                for _ in range(parts)]


class Walker:
    """Walks ops, recording what autograd saves (``saved``) for one segment at a time.

    amp: None (fp32) or "bf16"/"fp16"; device: "cuda" or "cpu" (autocast op lists).
    """

    def __init__(self, amp: str | None, device: str) -> None:
        self.amp, self.device = amp, device
        self.saved: dict[int, Sym] = {}
        self._rebuilt = 0
        self._rebuilt_casts = 0
        self.rebuilding = False  # set per block (rwkv_clip.activation_memory.rebuilds)
        self.policy_off = False  # whole-block checkpointing: no block rebuilds
        self.rebuild = "auto"    # the config key rebuild
        self._branch: tuple[set[int], set[int], int] | None = None  # saved before, kept, casts
        # weight copies autocast makes inside branches under the policy: the graph keeps
        # none of them, so they live until autocast exits, not into the backward
        self.branch_cast_bytes = 0
        self.weight_cast_bytes = 0  # low-precision copies of weights (autocast cache)
        self._casts_taken = 0
        # fine-tuning (rwkv_clip.memory.finetune): whether the parameters being walked
        # train, the dtype of frozen base matrices, and the LoRA-adapted linears
        self.train_params = True
        self.base_dtype: str | None = None
        self.adapted: dict[str, int] = {}   # module name -> rank
        self.lora_dropout = 0.0
        self.prefix = ""                    # module-name prefix of the block being walked

    # bookkeeping
    def new(self, n: int, dtype: str, rg: bool = True) -> Sym:
        return Sym(n, dtype, rg=rg)

    def param(self, numel: int, dtype: str = "fp32", matrix: bool = False) -> Sym:
        """A parameter of the part being walked (``matrix``: a linear/embedding/conv
        weight, stored in ``base_dtype`` when frozen in a LoRA fine-tune)."""
        if matrix and self.base_dtype is not None and not self.train_params:
            dtype = self.base_dtype
        return Sym(numel, dtype, param=True, rg=self.train_params)

    def save(self, *tensors: Sym) -> None:
        for t in tensors:
            t = t.base or t
            if not t.param:
                self.saved[id(t)] = t

    def begin_branch(self, x: Sym) -> None:
        """A residual branch with input ``x`` starts (a norm and its mix,
        :func:`rwkv_clip.activation_memory.residual_branch`). Where the block
        rebuilds (:attr:`rebuilding`), the branch keeps ``x`` and what :meth:`keep` names;
        everything else it saves is recomputed by the backward (:meth:`end_branch`)."""
        if self.rebuilding:
            self._branch = (set(self.saved), set(), self.weight_cast_bytes)
            self.keep(x)

    def keep(self, t: Sym) -> Sym:
        """``t`` is kept for the backward by the branch's policy (the products of the
        kept projections, the WKV's result), whether or not an op saves it."""
        if self._branch is not None and t.rg:  # a frozen branch keeps nothing
            self.save(t)
            self._branch[1].add(id(t.base or t))
        return t

    def end_branch(self) -> int:
        """The branch ends: what it saved and did not keep is recomputed, and so are the
        weight copies autocast made in it. Returns those bytes (alive again while the
        backward of the branch runs; the copies go to :meth:`take_rebuilt`)."""
        if self._branch is None:
            return 0
        before, kept, casts_before = self._branch
        self._branch = None
        recomputed = [t for key, t in self.saved.items() if key not in before and key not in kept]
        for t in recomputed:
            t.rebuilt = True
        casts = self.weight_cast_bytes - casts_before
        self._casts_taken += casts  # not among the segment's held copies
        self._rebuilt_casts += casts
        self.branch_cast_bytes += casts
        return sum(t.nbytes for t in recomputed) + casts

    def take_saved(self) -> int:
        """Bytes saved since the last call (the finished segment) and kept; what the
        backward rebuilds instead goes to :meth:`take_rebuilt`. Resets the record."""
        total = sum(t.nbytes for t in self.saved.values() if not t.rebuilt)
        self._rebuilt = (sum(t.nbytes for t in self.saved.values() if t.rebuilt)
                         + self._rebuilt_casts)
        self._rebuilt_casts = 0
        self.saved = {}
        return total

    def take_rebuilt(self) -> int:
        """Bytes of the last :meth:`take_saved` that the backward rebuilds."""
        total, self._rebuilt = self._rebuilt, 0
        return total

    def take_casts(self) -> int:
        """Bytes of weight copies autocast made since the last call."""
        total = self.weight_cast_bytes - self._casts_taken
        self._casts_taken = self.weight_cast_bytes
        return total

    # casting rules
    def _lowp_in(self, x: Sym) -> Sym:
        if self.amp is None or x.dtype == self.amp:
            return x
        if x.param and x.rg:
            # autocast caches one low-precision copy per weight for the autocast region;
            # counted in weight_cast_bytes (kept apart from `saved`: under checkpointing
            # the cache, not the graph, keeps them alive). Each weight feeds one matmul.
            self.weight_cast_bytes += x.n * _SIZES[self.amp]
            return Sym(x.n, self.amp, param=True)
        # an activation, or a frozen weight (autocast caches only weights that need grad:
        # a fresh copy per use, which the graph saves like an activation)
        return Sym(x.n, self.amp, rg=x.rg)

    def glue(self, x: Sym) -> Sym:
        """``x.to(glue_dtype(x))`` (rwkv_clip.layers.time_mix.glue_dtype): under autocast a
        copy in the autocast dtype (of a parameter too: a fresh tensor, not autocast's weight
        cache); without, x itself. The cast saves nothing."""
        if self.amp is None or x.dtype == self.amp:
            return x
        return Sym(x.n, self.amp, rg=x.rg)

    def _fp32_in(self, op: str, x: Sym) -> Sym:
        if self.amp is not None and op in _FP32_OPS[self.device] and x.dtype != "fp32":
            return Sym(x.n, "fp32", rg=x.rg)
        return x

    def _out_dtype_fp32_op(self, op: str, x: Sym) -> str:
        if self.amp is not None and op in _FP32_OPS[self.device]:
            return "fp32"
        return x.dtype

    # ops (saved tensors follow torch's derivatives.yaml)
    def matmul(self, x: Sym, w: Sym, n_in: int, n_out: int, lora: str | None = None,
               kept: bool = False) -> Sym:
        """linear / x @ W / bmm / conv as a matmul: saves the input when the weight needs
        a gradient and the weight when the input does. ``lora``: the linear's name in
        its block, adapted when :attr:`adapted` lists it. ``kept``: a projection whose
        product a branch keeps (:meth:`keep`; with LoRA, the base product)."""
        xi, wi = self._lowp_in(x), self._lowp_in(w)
        if wi.rg:
            self.save(xi)
        if xi.rg:
            self.save(wi)
        out = self.new(x.n // n_in * n_out, self.amp or _promote(x.dtype, w.dtype),
                       x.rg or w.rg)
        if kept:
            self.keep(out)
        rank = self.adapted.get(self.prefix + lora) if lora else None
        if rank:
            out = self._adapter(x, n_in, n_out, rank, out)
        return out

    def _adapter(self, x: Sym, n_in: int, n_out: int, rank: int, out: Sym) -> Sym:
        """peft's LoRA branch ``out + lora_B(lora_A(dropout(x))) * scaling`` (fp32
        adapters; a product with a Python number saves nothing)."""
        if self.lora_dropout > 0:  # the mask: bool on CUDA (native_dropout), else x * noise
            self.save(Sym(x.n, "bool" if self.device == "cuda" else x.dtype))
            x = self.new(x.n, x.dtype, x.rg)
        a = Sym(n_in * rank, "fp32", param=True)
        b = Sym(rank * n_out, "fp32", param=True)
        u = self.matmul(x, a, n_in, rank)
        self.matmul(u, b, rank, n_out)
        return self.new(out.n, out.dtype)

    def lerp(self, start: Sym, end: Sym, weight: Sym, stacked: int = 1) -> Sym:
        """:func:`rwkv_clip.ops.lerp.lerp`: saves all three whenever one needs a
        gradient. ``stacked``: a weight with a leading (stacked, 1, ...) dimension
        broadcasts start/end (B, T, C) into that many lerps in one (stacked, B, T, C)
        result."""
        if start.rg or end.rg or weight.rg:
            self.save(start, end, weight)
        return self.new(stacked * max(start.n, end.n),
                        _promote(_promote(start.dtype, end.dtype), weight.dtype),
                        start.rg or end.rg or weight.rg)

    def add(self, a: Sym, b: Sym) -> Sym:  # add/sub save nothing
        return self.new(max(a.n, b.n), _promote(a.dtype, b.dtype), a.rg or b.rg)

    def mul(self, a: Sym, b: Sym) -> Sym:  # each saved for the other's gradient
        if b.rg:
            self.save(a)
        if a.rg:
            self.save(b)
        return self.new(max(a.n, b.n), _promote(a.dtype, b.dtype), a.rg or b.rg)

    def unary_saves_result(self, x: Sym) -> Sym:  # tanh, sigmoid, relu
        out = self.new(x.n, x.dtype, x.rg)
        if x.rg:
            self.save(out)
        return out

    def silu(self, x: Sym) -> Sym:  # saves its input
        if x.rg:
            self.save(x)
        return self.new(x.n, x.dtype, x.rg)

    def relu_square(self, x: Sym) -> Sym:
        """rwkv_clip.ops.relu_square: saves relu's result; the square in x's dtype."""
        return self.new(x.n, x.dtype, self.unary_saves_result(x).rg)

    def norm_layer(self, op: str, x: Sym, rows: int) -> Sym:
        """layer_norm / group_norm: saves input, mean and rstd (fp32 per row/group)."""
        xi = self._fp32_in(op, x)
        rg = x.rg or self.train_params
        if rg:
            self.save(xi, Sym(2 * rows, "fp32"))
        return self.new(x.n, self._out_dtype_fp32_op(op, x), rg)


@dataclass
class Segment:
    """A piece of the forward: bytes autograd saves, its parameters' gradient bytes, and
    the extra working memory its backward needs (gradient buffers)."""
    name: str
    saved: int
    grad_bytes: int
    workspace: int
    ckpt_input: int = 0   # bytes a checkpointed block keeps (its input)
    rebuilt: int = 0      # saved bytes the backward rebuilds; kept when checkpointing
    inference_peak: int = 0  # working set of this segment under no_grad
    casts: int = 0        # autocast low-precision weight copies made in this segment


@dataclass
class Plan:
    segments: list[Segment]
    weight_cast_bytes: int
    micro_batch: int
    branch_cast_bytes: int = 0  # of weight_cast_bytes: held by autocast only (the forward)


# ----------------------------------------------------------------------------- towers
def _time_mix(w: Walker, a: Sym, C: int, A: int, H: int, decay_dtype: str,
              amp_grad: str) -> tuple[Sym, int, int]:
    """RWKV-6 time mix (both towers; ``TimeMixBase.projections`` / ``output_projection``);
    returns (output, backward workspace, inference peak)."""
    n = a.n
    na = n // C * A
    P = lambda numel, dt="fp32", matrix=False: w.param(numel, dt, matrix)
    x = w.glue(a)                                        # the glue's dtype (autocast's)
    # shift_lerp's copies implementation: each call shifts x into a copy of its own
    sh = w.new(n, x.dtype, x.rg)
    mix_input = w.lerp(x, sh, w.glue(P(C)))              # lerp(x, shift(x), time_maa_x)
    m1 = w.matmul(mix_input, P(C * 5 * TIME_MIX_EXTRA_DIM), C, 5 * TIME_MIX_EXTRA_DIM)
    t1 = w.unary_saves_result(m1)                        # tanh
    # the lerp weights: one baddbmm, maa (cat of time_maa_w/k/v/r/g) + t1 @ W2, (5,B,T,C)
    mm = w.matmul(t1, P(5 * TIME_MIX_EXTRA_DIM * C), TIME_MIX_EXTRA_DIM, C)
    weight = w.add(mm, w.glue(P(5 * C)))
    sh = w.new(n, x.dtype, x.rg)
    mixed = w.lerp(x, sh, weight, stacked=5)             # one (5, B, T, C) lerp
    xw, xk, xv, xr, xg = mixed.split(5)                  # unbind: views of one storage
    r = w.matmul(xr, P(C * A, matrix=True), C, A, lora="att.receptance", kept=True)
    k = w.matmul(xk, P(C * A, matrix=True), C, A, lora="att.key", kept=True)
    v = w.matmul(xv, P(C * A, matrix=True), C, A, lora="att.value", kept=True)
    g = w.silu(w.matmul(xg, P(C * A, matrix=True), C, A, lora="att.gate", kept=True))
    d1 = w.matmul(xw, P(C * TIME_DECAY_EXTRA_DIM), C, TIME_DECAY_EXTRA_DIM)
    d2 = w.matmul(w.unary_saves_result(d1), P(TIME_DECAY_EXTRA_DIM * A),
                  TIME_DECAY_EXTRA_DIM, A)
    decay = w.add(P(A, decay_dtype), d2)
    # WKV: the native kernels save r, k, v, w as given (bf16/fp16/fp32 read directly)
    wkv_rg = r.rg or k.rg or v.rg or decay.rg
    if wkv_rg:
        w.save(r, k, v, decay)
    y = w.keep(w.new(na, "fp32", wkv_rg))               # the WKV's result: kept
    yn = w.norm_layer("group_norm", y, (na // A) * H)  # mean/rstd per (row, head)
    yg = w.glue(yn)                                      # y.to(g.dtype)
    gated = w.mul(yg, g)
    out = w.matmul(gated, P(A * C, matrix=True), A, C, lora="att.output")
    b = _SIZES
    # backward working set: the stacked lerp's output gradient (the five matmul input
    # gradients stacked by unbind's backward), its weight gradient and one (5,B,T,C)
    # temporary of lerp's backward, the gradients of x and shift(x); WKV backward:
    # gr/gk/gv/gw + gy in fp32 and their casts back to the input dtypes.
    ws_lerp = 15 * n * b[x.dtype] + 2 * n * 4
    ws_wkv = 5 * na * 4 + 3 * na * b[amp_grad]
    # no_grad working set inside the projections: a (held by the caller), its glue copy,
    # the shift and the five lerped inputs, with the lerp weights (5) while the lerp
    # runs, then r, k, v, the gate, its silu and the decay logits in their place.
    inf = (n * b[a.dtype] + (x is not a) * n * b[x.dtype] + 6 * n * b[x.dtype]
           + max(5 * n * b[x.dtype], 6 * na * b[r.dtype]))
    return out, max(ws_lerp, ws_wkv), inf


def _channel_mix(w: Walker, bx: Sym, C: int, Fh: int, image: bool) -> tuple[Sym, int, int]:
    """Channel mix of either tower: both mixes as one (2, B, T, C) lerp (image:
    lerp(shift(x), x, spatial_mix_*); text: lerp(x, shift(x), time_maa_*), same saves)."""
    n = bx.n
    nf = n // C * Fh
    P = lambda numel: w.param(numel, matrix=True)
    x = w.glue(bx)
    sh = w.new(n, x.dtype, x.rg)
    mix = w.glue(w.param(2 * C))                       # cat of the two mix parameters
    mixed = w.lerp(sh, x, mix, 2) if image else w.lerp(x, sh, mix, 2)
    xk, xr = mixed.split(2)
    k2 = w.relu_square(w.matmul(xk, P(C * Fh), C, Fh, lora="ffn.key", kept=True))
    val = w.matmul(k2, P(Fh * C), Fh, C, lora="ffn.value", kept=True)
    rr = w.unary_saves_result(w.matmul(xr, P(C * C), C, C, lora="ffn.receptance",  # sigmoid
                                       kept=True))
    out = w.mul(rr, val)
    b = _SIZES
    # backward: the square's gradient, then relu_square's two passes (one hidden-sized
    # temporary) outside autocast, autograd's pow + relu backward (two) under it
    ws = (2 if w.amp is None else 3) * nf * b[k2.dtype] + 2 * n * 4
    # no_grad: bx (held by the caller), its glue copy, the shift, the two lerped inputs,
    # one C-sized result; the hidden activation, squared in place (relu_square).
    hidden = nf * b[k2.dtype]
    inf = (n * b[bx.dtype] + (x is not bx) * n * b[x.dtype] + 4 * n * b[x.dtype] + hidden)
    return out, ws, inf


def _block(w: Walker, x: Sym, C: int, A: int, H: int, Fh: int, first: bool, image: bool,
           decay_dtype: str, amp_grad: str) -> tuple[Sym, int, int]:
    rows = x.n // C
    inf0 = x.n * _SIZES[x.dtype]
    w.rebuilding = not w.policy_off and rebuilds(x.n, w.rebuild)
    if first:
        x = w.norm_layer("layer_norm", x, rows)           # ln0
    w.begin_branch(x)
    a = w.norm_layer("layer_norm", x, rows)               # ln1
    o, ws1, inf1 = _time_mix(w, a, C, A, H, decay_dtype, amp_grad)
    again1 = w.end_branch()
    x1 = w.add(x, o)
    held = set(w.saved)
    w.begin_branch(x1)
    bx = w.norm_layer("layer_norm", x1, rows)             # ln2
    c, ws2, inf2 = _channel_mix(w, bx, C, Fh, image)
    again2 = w.end_branch()
    x2 = w.add(x1, c)
    # backward runs the channel mix first; by the time mix's backward, the channel mix's
    # saved tensors are freed, so its working set counts above what is left. A branch
    # whose saves are recomputed has them alive again during its backward.
    cmix_saved = sum(t.nbytes for key, t in w.saved.items()
                     if key not in held and not t.rebuilt)
    ws = max(ws2 + again2, ws1 + again1 - cmix_saved) if x2.rg else 0  # frozen: no backward
    return x2, ws, inf0 + max(inf1, inf2 + x1.n * _SIZES[x1.dtype])


def _append(w: Walker, segs: list[Segment], seg: Segment) -> None:
    seg.casts = w.take_casts()
    seg.rebuilt = w.take_rebuilt()
    segs.append(seg)


# Parameter-name prefixes of each segment (the names of rwkv_clip.model's modules).
IMAGE_EMBED = ("image_model.patch_embed", "image_model.pos_embed", "image_model.cls_token")
IMAGE_BLOCK = "image_model.layers.{}."
IMAGE_HEAD = "image_model.ln1"
TEXT_EMBED = "text_model.emb"
TEXT_BLOCK = "text_model.blocks.{}."
TEXT_HEAD = "text_model.ln_out"
LOSS = "logit_scale"


def activation_segments(args: Any, batch: int, amp: str | None, device: str,
                        world_size: int = 1, local_loss: bool = False,
                        loss_batch: int | None = None,
                        params: ParamTable | None = None, checkpointing: bool = False) -> Plan:
    """Forward, segment by segment, for one micro-batch of ``batch`` samples.

    Op by op (the same ops as :mod:`rwkv_clip.image_rwkv`, :mod:`rwkv_clip.text_rwkv` and
    :mod:`rwkv_clip.layers.time_mix`), the tensors autograd saves for backward, in the
    dtype autocast gives them (linear/matmul/bmm/conv in the low precision; layer_norm,
    group_norm, pow and the loss in fp32 on CUDA; plain type promotion elsewhere); a tensor
    saved by several ops is counted once. Segments: embedding, each block, head, loss. The loss
    scores ``loss_batch`` samples per rank (the whole accumulated batch: the training
    loop's exact accumulation caches every micro-batch's features). ``params`` is
    :func:`parameter_table` of ``args`` (built here when not given). Blocks rebuild
    (:func:`rwkv_clip.activation_memory.rebuilds`) unless ``checkpointing``: a
    whole-block checkpoint's own hooks turn the branches' policy off."""
    for bad in ("head_qk", "tiny_att_dim", "pos_emb"):
        if (_cfg(args, bad, 0) or 0) > 0:
            raise ConfigError(f"memory planner: text option {bad}={_cfg(args, bad)} is not "
                              "modelled (expected 0)")
    params = parameter_table(args) if params is None else params
    grads = params.trainable_nbytes
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
    img = Sym(B * 3 * S * S, "fp32", rg=False)            # input: no grad, saved by conv
    w = Walker(amp, device)
    w.policy_off = checkpointing
    w.rebuild = _cfg(args, "rebuild", "auto")
    ft = params.finetune
    if ft is not None:
        from .finetune import configure_walker
        configure_walker(w, ft, params)
    tower = lambda name: ft.set_tower(w, name) if ft is not None else None
    tower("image_model")
    conv = w.matmul(img, w.param(C * 3 * p * p, matrix=True), 3 * p * p, C)
    w.saved.pop(id(img), None)                            # the input itself is not an activation
    x = w.add(conv, w.param(T * C))                       # + pos_embed
    _append(w, segs, Segment("image.embed", w.take_saved(), grads(IMAGE_EMBED),
                             x.n * 4 * 2 if w.train_params else 0,
                             inference_peak=img.nbytes + 2 * x.n * 4))
    image_decay = params.dtype(IMAGE_BLOCK.format(0) + "att.time_decay")
    for i in range(D):
        xin = x
        w.prefix = IMAGE_BLOCK.format(i)
        x, ws, inf = _block(w, x, C, C, _cfg(args, "image_num_heads"), Fh, i == 0, True,
                            image_decay, amp_grad)
        _append(w, segs, Segment(f"image.block{i}", w.take_saved(), grads(IMAGE_BLOCK.format(i)),
                                 ws, ckpt_input=xin.nbytes, inference_peak=inf))
    x = w.norm_layer("layer_norm", x, B * T)              # final ln1, then mean (saves nothing)
    _append(w, segs, Segment("image.head", w.take_saved(), grads(IMAGE_HEAD),
                             2 * x.n * 4 if x.rg else 0,
                             ckpt_input=0, inference_peak=2 * x.n * 4))

    E = _cfg(args, "n_embd")
    A = _cfg(args, "dim_att")
    Fx = _cfg(args, "dim_ffn")
    L = _cfg(args, "n_layer")
    Tt = _cfg(args, "ctx_len")
    tok = Sym(B * Tt, "i64")
    w.save(tok)  # embedding saves its indices (the input tensor: counted as input below)
    w.saved.pop(id(tok))
    tower("text_model")
    x = Sym(B * Tt * E, params.dtype(TEXT_EMBED + ".weight"),  # embedding output
            rg=w.train_params)
    V = _cfg(args, "vocab_size")
    _append(w, segs, Segment("text.emb", w.take_saved(), grads(TEXT_EMBED),
                             V * E * 4 + x.n * 4 if w.train_params else 0,
                             inference_peak=x.nbytes))
    text_decay = params.dtype(TEXT_BLOCK.format(0) + "att.time_decay")
    for i in range(L):
        xin = x
        w.prefix = TEXT_BLOCK.format(i)
        x, ws, inf = _block(w, x, E, A, A // _cfg(args, "head_size"), Fx, i == 0, False,
                            text_decay, amp_grad)
        _append(w, segs, Segment(f"text.block{i}", w.take_saved(), grads(TEXT_BLOCK.format(i)),
                                 ws, ckpt_input=xin.nbytes, inference_peak=inf))
    t = w.norm_layer("layer_norm", x, B * Tt)             # ln_out
    if t.rg:
        w.save(t, Sym(B * Tt, "fp32"))                    # F.normalize: norm saves t, result
    _append(w, segs, Segment("text.head", w.take_saved(), grads(TEXT_HEAD),
                             3 * t.n * 4 if t.rg else 0,
                             inference_peak=3 * t.n * 4))
    # ClipLoss over the gathered batch, in fp32 (the loop casts the features to float):
    # logit matmul(s) + two log_softmax results
    glob = (loss_batch or B) * world_size
    rows = (loss_batch or B) if (local_loss and world_size > 1) else glob
    n_logits = rows * glob
    n_mm = 2 if (world_size == 1 or local_loss) else 1
    loss_saved = n_mm * n_logits * 4 + 2 * n_logits * 4 + 4 * glob * C * 4
    _append(w, segs, Segment("loss", loss_saved, grads(LOSS), 2 * n_logits * 4))
    return Plan(segs, w.weight_cast_bytes, B, w.branch_cast_bytes)
