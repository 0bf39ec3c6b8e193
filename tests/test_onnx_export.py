"""ONNX export: the chunked WKV form in plain operators against the reference scan, the exported encoders under
onnxruntime against PyTorch (random and trained weights, batch sizes not seen at export),
the torch-free runtime wrapper, and one-line errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rwkv_clip.ops.chunked_plain import wkv6_bidirectional_chunked_plain
from rwkv_clip.ops.reference import wkv6_bidirectional_reference

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4  # max |onnxruntime - PyTorch| / max |PyTorch feature|


def _wkv_inputs(B, T, H, N, dtype, w_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(B, T, H * N, generator=g, dtype=dtype) for _ in range(3))
    w = torch.randn(B, T, H * N, generator=g, dtype=dtype) * w_scale - 1.0
    u = torch.randn(H, N, generator=g, dtype=dtype)
    return r, k, v, w, u


@pytest.mark.parametrize("B,T,H,N,w_scale,chunk", [
    (2, 1, 1, 4, 1.0, None), (2, 7, 2, 4, 1.0, None), (1, 16, 2, 4, 1.0, None),
    (1, 49, 2, 8, 3.0, None), (3, 77, 2, 16, 1.0, None), (1, 33, 1, 4, 2.0, 4),
    (2, 50, 2, 8, 1.0, 8)])
def test_chunked_wkv_equals_reference_in_float64(B, T, H, N, w_scale, chunk):
    """One chunk, whole chunks, a padded last chunk, long scans (33 / 4: nine chunks)."""
    xs = _wkv_inputs(B, T, H, N, torch.float64, w_scale)
    ref = wkv6_bidirectional_reference(*xs)
    chunked = wkv6_bidirectional_chunked_plain(*xs, chunk=chunk)
    assert chunked.dtype == torch.float64 and chunked.shape == ref.shape
    assert (chunked - ref).abs().max() <= 1e-12 * ref.abs().max()


def test_chunk_length_keeps_the_scan_short():
    from rwkv_clip.ops.chunked_plain import CHUNK, MAX_CHUNKS, chunk_length

    assert chunk_length(5) == 5 and chunk_length(49) == CHUNK == 8
    assert chunk_length(3136) == 16  # B/16 at 896 px: 196 chunks
    for T in (1, 7, 49, 77, 784, 1601, 3136, 12544):
        L = chunk_length(T)
        assert -(-T // L) <= MAX_CHUNKS and (L <= CHUNK or -(-T // (L // 2)) > MAX_CHUNKS)


def test_chunked_wkv_float32_keeps_weak_decays_after_strong_ones():
    """exp(w) up to e^8: the exponents are sums of only the decays between two tokens (no
    difference of large sums), so weak decays after strong ones keep float32 rounding."""
    xs = _wkv_inputs(1, 49, 2, 8, torch.float64, w_scale=3.0, seed=1)
    ref = wkv6_bidirectional_reference(*xs)
    chunked = wkv6_bidirectional_chunked_plain(*(x.float() for x in xs))
    assert chunked.dtype == torch.float32
    assert ((chunked.double() - ref).abs().max() / ref.abs().max()).item() < 2e-6


@pytest.mark.parametrize("matrix_tokens", [256, 0])
def test_shift_decompositions_equal_the_operators(monkeypatch, matrix_tokens):
    """Both export forms of the shifts (0/1 products up to MATRIX_SHIFT_TOKENS tokens, pads
    and slices past it) equal the operators exactly."""
    import rwkv_clip.onnx_export

    monkeypatch.setattr(rwkv_clip.onnx_export, "MATRIX_SHIFT_TOKENS", matrix_tokens)
    from rwkv_clip.onnx_export import _q_shift
    from rwkv_clip.onnx_export import _sequence_shift as sequence_shift_export
    from rwkv_clip.ops.shift import _q_shift_grid, _sequence_shift

    # head sizes that split evenly (one product of 0/1 matrices) and ones that do not
    # (slices), shifts of 1 and 2
    for shape, s in (((2, 3, 5, 2, 8), 1), ((2, 4, 4, 3, 8), 2), ((1, 3, 5, 2, 6), 1)):
        grid = torch.randn(*shape)
        for adjoint in (False, True):
            assert torch.equal(_q_shift(grid, s, adjoint), _q_shift_grid(grid, s, adjoint))
    for shape, s in (((2, 7, 3, 8), 1), ((2, 7, 3, 5), 2), ((1, 9, 2, 4), 3)):
        seq = torch.randn(*shape)
        for adjoint in (False, True):
            assert torch.equal(sequence_shift_export(seq, s, adjoint),
                               _sequence_shift(seq, s, adjoint))


# ----------------------------------------------------------------------- exported files
def _tiny_model(seed=0):
    from rwkv_clip import create_RWKV_Model, load_model_configs

    torch.manual_seed(seed)
    return create_RWKV_Model(load_model_configs("RWKV_CLIP_tiny")).eval()


@pytest.fixture(scope="module")
def random_export(tmp_path_factory):
    """Fresh random tiny weights, exported with the library call (example batch 2)."""
    from rwkv_clip.config import read_config_json
    from rwkv_clip.onnx_export import EXPORT_BATCH, export_onnx

    assert EXPORT_BATCH == 2  # the batches checked below (1, 7) are not the traced one
    model = _tiny_model(seed=3)
    out = tmp_path_factory.mktemp("onnx_random")
    export_onnx(model, out, read_config_json("RWKV_CLIP_tiny")[0], normalize=False)
    return model, out


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """A tiny model trained for a few steps by the training loop (train.py's)."""
    sys.path.insert(0, str(REPO / "tests"))
    from train_util import make_tiny_rec, tiny_argv

    from rwkv_clip.train import main, parse_args

    root = tmp_path_factory.mktemp("onnx_trained")
    rec = make_tiny_rec(root / "data", n=32)
    result = main(parse_args(tiny_argv(root / "run", rec)))
    assert result["steps"] > 0
    return Path(result["checkpoint"])


@pytest.mark.slow
def test_files_and_configs(random_export):
    model, out = random_export
    names = {p.name for p in out.iterdir()}
    assert names == {"image_encoder.onnx", "text_encoder.onnx", "model_config.json",
                     "preprocess_config.json", "onnx_config.json"}
    for p in out.iterdir():
        assert p.stat().st_mode & 0o777 == 0o644, p
    pre = json.loads((out / "preprocess_config.json").read_text())
    assert pre["size"] == 16 and pre["resize_mode"] == "shortest"
    assert pre["interpolation"] == "bicubic"
    assert pre["mean"] == pytest.approx([0.48145466, 0.4578275, 0.40821073])
    assert pre["std"] == pytest.approx([0.26862954, 0.26130258, 0.27577711])
    info = json.loads((out / "onnx_config.json").read_text())
    assert info["image_input"]["shape"] == ["batch", 3, 16, 16]
    assert info["text_input"]["shape"] == ["batch", 77] and info["normalize"] is False
    config = json.loads((out / "model_config.json").read_text())
    assert config == json.loads((REPO / "model_config" / "RWKV_CLIP_tiny.json").read_text())
    import onnx

    graph = onnx.load(str(out / "image_encoder.onnx")).graph
    batch_dim = graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.dim_value  # symbolic: any batch
    assert not any(n.domain.startswith("rwkv") for n in graph.node)  # standard operators only


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 7])
def test_onnxruntime_matches_pytorch_on_random_weights(random_export, batch):
    from rwkv_clip.onnx import OnnxCLIP
    from rwkv_clip.onnx_export import example_inputs, max_relative_difference

    model, out = random_export
    clip = OnnxCLIP(out)
    image, text = example_inputs(model, batch, seed=11)
    with torch.no_grad():
        ref_image, ref_text = model.encode_image(image).numpy(), model.encode_text(text).numpy()
    got_image, got_text = clip.encode_image(image.numpy()), clip.encode_text(text.numpy())
    assert got_image.shape == (batch, 64) and got_text.shape == (batch, 64)
    assert max_relative_difference(got_image, ref_image) < TOLERANCE
    assert max_relative_difference(got_text, ref_text) < TOLERANCE
    # the difference is small against the features, not because the features are small
    assert np.abs(ref_image).max() > 0.1 and np.abs(ref_text).max() > 0.01


