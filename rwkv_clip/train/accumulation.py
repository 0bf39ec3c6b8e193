"""One optimizer step over K micro-batches (``--gradient-acc K``), and caption choice.

Modes:

* ``exact`` (default, as open_clip's ``--accum-freq``): first run all K micro-batches
  without grad and cache their features; then for each micro-batch j recompute its
  features with grad and compute the contrastive loss of the whole K x m batch, with
  the other micro-batches' cached features in place. Summing the K backward passes
  gives exactly the gradient of one batch of K x m with all its negatives. Two details
  make it exact where open_clip is not: the torch RNG state captured before each
  micro-batch's cached forward is restored before its recompute (same dropout / drop
  path masks), and ``logit_scale`` takes part in only one of the K backward passes
  (otherwise its gradient would count K times).
* ``mean``: loss of each micro-batch on its own, divided by K, backward each (cheaper:
  one forward per micro-batch, but only m negatives per sample).

DDP gradient sync happens only on the last backward (``no_sync`` on the others);
clipping, the optimizer and the scaler step once. The caller steps the schedule.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from ..errors import RWKVCLIPError

CAPTION_LEN = 77
NUM_CAPTIONS = 3


class NonFiniteLossError(RWKVCLIPError, FloatingPointError):
    """The loss became NaN or Inf; raised before the optimizer step."""


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


def choose_captions(tokens: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(B, 3*77) raw|synthetic|generated token ids -> (B, 77), a uniform choice per sample.

    Tokens of shape (B, 77) pass through unchanged (a single caption per sample).
    """
    if tokens.dim() != 2 or tokens.shape[1] % CAPTION_LEN:
        raise ValueError(f"caption tokens must be (B, k*{CAPTION_LEN}), got "
                         f"{tuple(tokens.shape)}")
    variants = tokens.shape[1] // CAPTION_LEN
    if variants == 1:
        return tokens.long()
    choice = torch.randint(0, variants, (tokens.shape[0],), generator=generator)
    index = choice[:, None] * CAPTION_LEN + torch.arange(CAPTION_LEN)[None, :]
    return tokens.gather(1, index.to(tokens.device)).long()


def make_micro_batches(images: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor],
                       generator: torch.Generator | None,
                       device: torch.device) -> list[MicroBatch]:
    """Choose captions for all samples of one optimizer step at once (before any
    caching), then move each micro-batch to ``device``."""
    sizes = [t.shape[0] for t in tokens]
    texts = choose_captions(torch.cat(list(tokens)), generator).split(sizes)
    return [MicroBatch(im.to(device, non_blocking=True), tx.to(device, non_blocking=True))
            for im, tx in zip(images, texts)]


# ----------------------------------------------------------------------------- RNG states

def get_rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


# ----------------------------------------------------------------------------- the step

@dataclass
class StepResult:
    loss: float                 # the K*m-batch loss (exact) or mean micro-batch loss (mean)
    grad_norm: float | None     # total gradient norm before clipping (None: no clipping)
    logit_scale: float          # exp(logit_scale) used in the forward
    samples: int                # samples in this step on this rank


def _features(model: nn.Module, mb: MicroBatch, autocast: Callable):
    with autocast():
        image_features, text_features, logit_scale = model(mb.images, mb.texts)
        image_features = F.normalize(image_features, dim=-1)
        text_features = F.normalize(text_features, dim=-1)
    # the contrastive loss is computed in float32 whatever the autocast dtype
    return image_features.float(), text_features.float(), logit_scale.float()


def _backward(loss: torch.Tensor, scaler) -> None:
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def train_step(model: nn.Module, micro_batches: Sequence[MicroBatch], loss_fn: nn.Module,
               optimizer: torch.optim.Optimizer, *, scaler=None,
               autocast: Callable = contextlib.nullcontext, mode: str = "exact",
               clip_grad_norm: float | None = 1.0,
               all_ranks_finite: Callable[[bool], bool] = lambda ok: ok) -> StepResult:
    """Forward/backward over K micro-batches, then clip + one optimizer (scaler) step and
    the logit-scale clamp to [0, ln 100].

    ``model`` may be DDP-wrapped. ``all_ranks_finite(ok)`` must return False on every
    rank when any rank's loss is not finite (identity for a single process); then
    :class:`NonFiniteLossError` is raised before the parameters change.
    """
    if mode not in ("exact", "mean"):
        raise ValueError(f"unknown accumulation mode {mode!r}: expected exact or mean")
    k = len(micro_batches)
    if k < 1:
        raise ValueError("train_step needs at least one micro-batch")
    inner = unwrap(model)
    device = micro_batches[0].images.device
    is_ddp = model is not inner and hasattr(model, "no_sync")
    optimizer.zero_grad(set_to_none=True)

    losses: list[torch.Tensor] = []
    scale_value = None
    if mode == "exact" and k > 1:
        cached_image, cached_text, rng_states = [], [], []
        with torch.no_grad():
            for mb in micro_batches:
                rng_states.append(get_rng_state(device))
                image_f, text_f, _ = _features(inner, mb, autocast)
                cached_image.append(image_f)
                cached_text.append(text_f)
        for j, mb in enumerate(micro_batches):
            last = j == k - 1
            sync = contextlib.nullcontext() if (last or not is_ddp) else model.no_sync()
            with sync:
                set_rng_state(rng_states[j], device)
                image_f, text_f, logit_scale = _features(model, mb, autocast)
                if not last:  # logit_scale's gradient must be counted once, not K times
                    logit_scale = logit_scale.detach()
                all_image = torch.cat(cached_image[:j] + [image_f] + cached_image[j + 1:])
                all_text = torch.cat(cached_text[:j] + [text_f] + cached_text[j + 1:])
                loss = loss_fn(all_image, all_text, logit_scale)
                _backward(loss, scaler)
            losses.append(loss.detach())
            scale_value = logit_scale.detach()
        step_loss = losses[-1]
    else:
        for j, mb in enumerate(micro_batches):
            last = j == k - 1
            sync = contextlib.nullcontext() if (last or not is_ddp) else model.no_sync()
            with sync:
                image_f, text_f, logit_scale = _features(model, mb, autocast)
                loss = loss_fn(image_f, text_f, logit_scale)
                _backward(loss / k if k > 1 else loss, scaler)
            losses.append(loss.detach())
            scale_value = logit_scale.detach()
        step_loss = torch.stack(losses).mean()

    loss_value = float(step_loss)
    finite = all(math.isfinite(float(l)) for l in losses)
    if not all_ranks_finite(finite):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(
            f"loss is not finite ({loss_value}) on {'this rank' if not finite else 'another rank'}")

    params = [p for p in inner.parameters() if p.requires_grad]
    grad_norm = None
    if scaler is not None:
        scaler.unscale_(optimizer)
    if clip_grad_norm is not None and clip_grad_norm > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip_grad_norm))
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    with torch.no_grad():
        inner.logit_scale.clamp_(0, math.log(100))
    return StepResult(loss=loss_value, grad_norm=grad_norm, logit_scale=float(scale_value),
                      samples=sum(mb.images.shape[0] for mb in micro_batches))
