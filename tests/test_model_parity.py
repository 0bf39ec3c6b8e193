"""The model against data produced by running the original (shared/reference)."""
import json

import pytest
import torch
import torch.nn.functional as F

from rwkv_clip import ClipLoss, create_RWKV_Model, load_model_configs
from rwkv_clip.config import ModelArgs

pytestmark = pytest.mark.cpu_isa  # the WKV CPU build and the bf16 product path vary by CPU
BACKENDS = ["reference", "cpu"]
# the CUDA kernel inside the whole model, in fp32 without TF32 (run by the GPU check)
WITH_CUDA = [*BACKENDS, pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")])]


@pytest.fixture(scope="module")
def golden(reference_dir):
    return torch.load(reference_dir / "golden_small.pt", weights_only=True)


def _device(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def _golden_model(golden, backend):
    model = create_RWKV_Model(ModelArgs.from_dict(dict(golden["config"])))
    model.load_state_dict(golden["state_dict"], strict=True)
    model.set_wkv_backend(backend)
    return model.to(_device(backend))


@pytest.fixture
def inputs(golden, backend):
    """The golden images and tokens on the backend's device; on CUDA with TF32 off in
    products and convolutions, so that fp32 means fp32 as on the CPU."""
    device = _device(backend)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield golden["images"].to(device), golden["text"].to(device)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_golden_state_dict_layout(golden):
    model = create_RWKV_Model(ModelArgs.from_dict(dict(golden["config"])))
    ours = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    theirs = {k: (tuple(v.shape), v.dtype) for k, v in golden["state_dict"].items()}
    assert list(ours) == list(theirs)
    assert ours == theirs


@pytest.mark.parametrize("backend", WITH_CUDA)
def test_golden_eval_features(golden, backend, inputs):
    model = _golden_model(golden, backend).eval()
    images, text = inputs
    with torch.no_grad():
        image_features, text_features, logit_scale = model(images, text)
    assert _rel(image_features.cpu(), golden["image_features"]) < 1e-4
    assert _rel(text_features.cpu(), golden["text_features"]) < 1e-4
    assert torch.allclose(logit_scale.cpu(), golden["logit_scale"], rtol=1e-6)
    with torch.no_grad():  # the same pass, so the same products (chosen per pass)
        assert torch.allclose(model.encode_image(images), image_features, atol=0)


def _direction(n: int) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64)
    d = torch.sin(0.7071067811865476 * i + 0.3)
    return d / d.norm()


@pytest.mark.parametrize("backend", WITH_CUDA)
def test_golden_loss_and_gradients(golden, backend, inputs):
    model = _golden_model(golden, backend).train()
    image_features, text_features, logit_scale = model(*inputs)
    loss = ClipLoss()(F.normalize(image_features, dim=-1), F.normalize(text_features, dim=-1),
                      logit_scale)
    assert abs(loss.item() - golden["loss"]) / golden["loss"] < 1e-3
    loss.backward()
    bf16 = set(golden["meta"]["bf16_keys"])
    for name, param in model.named_parameters():
        tol = 1e-2 if name in bf16 else 1e-3
        grad = param.grad.double().flatten().cpu()
        ref_norm, ref_proj = golden["grad_norms"][name], golden["grad_proj"][name]
        assert abs(grad.norm().item() - ref_norm) <= tol * abs(ref_norm) + 1e-12, name
        proj = (grad * _direction(grad.numel())).sum().item()
        assert abs(proj - ref_proj) <= tol * max(abs(ref_proj), 1e-3 * abs(ref_norm)) + 1e-12, name


@pytest.mark.parametrize("name", ["B32", "B16"])
def test_published_manifests(reference_dir, repo_root, name):
    manifest = json.loads((reference_dir / f"keys_{name}.json").read_text())
    config_path = repo_root / "model_config" / f"RWKV_CLIP_{name}.json"
    assert json.loads(config_path.read_text()) == manifest["config"]  # published file unchanged
    with torch.device("meta"):  # shapes and dtypes only: no 150M-parameter allocation
        model = create_RWKV_Model(load_model_configs(config_path))
    ours = [[k, list(v.shape), str(v.dtype).replace("torch.", "")]
            for k, v in model.state_dict().items()]
    assert ours == manifest["keys"]
    assert sum(p.numel() for p in model.parameters()) == manifest["num_parameters"]


# bf16 autocast against the (fp32) golden data. The glue runs in bf16 under autocast
# (rwkv_clip.layers.time_mix.glue_dtype) instead of the original's promotion of every
# lerp back to float32; these bounds are ~2.5x what the original promotion gives on
# this data (features 5.5e-3 / 6e-4, loss 8e-4, worst gradient norm 8%), so either rule
# passes and a real precision loss does not. Both CPU product paths, whatever the CPU:
# torch's bf16 GEMMs (native) and fp32 GEMMs of the rounded operands (rwkv_clip.ops.products).
@pytest.mark.parametrize("products", ["native", "fp32"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_golden_bf16_autocast(golden, backend, products, choose):
    choose("lowp_matmul", products)
    _golden_bf16_autocast(golden, backend)


def _golden_bf16_autocast(golden, backend):
    model = _golden_model(golden, backend).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        image_features, text_features, _ = model(golden["images"], golden["text"])
    assert _rel(image_features.float(), golden["image_features"]) < 1.5e-2
    assert _rel(text_features.float(), golden["text_features"]) < 1.5e-3
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        image_features, text_features, logit_scale = model(golden["images"], golden["text"])
    loss = ClipLoss()(F.normalize(image_features.float(), dim=-1),
                      F.normalize(text_features.float(), dim=-1), logit_scale.float())
    assert abs(loss.item() - golden["loss"]) / golden["loss"] < 2e-3
    loss.backward()
    for name, param in model.named_parameters():
        ref_norm = golden["grad_norms"][name]
        assert abs(param.grad.double().norm().item() - ref_norm) <= 0.2 * abs(ref_norm), name
