"""Contrastive loss with cross-rank feature gathering (the original's / open_clip's ClipLoss).

``local_loss``: each rank scores only its own samples against all gathered features
(cheaper; labels offset by rank). ``gather_with_grad``: gradients flow through the
all-gather, giving the exact full-batch gradient; without it, the local slice of the
gathered tensors is replaced by the rank's own (grad-carrying) features.
"""
from __future__ import annotations

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
    """Symmetric InfoNCE over L2-normalised features: (CE(img->txt) + CE(txt->img)) / 2."""

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
