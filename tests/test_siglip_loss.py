"""SigLipLoss: equal to open_clip's on one process; across gloo ranks (bidir and gather),
the rank-mean loss and DDP's averaged gradients equal the one-process global batch.

Why no rescaling is needed under DDP: each rank's loss is
``-sum(logsigmoid(labels * logits)) / local_batch`` over its images against every rank's
texts, so the ranks' losses sum to ``world_size`` times the global-batch loss (which
divides by the global batch). Gradients flow back through the exchange to the rank that
owns each text feature, so the ranks' parameter gradients also sum to ``world_size``
times the global gradient, and DDP's mean over ranks is exactly the global gradient
(``logit_scale`` and ``logit_bias`` included).
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from rwkv_clip.loss import SigLipLoss

IMPLS = ("bidir", "gather")
PER_RANK, D_IN, D = 3, 6, 5


def test_equals_open_clip_value_and_gradients():
    from open_clip.loss import SigLipLoss as OpenClipSigLipLoss

    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 64):
        image = F.normalize(torch.randn(n, 32, generator=g), dim=-1)
        text = F.normalize(torch.randn(n, 32, generator=g), dim=-1)
        text[: n // 2] = F.normalize(image[: n // 2] + 0.3 * text[: n // 2], dim=-1)  # some matches
        scale, bias = torch.tensor(10.0), torch.tensor(-10.0)
        results = []
        for loss_fn in (OpenClipSigLipLoss(), SigLipLoss()):
            inputs = [t.clone().requires_grad_() for t in (image, text, scale, bias)]
            loss = loss_fn(*inputs)
            results.append((loss.detach(), torch.autograd.grad(loss, inputs)))
        (ref, ref_grads), (ours, grads) = results
        assert ref > 0.1
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
        for name, a, b in zip(("image", "text", "scale", "bias"), grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{n} samples, {name}")
            assert b.abs().max() > 1e-4, name  # a gradient that is really there


def test_loss_is_the_pairwise_sigmoid_formula():
    """Against the formula written out pair by pair, with and without a bias."""
    g = torch.Generator().manual_seed(1)
    image = F.normalize(torch.randn(5, 8, generator=g, dtype=torch.float64), dim=-1)
    text = F.normalize(torch.randn(5, 8, generator=g, dtype=torch.float64), dim=-1)
    for bias in (None, torch.tensor(-3.0, dtype=torch.float64)):
        total = 0.0
        for i in range(5):
            for j in range(5):
                z = 4.0 * float(image[i] @ text[j]) + (0.0 if bias is None else float(bias))
                total -= float(F.logsigmoid(torch.tensor(z if i == j else -z,
                                                          dtype=torch.float64)))
        loss = SigLipLoss()(image, text, torch.tensor(4.0, dtype=torch.float64), bias)
        assert float(loss) == pytest.approx(total / 5, rel=1e-12)


def test_unknown_dist_impl_is_refused():
    with pytest.raises(ValueError, match="unknown SigLIP dist_impl 'shuffle'.*bidir, gather"):
        SigLipLoss(dist_impl="shuffle")


class _Towers(nn.Module):
    """Two linear towers and SigLIP's scale and bias, in float64."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w_img = nn.Parameter(torch.randn(D_IN, D, generator=g, dtype=torch.float64))
        self.w_txt = nn.Parameter(torch.randn(D_IN, D, generator=g, dtype=torch.float64))
        self.logit_scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))
        self.logit_bias = nn.Parameter(torch.tensor(-2.0, dtype=torch.float64))

    def forward(self, x_img, x_txt):
        return (F.normalize(x_img @ self.w_img, dim=-1), F.normalize(x_txt @ self.w_txt, dim=-1),
                self.logit_scale.exp(), self.logit_bias)


def _inputs(world: int):
    g = torch.Generator().manual_seed(2)
    n = world * PER_RANK
    x_img = torch.randn(n, D_IN, generator=g, dtype=torch.float64)
    x_txt = x_img + 0.5 * torch.randn(n, D_IN, generator=g, dtype=torch.float64)
    return x_img, x_txt


def _rank_worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        results = {}
        x_img, x_txt = _inputs(world)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        for impl in IMPLS:
            ddp = nn.parallel.DistributedDataParallel(_Towers())  # averages the gradients
            loss = SigLipLoss(rank=rank, world_size=world, dist_impl=impl)(
                *ddp(x_img[mine], x_txt[mine]))
            loss.backward()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            results[impl] = (mean_loss / world,
                             {n: p.grad.clone() for n, p in ddp.module.named_parameters()})
            del ddp  # before the process group goes (the gloo trap)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            torch.save(gathered, out_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # no C++ static destructors after gloo (see test_train_clip_loss.py)


# 4 ranks: a bidirectional round and then the last hop (2 ranks: the last hop only)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ranks_equal_the_global_batch(tmp_path, world):
    out_file = tmp_path / "results.pt"
    mp.spawn(_rank_worker, args=(world, str(tmp_path / "init"), str(out_file)), nprocs=world,
             join=True)
    per_rank = torch.load(out_file, weights_only=True)
    towers = _Towers()
    x_img, x_txt = _inputs(world)
    full_loss = SigLipLoss()(*towers(x_img, x_txt))  # one process, the whole global batch
    full_loss.backward()
    full = {n: p.grad for n, p in towers.named_parameters()}
    for impl in IMPLS:
        for rank, results in enumerate(per_rank):
            loss, grads = results[impl]
            torch.testing.assert_close(loss, full_loss.detach(), rtol=1e-12, atol=0)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, full[name], rtol=1e-10, atol=1e-13,
                                           msg=f"{impl}, rank {rank}, {name}")
    # teeth: the global batch's gradient is not the one of a rank's own block alone
    towers = _Towers()
    SigLipLoss()(*towers(x_img[:PER_RANK], x_txt[:PER_RANK])).backward()
    assert not torch.allclose(towers.w_txt.grad, full["w_txt"], rtol=1e-3)