@pytest.mark.slow
def test_cli_exports_trained_checkpoint_with_normalised_features(trained_checkpoint, tmp_path):
    out = tmp_path / "onnx"
    r = subprocess.run([sys.executable, "-m", "rwkv_clip.export", str(trained_checkpoint),
                        "--format", "onnx", "--output", str(out), "--normalize"], cwd=REPO,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr
    assert "image_b7" in r.stdout and "text_b1" in r.stdout  # the check at batch 1 and 7 ran
    from rwkv_clip.checkpoint_files import read_state_dict
    from rwkv_clip.onnx import OnnxCLIP
    from rwkv_clip.onnx_export import example_inputs, max_relative_difference, model_from_state

    model = model_from_state(read_state_dict(trained_checkpoint), "RWKV_CLIP_tiny")
    clip = OnnxCLIP(out)
    assert clip.normalize
    image, text = example_inputs(model, 5, seed=2)  # 5: neither the traced nor the checked
    with torch.no_grad():
        ref_image = model.encode_image(image, normalize=True).numpy()
        ref_text = model.encode_text(text, normalize=True).numpy()
    got_image, got_text = clip.encode_image(image.numpy()), clip.encode_text(text.numpy())
    assert np.allclose(np.linalg.norm(got_image, axis=1), 1.0, atol=1e-5)
    assert max_relative_difference(got_image, ref_image) < TOLERANCE
    assert max_relative_difference(got_text, ref_text) < TOLERANCE


_NO_TORCH = """
import sys
sys.modules["torch"] = None  # any import of torch now fails
import numpy as np
from rwkv_clip.onnx import OnnxCLIP
clip = OnnxCLIP(sys.argv[1])
inputs = np.load(sys.argv[2])
np.savez(sys.argv[3], image=clip.encode_image(inputs["image"]),
         text=clip.encode_text(inputs["text"]))
print("torch loaded:", any(m == "torch" or m.startswith("torch.") for m in sys.modules
                           if sys.modules[m] is not None))
"""


@pytest.mark.slow
def test_runtime_wrapper_needs_no_torch(random_export, tmp_path):
    from rwkv_clip.onnx_export import example_inputs, max_relative_difference

    model, out = random_export
    image, text = example_inputs(model, 3, seed=5)
    np.savez(tmp_path / "in.npz", image=image.numpy(), text=text.numpy())
    r = subprocess.run([sys.executable, "-c", _NO_TORCH, str(out), str(tmp_path / "in.npz"),
                        str(tmp_path / "out.npz")], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "torch loaded: False" in r.stdout
    got = np.load(tmp_path / "out.npz")
    with torch.no_grad():
        assert max_relative_difference(got["image"], model.encode_image(image).numpy()) < TOLERANCE
        assert max_relative_difference(got["text"], model.encode_text(text).numpy()) < TOLERANCE


@pytest.mark.slow
def test_preprocess_matches_the_eval_transform(random_export):
    from PIL import Image

    from rwkv_clip.onnx import OnnxCLIP
    from rwkv_clip.transform import image_transform

    _, out = random_export
    clip = OnnxCLIP(out)
    rng = np.random.default_rng(0)
    for h, w in ((40, 25), (25, 40), (16, 16), (33, 17), (100, 61)):
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        expected = image_transform(16, is_train=False)(image).numpy()
        assert np.abs(clip.preprocess(image) - expected).max() < 1e-6


@pytest.mark.slow
def test_runtime_wrapper_rejects_wrong_shapes(random_export):
    from rwkv_clip.errors import RWKVCLIPError
    from rwkv_clip.onnx import OnnxCLIP

    clip = OnnxCLIP(random_export[1])
    with pytest.raises(RWKVCLIPError, match=r"\(B, 3, 16, 16\)"):
        clip.encode_image(np.zeros((1, 3, 24, 24), np.float32))
    with pytest.raises(RWKVCLIPError, match="context_length=77"):
        clip.encode_text(np.zeros((1, 24), np.int64))


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_runtime_wrapper_without_its_runtime_is_one_error(tmp_path, runtime):
    code = (f"import sys; sys.modules[{runtime!r}] = None\n"
            "from rwkv_clip.errors import RWKVCLIPError\n"
            "from rwkv_clip.onnx import OnnxCLIP\n"
            f"try:\n    OnnxCLIP(sys.argv[1], runtime={runtime!r})\n"
            "except RWKVCLIPError as exc:\n    print('error:', exc)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines() == [
        f"error: running ONNX encoders with {runtime} needs it installed: pip install "
        f"{runtime} (or pip install 'rwkv-clip[onnx]')"]


def test_unknown_runtime_is_one_error(tmp_path):
    from rwkv_clip.errors import RWKVCLIPError
    from rwkv_clip.onnx import OnnxCLIP

    with pytest.raises(RWKVCLIPError, match="runtime 'tensorrt': expected one of "
                                            "onnxruntime, openvino"):
        OnnxCLIP(tmp_path, runtime="tensorrt")


def test_missing_folder_is_one_error(tmp_path):
    from rwkv_clip.errors import RWKVCLIPError
    from rwkv_clip.onnx import OnnxCLIP

    with pytest.raises(RWKVCLIPError, match="onnx_config.json does not exist"):
        OnnxCLIP(tmp_path)


def test_cli_without_onnx_package_is_one_line(tmp_path):
    code = ("import sys; sys.modules['onnxscript'] = None\n"
            "from rwkv_clip.errors import run_cli\n"
            "from rwkv_clip.export import main\n"
            "sys.exit(run_cli(lambda: main(sys.argv[1:]), prog='rwkv_clip.export'))\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "weights.pt"), "--format",
                        "onnx", "--output", str(tmp_path / "out")], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs onnxscript" in lines[0], r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--format", "onnx"], "no output"),
    (["--format", "onnx", "--output", "x.onnx"], "writes a folder"),
    (["--format", "safetensors", "--output", "x.pt"], "writes a .safetensors file"),
    (["out.bin"], "expected a .pt or .safetensors file name"),
    (["a.pt", "--output", "b.pt"], "output given twice"),
])
def test_cli_output_errors(tmp_path, argv, needle):
    """Checked before the checkpoint is read (it does not exist here)."""
    from rwkv_clip.errors import RWKVCLIPError
    from rwkv_clip.export import main

    with pytest.raises(RWKVCLIPError, match=needle):
        main([str(tmp_path / "missing.pt"), *argv])


