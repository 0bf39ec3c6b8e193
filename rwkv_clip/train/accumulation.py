"""One optimizer step over K micro-batches (``--gradient-acc K``), and caption choice.

``exact`` mode (open_clip's ``--accum-freq``) gives exactly the gradient of one batch of
K x m with all its negatives; ``mean`` mode averages K micro-batch losses. :func:`train_step`
is the one step the trainer, the memory planner and the benchmarks run.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint_files import unwrap_model
from ..distributed import DistInfo, any_rank_true
from ..errors import NonFiniteLossError
from ..tokenizer import fit_context_length
from .rng import capture_rng, restore_rng

CAPTION_LEN = 77
NUM_CAPTIONS = 3


# ----------------------------------------------------------------------------- captions

@dataclass
class MicroBatch:
    images: torch.Tensor  # (m, 3, S, S) on the training device
    texts: torch.Tensor   # (m, ctx_len) chosen captions, int64, on the training device


def caption_generator(seed: int, rank: int, epoch: int, index: int) -> torch.Generator:
    """A CPU generator fixed by (seed, rank, epoch, optimizer step in the epoch): drawn
    once for all K x m samples of a step, so a sample's caption does not depend on how
    the step is split into micro-batches, on workers or on interruptions."""
    state = np.random.SeedSequence([seed, rank, epoch, index]).generate_state(2)
    g = torch.Generator()
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g


def caption_length(width: int, ctx_len: int) -> int:
    """Tokens per caption in a batch row of ``width`` token ids: the loaders hand on k
    captions of the model's ``ctx_len``; token batches made elsewhere may hold the
    original's k x 77."""
    return ctx_len if width % ctx_len == 0 and width // ctx_len <= NUM_CAPTIONS else CAPTION_LEN


def choose_captions(tokens: torch.Tensor, generator: torch.Generator | None,
                    weights: Sequence[float] | None = None,
                    caption_len: int = CAPTION_LEN) -> torch.Tensor:
    """(B, 3 L) raw|synthetic|generated token ids -> (B, L), one caption per sample
    (L = ``caption_len``, 77 in the original's data).

    ``weights`` (raw, synthetic, generated; ``--caption-weights``): the relative
    probability of each variant. Equal weights (the default, the original's uniform
    draw) draw with ``randint``; others with ``multinomial``, from the same generator.
    Tokens of shape (B, L) pass through unchanged (a single caption per sample).
    """
    if tokens.dim() != 2 or tokens.shape[1] % caption_len:
        raise ValueError(f"caption tokens must be (B, k*{caption_len}), got "
                         f"{tuple(tokens.shape)}")
    variants = tokens.shape[1] // caption_len
    if variants == 1:
        return tokens.long()
    w = [1.0] * variants if weights is None else [float(x) for x in weights[:variants]]
    if len(w) < variants or min(w) < 0 or sum(w) <= 0:
        raise ValueError(f"caption weights {list(weights or [])} do not fit {variants} "
                         "caption variants: expected a non-negative weight for each, not "
                         "all zero")
    if all(x == w[0] for x in w):
        choice = torch.randint(0, variants, (tokens.shape[0],), generator=generator)
    else:
        choice = torch.multinomial(torch.tensor(w, dtype=torch.float64), tokens.shape[0],
                                   replacement=True, generator=generator)
    index = choice[:, None] * caption_len + torch.arange(caption_len)[None, :]
    return tokens.gather(1, index.to(tokens.device)).long()


def make_micro_batches(images: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor],
                       generator: torch.Generator | None,
                       device: torch.device, ctx_len: int = CAPTION_LEN,
                       caption_weights: Sequence[float] | None = None) -> list[MicroBatch]:
    """Choose captions for all samples of one optimizer step at once (before any
    caching; ``caption_weights`` as :func:`choose_captions`), fit them to the model's
    ``ctx_len``, then move each micro-batch to ``device``."""
    sizes = [t.shape[0] for t in tokens]
    every = torch.cat(list(tokens))
    chosen = fit_context_length(choose_captions(
        every, generator, caption_weights, caption_length(every.shape[1], ctx_len)), ctx_len)
    texts = chosen.split(sizes)
    return [MicroBatch(im.to(device, non_blocking=True), tx.to(device, non_blocking=True))
            for im, tx in zip(images, texts, strict=True)]


