"""The estimate: peak bytes of a training step or of inference, and the card table.

Backward is replayed segment by segment (:mod:`.walk`) in autograd's order; the model and
its conventions are at :func:`training_peak`. Nothing is fitted to a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..precision import autocast_dtype, canonical_precision
from .params import DTYPE_NAMES, ParamTable
from .walk import _cfg, activation_segments, parameter_table

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


def amp_dtype(precision: str) -> str | None:
    """The walker's name of ``precision``'s autocast dtype ("bf16", "fp16"; None: none)."""
    dtype = autocast_dtype(precision)
    return None if dtype is None else DTYPE_NAMES[dtype]


def _input_bytes(args: Any, batch: int) -> int:
    S = _cfg(args, "input_size")
    return batch * 3 * S * S * 4 + batch * _cfg(args, "ctx_len") * 8


def training_peak(args: Any, batch: int, precision: str, checkpointing: bool = False,
                  gradient_acc: int = 1, gpus: int = 1, device: str = "cuda",
                  local_loss: bool = False, params: ParamTable | None = None) -> dict:
    """Peak bytes of one steady-state training step and its parts. ``params`` is
    :func:`~.walk.parameter_table` of ``args`` (built here when not given).

    Backward is replayed segment by segment in the order autograd runs it (text tower
    first, it was built last): saved activations of not-yet-processed segments + gradients
    produced so far + the working set of the segment being differentiated.

    ``batch`` is per GPU; with ``gradient_acc`` K each micro-batch has batch/K samples, the
    gradients stay alive across micro-batches and the loss still scores the whole batch;
    the loss is in fp32; ``gpus`` N makes the ClipLoss logits (N*B) x (N*B) (no
    ``local_loss``) and adds DDP's gradient buckets (one more copy of the gradients).
    Steady state is assumed (AdamW moments already exist, gradients set to None between
    steps). The optimizer is the trainer's fused AdamW: two moments per parameter in the
    parameter's dtype, updated in place (no parameter-sized temporaries on CPU or CUDA,
    nor in the foreach gradient clipping).
    """
    amp = amp_dtype(precision)
    table = parameter_table(args) if params is None else params
    pbytes = table.nbytes()
    grad_b = table.trainable_nbytes()  # all of them unless a fine-tune froze some
    opt_b = 2 * grad_b
    ddp_b = grad_b if gpus > 1 else 0
    micro = max(1, batch // max(1, gradient_acc))
    plan = activation_segments(args, micro, amp, device, gpus, local_loss, loss_batch=batch,
                               params=table, checkpointing=checkpointing)
    inputs = _input_bytes(args, batch)
    persistent = pbytes + opt_b + ddp_b + inputs
    grads_alive = grad_b if gradient_acc > 1 else 0   # later micro-batches: grads exist
    segs = plan.segments
    best = (0, "", 0, 0)  # total, phase, activations, workspace
    produced = 0
    if not checkpointing:
        held = sum(s.saved + s.casts for s in segs) + plan.branch_cast_bytes
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
        fwd += sum(s.casts for s in segs) + plan.branch_cast_bytes
        fwd += max(s.inference_peak for s in segs if s.ckpt_input)
        best = max(best, (persistent + grads_alive + fwd, "forward", fwd, 0))
        for i in range(len(segs) - 1, -1, -1):
            s = segs[i]
            acts = sum(x.ckpt_input if x.ckpt_input else x.saved + x.casts for x in segs[:i + 1])
            if s.ckpt_input:   # this block is recomputed (nothing rebuilt under checkpointing)
                acts += s.saved + s.rebuilt + s.casts
            total = persistent + max(grads_alive, produced) + acts + s.workspace
            phase = f"backward of {s.name}" + (" (recomputed)" if s.ckpt_input else "")
            best = max(best, (total, phase, acts, s.workspace))
            produced += s.grad_bytes
    # optimizer step: all gradients (fused AdamW and the clipping work in place)
    opt_tmp = 0
    opt_total = persistent + grad_b + opt_tmp
    best = max(best, (opt_total, "optimizer step", 0, opt_tmp))
    total, phase, acts, ws = best
    return dict(parameter_bytes=pbytes, gradient_bytes=grad_b, optimizer_bytes=opt_b,
                ddp_bucket_bytes=ddp_b, input_bytes=inputs, activation_bytes=acts,
                workspace_bytes=ws, training_peak_bytes=total, training_peak_phase=phase,
                micro_batch=micro, parameters=table.count())


def inference_peak(args: Any, batch: int, precision: str, device: str = "cuda",
                   params: ParamTable | None = None) -> dict:
    """model.eval() under torch.no_grad: parameters + inputs + the largest per-layer set."""
    table = parameter_table(args) if params is None else params
    plan = activation_segments(args, batch, amp_dtype(precision), device, params=table)
    acts = max(s.inference_peak for s in plan.segments) + plan.weight_cast_bytes
    total = table.nbytes() + _input_bytes(args, batch) + acts
    return dict(inference_activation_bytes=acts, inference_peak_bytes=total)


def card_capacity(total_gib: float) -> int:
    return int((total_gib * CARD_USABLE_FRACTION - CARD_RESERVE_GIB) * GiB)


def max_batch(args: Any, capacity: int, precision: str, checkpointing: bool,
              gradient_acc: int, gpus: int, device: str = "cuda",
              params: ParamTable | None = None) -> int:
    """Largest per-GPU batch (a multiple of gradient_acc) whose training peak fits."""
    table = parameter_table(args) if params is None else params

    def fits(b: int) -> bool:
        return training_peak(args, b, precision, checkpointing, gradient_acc, gpus,
                             device, params=table)["training_peak_bytes"] <= capacity
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
             cards: bool = True, finetune: Any = None) -> Estimate:
    """Training and inference peaks for one setting, and (``cards``) the largest batch per
    card of :data:`CARDS` (CUDA autocast rules). ``finetune``: a
    :class:`.finetune.FineTune` (None: every parameter trains)."""
    precision = canonical_precision(precision)
    table = parameter_table(args, finetune)  # one meta-device build for every figure below
    tr = training_peak(args, batch, precision, checkpointing, gradient_acc, gpus, device,
                       params=table)
    ib = batch if inference_batch is None else inference_batch
    inf = inference_peak(args, ib, precision, device, params=table)
    fit = {}
    if cards:
        for card, gib in CARDS.items():
            fit[card] = max_batch(args, card_capacity(gib), precision, checkpointing,
                                  gradient_acc, gpus, "cuda", params=table)
    return Estimate(config=config_name, batch_size=batch, precision=precision,
                    checkpointing=checkpointing, gradient_acc=gradient_acc, gpus=gpus,
                    device=device, inference_batch=ib, max_batch=fit, **tr, **inf)