@pytest.mark.slow
def test_docs_commands_run(trained_checkpoint, tmp_path):
    """Every command of docs/export.md, as written, on a trained tiny checkpoint placed
    where the page's paths expect a run's checkpoint."""
    import re
    import shlex

    text = (REPO / "docs" / "export.md").read_text()
    commands = [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
                for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 6
    checkpoint = tmp_path / "runs" / "default" / "checkpoints" / "epoch_latest.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(trained_checkpoint.read_bytes())
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "python"
        argv[0] = sys.executable
        if argv[1].endswith(".py"):
            argv[1] = str(REPO / argv[1])
        r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=1200)
        assert r.returncode == 0, (command, r.stderr[-2000:])
        if "bench_onnx" in command:
            result = json.loads(r.stdout.strip().splitlines()[-1])
            assert result["batch_size"] == 1 and result["image"]["max_rel_diff"] < TOLERANCE
            assert result["image"]["onnxruntime_ms"] > 0 and result["text"]["torch_eager_ms"] > 0
            low, high = result["image"]["onnxruntime_speedup_range"]
            assert low <= result["image"]["onnxruntime_speedup"] <= high
    assert (tmp_path / "exported" / "onnx" / "image_encoder.onnx").is_file()
    int8 = json.loads((tmp_path / "exported" / "onnx-int8" / "onnx_config.json").read_text())
    assert int8["quantization"].startswith("int8")
    scores = tmp_path / "runs" / "onnx" / "onnx-int8" / "eval_results" / "zero_shot_scores.txt"
    assert scores.is_file(), sorted(str(p) for p in (tmp_path / "runs").rglob("*"))
    card = (tmp_path / "exported" / "hub" / "README.md").read_text()
    assert "top-1 accuracy" in card  # the zero_shot.py result found in the run folder