# ----------------------------------------------------------------------------- the step

def _features(model: nn.Module, mb: MicroBatch, autocast: Callable):
    """(image, text features, logit_scale.exp(), logit_bias or None), in float32."""
    with autocast():
        image_features, text_features, logit_scale, *bias = model(mb.images, mb.texts)
        image_features = F.normalize(image_features, dim=-1)
        text_features = F.normalize(text_features, dim=-1)
    # the contrastive loss is computed in float32 whatever the autocast dtype
    return (image_features.float(), text_features.float(), logit_scale.float(),
            bias[0].float() if bias else None)


def _head(logit_scale: torch.Tensor, logit_bias: torch.Tensor | None) -> tuple:
    """The loss's trailing arguments: ``(scale,)`` for CLIP, ``(scale, bias)`` for SigLIP."""
    return (logit_scale,) if logit_bias is None else (logit_scale, logit_bias)


class MicroBatchLosses:
    """The K micro-batches of one optimizer step and the loss each one backpropagates.

    Built before the first backward: in ``exact`` mode (K > 1) it runs the K cached
    forwards here, without grad. ``loss(model, j)`` then runs micro-batch j's forward
    with grad (``model`` may be the DDP wrapper, so the caller decides about gradient
    sync) and returns the tensor to call ``backward`` on, before asking for j + 1.

    Exact mode recomputes micro-batch j with grad and computes the loss of the whole
    K x m batch with the other micro-batches' cached features in place, so the K
    backward passes sum to the gradient of one K x m batch. Two details make it exact
    where open_clip is not: the RNG state captured before each cached forward is
    restored before its recompute (same dropout and drop-path masks), and the logit
    scale (and SigLIP's bias) takes part in one backward pass only.
    """

    def __init__(self, model: nn.Module, micro_batches: Sequence[MicroBatch],
                 loss_fn: nn.Module, autocast: Callable = contextlib.nullcontext,
                 mode: str = "exact") -> None:
        if mode not in ("exact", "mean"):
            raise ValueError(f"unknown accumulation mode {mode!r}: expected exact or mean")
        if not micro_batches:
            raise ValueError("an optimizer step needs at least one micro-batch")
        self.micro_batches, self.loss_fn, self.autocast = micro_batches, loss_fn, autocast
        self.k = len(micro_batches)
        self.exact = mode == "exact" and self.k > 1
        self.samples = sum(mb.images.shape[0] for mb in micro_batches)
        self.losses: list[torch.Tensor] = []
        self.logit_scale: float = float("nan")
        self.logit_bias: float | None = None  # SigLIP models only
        if self.exact:
            self._cache(unwrap_model(model))

    def _cache(self, inner: nn.Module) -> None:
        device = self.micro_batches[0].images.device
        self.image, self.text, self.rng = [], [], []
        with torch.no_grad():
            for mb in self.micro_batches:
                self.rng.append(capture_rng(device, host=False))
                image_f, text_f, _, _ = _features(inner, mb, self.autocast)
                self.image.append(image_f)
                self.text.append(text_f)

    def loss(self, model: nn.Module, j: int) -> torch.Tensor:
        mb = self.micro_batches[j]
        if self.exact:
            restore_rng(self.rng[j], mb.images.device)  # the cached pass's dropout masks
        image_f, text_f, logit_scale, logit_bias = _features(model, mb, self.autocast)
        self.logit_scale = float(logit_scale.detach())
        if logit_bias is not None:
            self.logit_bias = float(logit_bias.detach())
        if not self.exact:
            loss = self.loss_fn(image_f, text_f, *_head(logit_scale, logit_bias))
            self.losses.append(loss.detach())
            return loss / self.k if self.k > 1 else loss
        if j < self.k - 1:  # scale's (and bias') gradient must count once, not K times
            logit_scale = logit_scale.detach()
            logit_bias = None if logit_bias is None else logit_bias.detach()
        all_image = torch.cat(self.image[:j] + [image_f] + self.image[j + 1:])
        all_text = torch.cat(self.text[:j] + [text_f] + self.text[j + 1:])
        loss = self.loss_fn(all_image, all_text, *_head(logit_scale, logit_bias))
        self.losses.append(loss.detach())
        return loss

    @property
    def value(self) -> float:
        """The step's loss: of the whole K x m batch (exact), or the mean of the K
        micro-batch losses (mean)."""
        return float(self.losses[-1] if self.exact else torch.stack(self.losses).mean())

    @property
    def finite(self) -> bool:
        return all(math.isfinite(float(loss)) for loss in self.losses)


