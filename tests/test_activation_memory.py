"""The residual branches' activation-memory policy (rwkv_clip.activation_memory):
the same gradients bit for bit, the projections and the WKV kept and nothing else, off
where it does not apply."""
import math

import pytest
import torch
from torch.utils._pytree import tree_flatten
from train_util import TINY_CONFIG, tiny_model

from rwkv_clip import activation_memory, load_model_configs
from rwkv_clip.errors import ConfigError
from rwkv_clip.memory import synthetic_batch
from rwkv_clip.ops import dispatch

pytestmark = pytest.mark.cpu_isa


def _step(model, images, tokens, amp, after_forward=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        img, txt, _ = model(images, tokens)
    if after_forward is not None:
        after_forward()
    weights = torch.linspace(-1, 1, img.shape[-1])
    ((img.float() * weights).sum() + (txt.float() * weights).sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def kept(monkeypatch):
    """Per branch run under the policy: the tensors its SAC cache keeps (filled by the
    forward, handed to the backward)."""
    branches = []
    make = activation_memory.create_selective_checkpoint_contexts

    def contexts(policy):
        forward, recompute = make(policy)
        branches.append(forward.storage)
        return forward, recompute
    monkeypatch.setattr(activation_memory, "create_selective_checkpoint_contexts", contexts)

    def tensors():
        out = []
        for storage in branches:
            leaves = [leaf.val for entries in storage.values() for entry in entries.values()
                      for leaf in tree_flatten(entry)[0]
                      if isinstance(getattr(leaf, "val", None), torch.Tensor)]
            out.append(leaves)
        return out
    return tensors


def _shapes(model, batch):
    args = model.text_model.args
    image = model.image_model
    C, T = image.embed_dims, image.patch_resolution[0] * image.patch_resolution[1]
    F = image.layers[0].ffn.key.out_features
    rows_i, rows_t = batch * T, batch * args.ctx_len
    time_i = sorted([(rows_i, C)] * 4 + [(batch, T, C)])
    time_t = sorted([(rows_t, args.dim_att)] * 4 + [(batch, args.ctx_len, args.dim_att)])
    ffn_i = sorted([(rows_i, F), (rows_i, C), (rows_i, C)])
    ffn_t = sorted([(rows_t, args.dim_ffn), (rows_t, args.n_embd), (rows_t, args.n_embd)])
    return ([time_i, ffn_i] * image.num_layers) + ([time_t, ffn_t] * args.n_layer)


@pytest.fixture
def lowp_matmul(monkeypatch):
    """Force the CPU bf16 product path (rwkv_clip.ops.products) for one test."""
    def choose(choice: str) -> None:
        dispatch.pin({"lowp_matmul": choice})
    yield choose
    dispatch.pin({})


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_same_gradients_keeping_the_projections_and_wkv(amp, monkeypatch, kept, lowp_matmul):
    """bf16 on the native product path (CPUs with AVX512-BF16 or AMX; forced elsewhere):
    the 2-D projections of torch's addmm/mm. The fp32-GEMM path: the next test."""
    lowp_matmul("native")
    model = tiny_model()
    images, tokens = synthetic_batch(load_model_configs(TINY_CONFIG), 3, "cpu")
    model.set_rebuild("never")
    plain = _step(model, images, tokens, amp)
    assert not kept()
    model.set_rebuild("always")  # the tiny batch is below auto's size
    seen = []
    policy = _step(model, images, tokens, amp, lambda: seen.extend(kept()))
    assert policy.keys() == plain.keys()
    for name in plain:
        assert torch.equal(policy[name], plain[name]), name
    # each time mix keeps its four projections (2-D products) and the WKV's (B, T, C)
    # result; each channel mix its three projections
    branches = seen
    assert [sorted(tuple(t.shape) for t in b) for b in branches] == _shapes(model, 3)
    low = torch.bfloat16 if amp else torch.float32
    assert all(t.dtype == (torch.float32 if t.dim() == 3 else low)
               for b in branches for t in b)


def test_products_in_fp32_keep_their_rounded_copy(monkeypatch, kept, lowp_matmul):
    """Where CPU bf16 products run as fp32 GEMMs (rwkv_clip.ops.products; CPUs without
    AVX512-BF16 or AMX, forced elsewhere), the policy keeps the bf16 result, not the fp32
    product it was rounded from."""
    lowp_matmul("fp32")
    model = tiny_model()
    images, tokens = synthetic_batch(load_model_configs(TINY_CONFIG), 2, "cpu")
    model.set_rebuild("never")
    plain = _step(model, images, tokens, True)
    model.set_rebuild("always")
    seen = []
    policy = _step(model, images, tokens, True, lambda: seen.extend(kept()))
    for name in plain:
        assert torch.equal(policy[name], plain[name]), name
    numels = [sorted(math.prod(shape) for shape in b) for b in _shapes(model, 2)]
    assert [sorted(t.numel() for t in b) for b in seen] == numels
    # the time mix's WKV result in fp32; every projection's in bf16
    assert [sum(t.dtype == torch.float32 for t in b) for b in seen] == [1, 0] * (len(seen) // 2)
    assert all(t.dtype in (torch.float32, torch.bfloat16) for b in seen for t in b)


def test_off_without_grad_under_other_hooks_and_whole_block_checkpointing(kept):
    model = tiny_model()
    model.set_rebuild("always")
    images, tokens = synthetic_batch(load_model_configs(TINY_CONFIG), 2, "cpu")
    x = torch.randn(4, requires_grad=True)
    assert activation_memory.applies(x, "always")
    with torch.no_grad():
        assert not activation_memory.applies(x, "always")
        model(images, tokens)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not activation_memory.applies(x, "always")
        model(images, tokens)
    assert not kept()
    plain = _step(model, images, tokens, False)
    model.image_model.with_cp = True
    model.text_model.args.with_cp = True
    try:
        checkpointed = _step(model, images, tokens, False)
    finally:
        model.image_model.with_cp = False
        model.text_model.args.with_cp = False
    assert len(kept()) == 2 * 4  # the plain step's branches only
    for name in plain:
        assert torch.equal(checkpointed[name], plain[name]), name


def test_policy_by_size_and_its_setting():
    """auto: from REBUILD_MIN_ELEMENTS on; always / never; anything else one error naming
    the key and the choices, from the function, the model and the config."""
    big = activation_memory.REBUILD_MIN_ELEMENTS
    assert activation_memory.rebuilds(big) and not activation_memory.rebuilds(big - 1)
    assert not activation_memory.applies(torch.randn(4, requires_grad=True))
    assert not activation_memory.rebuilds(10 * big, "never")
    assert activation_memory.rebuilds(1, "always")
    with pytest.raises(ConfigError, match="rebuild='sometimes': expected one of "
                                          "auto, always, never"):
        activation_memory.rebuilds(1, "sometimes")
    model = tiny_model()
    assert model.image_model.rebuild == model.text_model.args.rebuild == "auto"
    model.set_rebuild("never")
    assert {layer.rebuild for layer in model.image_model.layers} == {"never"}
    assert model.text_model.args.rebuild == "never"
    with pytest.raises(ConfigError, match="rebuild='sometimes'"):
        model.set_rebuild("sometimes")
    with pytest.raises(ConfigError, match="rebuild"):
        tiny_model(rebuild="sometimes")
    assert tiny_model(rebuild="always").image_model.rebuild == "always"


def test_the_training_page_names_the_batches_the_policy_starts_at():
    """docs/training.md's "from batch N" figures are the first batch whose block input
    reaches REBUILD_MIN_ELEMENTS (rebuild auto), computed from the configs."""
    import re
    from pathlib import Path

    from rwkv_clip import load_model_configs
    from rwkv_clip.activation_memory import rebuilds
    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()

    def _image_tokens(args, size: int) -> int:
        return (size // args.image_patch_size) ** 2 + int(bool(args.image_with_cls_token))

    def first_batch(tokens: int, width: int) -> int:
        return next(b for b in range(1, 1 << 16) if rebuilds(b * tokens * width, "auto"))
    b32, b16 = load_model_configs("RWKV_CLIP_B32"), load_model_configs("RWKV_CLIP_B16")
    expected = (f"B/32 at 224 px: the text blocks from\nbatch "
                f"{first_batch(b32.ctx_len, b32.n_embd)}, the image blocks from batch "
                f"{first_batch(_image_tokens(b32, 224), b32.image_embed_dims)}; "
                f"B/16 at 896 px: the image blocks from batch "
                f"{first_batch(_image_tokens(b16, 896), b16.image_embed_dims)})")
    assert expected in text, re.findall(r"B/32 at 224 px[^)]*\)", text)