def test_cli_exports_a_siglip_checkpoint_with_its_head(tmp_path, capsys):
    """A SigLIP state dict (with ``logit_bias``) exports as a CLIP one does; onnx_config.json
    carries the head the encoders leave out (scale and bias). (The encoders' agreement with
    PyTorch is the slow tests' job.)"""
    from rwkv_clip.export import main
    from rwkv_clip.onnx import OnnxCLIP

    model = _tiny_model(seed=4)
    model.set_logit_bias(-7.5)
    with torch.no_grad():
        model.logit_scale.fill_(2.25)
    torch.save(model.state_dict(), tmp_path / "siglip.pt")
    assert main([str(tmp_path / "siglip.pt"), "--format", "onnx", "--output",
                 str(tmp_path / "onnx"), "--no-verify"]) == 0
    assert "onnx_config.json" in capsys.readouterr().out
    info = json.loads((tmp_path / "onnx" / "onnx_config.json").read_text())
    assert info["loss"] == "siglip"
    assert info["logit_bias"] == pytest.approx(-7.5) and info["logit_scale"] == pytest.approx(2.25)
    clip = OnnxCLIP(tmp_path / "onnx")
    assert clip.logit_bias == pytest.approx(-7.5) and clip.logit_scale == pytest.approx(2.25)
