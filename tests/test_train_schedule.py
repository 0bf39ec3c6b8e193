"""lr_at(step) against torch's own schedulers, step by step over whole runs."""
import pytest
import torch
from torch.optim import lr_scheduler

from rwkv_clip.train.schedule import lr_at, set_lr, warmup_fraction


def _optimizer(lr, kind="adamw"):
    params = [torch.nn.Parameter(torch.zeros(2))]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98))


def _beta1(group):
    return group["betas"][0] if "betas" in group else group["momentum"]


@pytest.mark.parametrize("total,warmup,optimizer", [(100, 0.1, "adamw"), (100, 0.25, "sgd"),
                                                    (7, 0.1, "adamw")])
def test_cosine_is_torchs_one_cycle_lr_and_its_beta1(total, warmup, optimizer):
    """The original's OneCycleLR(max_lr, pct_start=0.1) with its defaults (div_factor 25,
    final_div_factor 1e4, beta1 0.95 -> 0.85 -> 0.95, cos anneal): same lr and beta1 at
    every step. 7 steps: the short-run warmup floor of 1.5 steps applies."""
    lr = 1e-3
    opt = _optimizer(lr, optimizer)
    sched = lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total,
                                    pct_start=warmup_fraction(warmup, total))
    seen = []
    for step in range(total):
        group = opt.param_groups[0]
        got_lr, got_beta1 = lr_at(step, kind="cosine", max_lr=lr, total_steps=total,
                                  warmup=warmup)
        assert got_lr == pytest.approx(group["lr"], rel=1e-12, abs=1e-18), step
        assert got_beta1 == pytest.approx(_beta1(group), rel=1e-12), step
        seen.append(got_lr)
        opt.step()
        sched.step()
    # the shape: lr/25 at the start, lr/25/1e4 at the end, lr (and beta1 0.85) at the peak
    assert seen[0] == pytest.approx(lr / 25) and seen[-1] == pytest.approx(lr / 25 / 1e4)
    if total == 100:
        peak = round(warmup * total) - 1
        assert seen[peak] == pytest.approx(lr) and max(seen) == seen[peak]
        assert lr_at(peak, kind="cosine", max_lr=lr, total_steps=total,
                     warmup=warmup)[1] == pytest.approx(0.85)


def test_linear_is_torchs_linear_lr():
    lr, total = 3e-4, 100
    opt = _optimizer(lr)
    sched = lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=total)
    for step in range(total + 5):  # past the end it stays at 0, as LinearLR does
        got_lr, got_beta1 = lr_at(step, kind="linear", max_lr=lr, total_steps=total)
        assert got_lr == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-15), step
        assert got_beta1 is None  # beta1 stays what --beta1 says
        opt.step()
        sched.step()
    assert lr_at(total, kind="linear", max_lr=lr, total_steps=total)[0] == 0.0


def test_cosine_past_the_end_stays_at_the_final_value():
    final = lr_at(99, kind="cosine", max_lr=1.0, total_steps=100)
    assert lr_at(100, kind="cosine", max_lr=1.0, total_steps=100) == final
    assert lr_at(10_000, kind="cosine", max_lr=1.0, total_steps=100) == final


def test_set_lr_writes_every_group_and_beta1():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    adam = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1.0,
                             betas=(0.9, 0.98))
    set_lr(adam, 0.5, 0.85)
    assert [(g["lr"], g["betas"]) for g in adam.param_groups] == [(0.5, (0.85, 0.98))] * 2
    set_lr(adam, 0.25, None)
    assert [(g["lr"], g["betas"]) for g in adam.param_groups] == [(0.25, (0.85, 0.98))] * 2
    sgd = torch.optim.SGD(params, lr=1.0, momentum=0.9)
    set_lr(sgd, 0.5, 0.95)
    assert sgd.param_groups[0]["momentum"] == 0.95


def test_bad_schedule_arguments():
    with pytest.raises(ValueError, match="at least one optimizer step"):
        lr_at(0, kind="cosine", max_lr=1.0, total_steps=0)
    with pytest.raises(ValueError, match="unknown lr scheduler 'step'"):
        lr_at(0, kind="step", max_lr=1.0, total_steps=10)
