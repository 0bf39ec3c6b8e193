"""Saved activations rebuilt by the backward (rwkv_clip.layers.recompute): the same
gradients bit for bit, less kept, and out of the way of other saved-tensor hooks."""
import pytest
import torch
from train_util import TINY_CONFIG, tiny_model

from rwkv_clip import load_model_configs
from rwkv_clip.layers import recompute
from rwkv_clip.memory import synthetic_batch


def _step(model, images, tokens, amp):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        img, txt, _ = model(images, tokens)
    weights = torch.linspace(-1, 1, img.shape[-1])
    ((img.float() * weights).sum() + (txt.float() * weights).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _kept_everything():
    """A no-op hook of someone else's: the blocks then save as autograd would."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_gradients_bit_identical_to_keeping_everything(amp, monkeypatch):
    monkeypatch.setenv("RWKV_CLIP_REBUILD", "always")  # the tiny batch is below auto's size
    model = tiny_model()
    images, tokens = synthetic_batch(load_model_configs(TINY_CONFIG), 3, "cpu")
    views = []
    make_view = recompute._SavedView.__init__

    def record(self, rebuild, t):
        views.append(t.shape)
        make_view(self, rebuild, t)
    monkeypatch.setattr(recompute._SavedView, "__init__", record)
    rebuilt = _step(model, images, tokens, amp)
    assert len(views) >= 8 * 2  # every block: 6 time-mix views, 2 mixes and the square
    views.clear()
    with _kept_everything():
        kept = _step(model, images, tokens, amp)
    assert not views
    assert rebuilt.keys() == kept.keys()
    for name in kept:
        assert torch.equal(rebuilt[name], kept[name]), name


def test_inactive_without_grad_and_under_checkpointing(monkeypatch):
    monkeypatch.setenv("RWKV_CLIP_REBUILD", "always")
    x = torch.randn(4, requires_grad=True)
    with torch.no_grad(), recompute.RecomputedSaves(x) as saves:
        assert not saves.active
    with _kept_everything(), recompute.RecomputedSaves(x) as saves:
        assert not saves.active
    with recompute.RecomputedSaves(x) as saves:
        assert saves.active
        y = x * 2
        saves.add(y, lambda: x.detach() * 2)
        z = (y * y).sum()
    z.backward()
    assert torch.equal(x.grad, 8 * x.detach())


def test_one_rebuild_serves_every_saved_view(monkeypatch):
    """``y * y`` saves y twice: both are views of the rebuild, made once, by the backward
    and not before."""
    monkeypatch.setenv("RWKV_CLIP_REBUILD", "always")
    x = torch.randn(1000, requires_grad=True)
    calls = []

    def again():
        calls.append(1)
        return torch.sin(x.detach())
    with recompute.RecomputedSaves(x) as saves:
        y = torch.sin(x)
        saves.add(y, again)
        z = (y * y).sum()
    del y
    assert not calls
    z.backward()
    assert calls == [1]
    assert torch.equal(x.grad, 2 * torch.sin(x.detach()) * torch.cos(x.detach()))



def test_policy_by_size_and_its_switch(monkeypatch):
    """auto: from REBUILD_MIN_ELEMENTS on; always / never; anything else one error naming
    the variable and the choices."""
    from rwkv_clip.errors import ConfigError
    big = recompute.REBUILD_MIN_ELEMENTS
    monkeypatch.delenv("RWKV_CLIP_REBUILD", raising=False)
    assert recompute.rebuilds(big) and not recompute.rebuilds(big - 1)
    x = torch.randn(4, requires_grad=True)
    with recompute.RecomputedSaves(x) as saves:
        assert not saves.active
    monkeypatch.setenv("RWKV_CLIP_REBUILD", "never")
    assert not recompute.rebuilds(10 * big)
    monkeypatch.setenv("RWKV_CLIP_REBUILD", "always")
    assert recompute.rebuilds(1)
    monkeypatch.setenv("RWKV_CLIP_REBUILD", "sometimes")
    with pytest.raises(ConfigError, match="RWKV_CLIP_REBUILD='sometimes': expected one of auto, always, never"):
        recompute.rebuilds(1)