@dataclass
class StepResult:
    loss: float                 # the K*m-batch loss (exact) or mean micro-batch loss (mean)
    grad_norm: float | None     # total gradient norm before clipping (None: no clipping)
    logit_scale: float          # exp(logit_scale) used in the forward
    samples: int                # samples in this step on this rank
    logit_bias: float | None = None  # SigLIP's logit_bias used in the forward


def clamp_logit_scale(model: nn.Module) -> None:
    """CLIP's temperature bound: exp(logit_scale) stays within [1, 100]."""
    with torch.no_grad():
        cast(torch.Tensor, unwrap_model(model).logit_scale).clamp_(0, math.log(100))


def train_step(model: nn.Module, micro_batches: Sequence[MicroBatch], loss_fn: nn.Module,
               optimizer: torch.optim.Optimizer, *, scaler=None,
               autocast: Callable = contextlib.nullcontext, mode: str = "exact",
               clip_grad_norm: float | None = 1.0, wrapped: Callable | None = None,
               info: DistInfo | None = None) -> StepResult:
    """One optimizer step over K micro-batches: K forward and backward passes, the
    finite-loss check, unscale, clip, optimizer (scaler) step, gradients cleared,
    logit-scale clamp.

    ``model`` is the plain model; ``wrapped`` (default ``model``) is what runs the
    forward passes: DDP and/or torch.compile around it. DDP all-reduces the gradients on
    the last micro-batch only. Under a process group (``info``) every rank stops when any
    rank's loss is not finite. Raises :class:`NonFiniteLossError` before the parameters
    change."""
    runner: Any = model if wrapped is None else wrapped
    ddp = hasattr(runner, "require_backward_grad_sync")
    micro = MicroBatchLosses(model, micro_batches, loss_fn, autocast, mode)
    for j in range(micro.k):
        if ddp:
            runner.require_backward_grad_sync = j == micro.k - 1
        loss = micro.loss(runner, j)
        (scaler.scale(loss) if scaler is not None else loss).backward()
    finite = micro.finite
    if any_rank_true(not finite, info) if info is not None else not finite:
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(f"loss is not finite ({micro.value}) on "
                                 f"{'another rank' if finite else 'this rank'}. Parameters "
                                 "were not updated")
    grad_norm = unscale_and_clip(model, optimizer, scaler, clip_grad_norm)
    optimizer_step(optimizer, scaler)
    optimizer.zero_grad(set_to_none=True)
    clamp_logit_scale(model)
    return StepResult(loss=micro.value, grad_norm=grad_norm, logit_scale=micro.logit_scale,
                      samples=micro.samples, logit_bias=micro.logit_bias)


def unscale_and_clip(model: nn.Module, optimizer: torch.optim.Optimizer, scaler,
                     max_norm: float | None) -> float | None:
    """Unscale fp16 gradients, clip the global norm (``max_norm`` <= 0 or None: off);
    returns the norm before clipping, or None."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    if max_norm is None or max_norm <= 0:
        return None
    params = [p for p in unwrap_model(model).parameters() if p.requires_grad]
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def optimizer_step(optimizer: torch.optim.Optimizer, scaler) -> None:
    if scaler is not None:
        scaler.step(optimizer)  # skipped by the scaler when fp16 gradients overflowed
        scaler.update()
    else:
        optimizer.step()
