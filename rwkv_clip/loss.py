"""Contrastive losses across ranks: CLIP's softmax loss (the original's / open_clip's
ClipLoss) and SigLIP's pairwise sigmoid loss (open_clip's SigLipLoss).

Both score each rank's samples against every rank's; how gradients cross ranks is at
:class:`ClipLoss` and :class:`SigLipLoss`.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def gather_features(image_features: torch.Tensor, text_features: torch.Tensor,
                    local_loss: bool = False, gather_with_grad: bool = False,
                    rank: int = 0, world_size: int = 1):
    """All-gather (B, C) features from every rank into (world_size * B, C)."""
    if gather_with_grad:
        import torch.distributed.nn as dist_nn  # autograd-aware collectives
        return (torch.cat(dist_nn.all_gather(image_features), dim=0),
                torch.cat(dist_nn.all_gather(text_features), dim=0))
    gathered_image = [torch.zeros_like(image_features) for _ in range(world_size)]
    gathered_text = [torch.zeros_like(text_features) for _ in range(world_size)]
    dist.all_gather(gathered_image, image_features.contiguous())
    dist.all_gather(gathered_text, text_features.contiguous())
    if not local_loss:
        # all_gather returns tensors without grad: put the local, grad-carrying ones back
        gathered_image[rank] = image_features
        gathered_text[rank] = text_features
    return torch.cat(gathered_image, dim=0), torch.cat(gathered_text, dim=0)


class ClipLoss(nn.Module):
    """Symmetric InfoNCE over L2-normalised features: (CE(img->txt) + CE(txt->img)) / 2.

    ``local_loss``: each rank scores only its own samples against all gathered features
    (cheaper; labels offset by rank). ``gather_with_grad``: gradients flow through the
    all-gather, giving the exact full-batch gradient; without it, the local slice of the
    gathered tensors is replaced by the rank's own (grad-carrying) features.
    """

    def __init__(self, local_loss: bool = False, gather_with_grad: bool = False,
                 cache_labels: bool = False, rank: int = 0, world_size: int = 1,
                 use_horovod: bool = False) -> None:
        super().__init__()
        if use_horovod:
            raise ValueError("horovod is not supported; use torchrun (NCCL on GPU, gloo on CPU)")
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.cache_labels = cache_labels
        self.rank = rank
        self.world_size = world_size
        self._labels: dict[tuple, torch.Tensor] = {}

    def get_ground_truth(self, device: torch.device, num_logits: int) -> torch.Tensor:
        key = (device, num_logits)
        if key in self._labels:
            return self._labels[key]
        labels = torch.arange(num_logits, device=device, dtype=torch.long)
        if self.world_size > 1 and self.local_loss:
            labels = labels + num_logits * self.rank
        if self.cache_labels:
            self._labels[key] = labels
        return labels

    def get_logits(self, image_features, text_features, logit_scale):
        if self.world_size > 1:
            all_image, all_text = gather_features(image_features, text_features,
                                                  self.local_loss, self.gather_with_grad,
                                                  self.rank, self.world_size)
            if self.local_loss:
                return (logit_scale * image_features @ all_text.T,
                        logit_scale * text_features @ all_image.T)
            logits_per_image = logit_scale * all_image @ all_text.T
            return logits_per_image, logits_per_image.T
        return (logit_scale * image_features @ text_features.T,
                logit_scale * text_features @ image_features.T)

    def forward(self, image_features, text_features, logit_scale, output_dict: bool = False):
        logits_per_image, logits_per_text = self.get_logits(image_features, text_features,
                                                            logit_scale)
        labels = self.get_ground_truth(image_features.device, logits_per_image.shape[0])
        loss = (F.cross_entropy(logits_per_image, labels)
                + F.cross_entropy(logits_per_text, labels)) / 2
        return {"contrastive_loss": loss} if output_dict else loss


# ----------------------------------------------------------------------------- SigLIP

def _send_receive(group, routes, tensors) -> list[torch.Tensor]:
    """Send ``tensors[i]`` to ``routes[i][0]`` and receive a tensor of its shape from
    ``routes[i][1]``, all point-to-point operations in one batch."""
    ops, received = [], []
    for tensor, (to_rank, from_rank) in zip(tensors, routes, strict=True):
        tensor = tensor.contiguous()
        buffer = torch.empty_like(tensor)
        ops.append(dist.P2POp(dist.isend, tensor, to_rank, group=group))
        ops.append(dist.P2POp(dist.irecv, buffer, from_rank, group=group))
        received.append(buffer)
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class NeighbourExchange(torch.autograd.Function):
    """:func:`_send_receive` with gradients: the gradient of a received tensor goes back
    to the rank it came from, and the one of a sent tensor comes from where it went."""

    @staticmethod
    def forward(ctx, group, routes, *tensors):
        ctx.group, ctx.routes = group, routes
        return tuple(_send_receive(group, routes, tensors))

    @staticmethod
    def backward(ctx, *grads):
        back = tuple((from_rank, to_rank) for to_rank, from_rank in ctx.routes)
        return (None, None, *NeighbourExchange.apply(ctx.group, back, *grads))


def neighbour_exchange(routes, *tensors, group=None) -> tuple[torch.Tensor, ...]:
    """Autograd-aware point-to-point exchange: ``routes[i] = (to_rank, from_rank)``."""
    return NeighbourExchange.apply(group, tuple(routes), *tensors)


class SigLipLoss(nn.Module):
    """Pairwise sigmoid loss (Zhai et al., 2023), as open_clip's ``SigLipLoss``.

    ``logits = logit_scale * image @ text.T + logit_bias``; labels are +1 for an image and
    its own caption, -1 for every other pair; the loss is
    ``-sum(logsigmoid(labels * logits)) / local_batch`` over the rank's images against the
    texts of all ranks. The rank's own block comes first, then the other ranks' text
    blocks (negatives only), which arrive with gradients attached:

    * ``bidir``: neighbour exchange around the ring in both directions, so a rank holds
      one or two received blocks at a time and ``(world_size - 1) / 2`` rounds suffice;
    * ``gather``: one all-gather of the text features.

    Both give the same numbers. Summed over ranks, the losses are ``world_size`` times the
    one-process loss over the global batch, so the rank-mean of the loss (and DDP's
    gradient average) is exactly the global-batch loss (and its gradient).
    """

    DIST_IMPLS = ("bidir", "gather")

    def __init__(self, cache_labels: bool = False, rank: int = 0, world_size: int = 1,
                 dist_impl: str = "bidir") -> None:
        super().__init__()
        if dist_impl not in self.DIST_IMPLS:
            raise ValueError(f"unknown SigLIP dist_impl {dist_impl!r}: expected one of "
                             f"{', '.join(self.DIST_IMPLS)}")
        self.cache_labels = cache_labels
        self.rank = rank
        self.world_size = world_size
        self.dist_impl = dist_impl
        self._labels: dict[tuple, torch.Tensor] = {}

    def get_ground_truth(self, device: torch.device, dtype: torch.dtype, num_logits: int,
                         negative_only: bool = False) -> torch.Tensor:
        """(n, n) labels: -1 everywhere, +1 on the diagonal unless ``negative_only``."""
        key = (device, dtype, num_logits, negative_only)
        if key in self._labels:
            return self._labels[key]
        labels = -torch.ones((num_logits, num_logits), device=device, dtype=dtype)
        if not negative_only:
            labels.diagonal().fill_(1)
        if self.cache_labels:
            self._labels[key] = labels
        return labels

    def get_logits(self, image_features, text_features, logit_scale, logit_bias=None):
        logits = logit_scale * image_features @ text_features.T
        return logits if logit_bias is None else logits + logit_bias

    def _loss(self, image_features, text_features, logit_scale, logit_bias=None,
              negative_only: bool = False) -> torch.Tensor:
        logits = self.get_logits(image_features, text_features, logit_scale, logit_bias)
        labels = self.get_ground_truth(image_features.device, image_features.dtype,
                                       image_features.shape[0], negative_only)
        return -F.logsigmoid(labels * logits).sum() / image_features.shape[0]

    def other_texts(self, text_features: torch.Tensor) -> Iterator[torch.Tensor]:
        """The text features of every other rank, one block at a time."""
        if self.dist_impl == "gather":
            import torch.distributed.nn as dist_nn  # autograd-aware collectives
            gathered = dist_nn.all_gather(text_features)
            yield from (t for i, t in enumerate(gathered) if i != self.rank)
            return
        right = (self.rank + 1) % self.world_size
        left = (self.rank - 1) % self.world_size
        to_left = to_right = text_features
        rounds, one_more = divmod(self.world_size - 1, 2)
        for _ in range(rounds):  # round i: the blocks of the ranks i + 1 to each side
            from_right, from_left = neighbour_exchange(((left, right), (right, left)),
                                                       to_left, to_right)
            yield from_right
            yield from_left
            to_left, to_right = from_right, from_left
        if one_more:  # an even world size: the rank opposite, passed on from the left
            yield neighbour_exchange(((right, left),), to_right)[0]

    def forward(self, image_features, text_features, logit_scale, logit_bias=None,
                output_dict: bool = False):
        loss = self._loss(image_features, text_features, logit_scale, logit_bias)
        if self.world_size > 1:
            for text in self.other_texts(text_features):
                loss = loss + self._loss(image_features, text, logit_scale, logit_bias,
                                         negative_only=True)
        return {"contrastive_loss": loss} if output_dict else loss
