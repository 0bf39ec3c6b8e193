"""Serving an export: OpenVINO beside onnxruntime, the INT8 command, ``zero_shot.py --onnx``
scoring an export by the checkpoint's protocol, and the serving benchmark's JSON."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """Random tiny weights as a .pt and their ONNX folder, written by the export command in
    a process of its own (as a user runs it)."""
    from rwkv_clip import create_RWKV_Model, load_model_configs

    root = tmp_path_factory.mktemp("serving")
    torch.manual_seed(5)
    model = create_RWKV_Model(load_model_configs("RWKV_CLIP_tiny")).eval()
    torch.save(model.state_dict(), root / "tiny.pt")
    r = _run("-m", "rwkv_clip.export", str(root / "tiny.pt"), "--format", "onnx", "--output",
             str(root / "onnx"))
    assert r.returncode == 0, r.stderr[-3000:]
    return model, root


def _run(*args, cwd=REPO):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


# Both runtimes serve in a fresh process, as a user serves them: a runtime that dies there
# fails the test with its signal and stderr instead of taking the test worker with it.
_SERVE = """
import sys
from pathlib import Path
import numpy as np
from rwkv_clip.onnx import OnnxCLIP
root = Path(sys.argv[1])
inputs = np.load(root / "inputs.npz")
image, text = inputs["image"], inputs["text"]
ort = OnnxCLIP(root / "onnx")
ov = OnnxCLIP(root / "onnx", runtime="openvino", threads=1)
out = {}
for name, clip in (("ort", ort), ("ov", ov)):
    out[name + "_image"], out[name + "_text"] = clip.encode_image(image), clip.encode_text(text)
# each call's result is its own array, not a buffer the next call overwrites
out["ov_first"] = ov.encode_image(image[:2])
ov.encode_image(-image[:2])
np.savez(root / "served.npz", **out)
"""


def test_openvino_matches_onnxruntime_and_pytorch(tiny_export):
    pytest.importorskip("openvino")
    from rwkv_clip.onnx_export import example_inputs, max_relative_difference

    model, root = tiny_export
    image, text = example_inputs(model, 5, seed=2)
    np.savez(root / "inputs.npz", image=image.numpy(), text=text.numpy())
    with torch.no_grad():
        want_image, want_text = model.encode_image(image).numpy(), model.encode_text(text).numpy()
    r = _run("-X", "faulthandler", "-c", _SERVE, str(root))
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    served = np.load(root / "served.npz")
    for name in ("ort", "ov"):
        got_image, got_text = served[name + "_image"], served[name + "_text"]
        assert got_image.shape == want_image.shape and got_image.dtype == np.float32
        assert max_relative_difference(got_image, want_image) < 1e-5
        assert max_relative_difference(got_text, want_text) < 1e-5
    assert max_relative_difference(served["ov_first"], want_image[:2]) < 1e-5


def test_quantize_command_writes_a_servable_int8_folder(tiny_export):
    from rwkv_clip.quantize import QUANTIZATION

    model, root = tiny_export
    r = _run("-m", "rwkv_clip.quantize", str(root / "onnx"), "--output", str(root / "int8"))
    assert r.returncode == 0, r.stderr
    assert "smallest cosine similarity: image" in r.stdout
    names = {p.name for p in (root / "int8").iterdir()}
    assert names == {p.name for p in (root / "onnx").iterdir()}
    config = json.loads((root / "int8" / "onnx_config.json").read_text())
    assert config["quantization"] == QUANTIZATION
    check = _run("-X", "faulthandler", "-c", _INT8_CHECK, str(root))
    assert check.returncode == 0, (check.returncode, check.stderr[-3000:])
    min_cosine, identical, ops = json.loads(check.stdout.strip().splitlines()[-1])
    assert min_cosine > 0.98 and not identical
    assert "DynamicQuantizeMatMul" in ops or "MatMulInteger" in ops


_INT8_CHECK = """
import json, sys
from pathlib import Path
import numpy as np
import onnx
from rwkv_clip.onnx import OnnxCLIP
from rwkv_clip.quantize import QUANTIZATION
root = Path(sys.argv[1])
int8, fp32 = OnnxCLIP(root / "int8"), OnnxCLIP(root / "onnx")
assert int8.quantization == QUANTIZATION and fp32.quantization is None
size = fp32.image_size
image = np.random.default_rng(1).standard_normal((8, 3, size, size), np.float32)
a, b = fp32.encode_image(image), int8.encode_image(image)
cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
ops = sorted({n.op_type for n in onnx.load(str(root / "int8" / "image_encoder.onnx")).graph.node})
print(json.dumps([float(cosine.min()), bool(np.array_equal(a, b)), ops]))
"""


@pytest.mark.parametrize("args,message", [
    (["{root}/tiny.pt", "--output", "{root}/x"],
     "onnx_config.json does not exist: expected a folder written by python -m "
     "rwkv_clip.export CHECKPOINT --format onnx"),
    (["{root}/onnx", "--output", "{root}/onnx"], "expected another folder than the input"),
])
def test_quantize_errors_are_one_line(tiny_export, args, message):
    _, root = tiny_export
    r = _run("-m", "rwkv_clip.quantize", *(a.format(root=root) for a in args))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr


def _image_folder(root: Path) -> Path:
    colours = {"red": (220, 30, 30), "blue": (30, 40, 220), "green": (30, 200, 40)}
    for name, rgb in colours.items():
        (root / name).mkdir(parents=True)
        for i in range(3):
            shade = tuple(max(0, c - 25 * i) for c in rgb)
            Image.new("RGB", (20 + 4 * i, 20), shade).save(root / name / f"{i}.png")
    return root


@pytest.mark.slow
def test_zero_shot_onnx_scores_like_the_checkpoint(tiny_export, tmp_path):
    """The export, in both runtimes, gets the checkpoint's logits, hence its metrics."""
    _, root = tiny_export
    folder = _image_folder(tmp_path / "images")
    common = ["--dataset", "imagefolder", "--data-root", str(folder), "--workers", "0"]
    results = {}
    for label, model in (("pt", ["--model-weight", str(root / "tiny.pt"), "--config",
                                 "RWKV_CLIP_tiny"]),
                         ("ort", ["--onnx", str(root / "onnx")]),
                         ("ov", ["--onnx", str(root / "onnx"), "--onnx-runtime", "openvino"])):
        out = tmp_path / label
        r = _run("zero_shot.py", *model, *common, "--output-dir", str(out))
        assert r.returncode == 0, r.stderr
        record = json.loads((out / "imagefolder_zeroshot_classification.json").read_text())
        results[label] = record["metrics"]
    assert results["ort"] == results["pt"] and results["ov"] == results["pt"]


def test_zero_shot_onnx_with_weights_is_one_line(tiny_export):
    _, root = tiny_export
    r = _run("zero_shot.py", "--onnx", str(root / "onnx"), "--model-weight",
             str(root / "tiny.pt"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert f"--onnx {root / 'onnx'} is the model: drop --model-weight" in r.stderr


@pytest.mark.slow
def test_bench_serving_json(tmp_path):
    """One small case of the serving benchmark: both sides timed, paired ratios kept."""
    out = tmp_path / "serving.json"
    r = _run("scripts/bench_serving.py", "--pairs", "b32", "--towers", "text", "--runtimes",
             "onnxruntime", "--precisions", "fp32", "--batch-sizes", "1", "--repeats", "2",
             "--warmup", "0", "--threads", "1", "--work", str(tmp_path / "work"),
             "--out", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["machine"]["cores"] >= 1 and result["threads"] == 1
    (case,) = result["cases"]
    assert case["pair"] == "b32" and case["tower"] == "text" and case["batch"] == 1
    ours, theirs = case["rwkv_clip"]["step_s"], case["open_clip"]["step_s"]
    paired = [t / o for o, t in zip(ours, theirs, strict=True)]
    assert case["ratio_range"] == [min(paired), max(paired)] and len(paired) == 2
    assert case["rwkv_clip"]["median_ms"] > 0 and case["open_clip"]["median_ms"] > 0
    bad = _run("scripts/bench_serving.py", "--pairs", "b64")
    assert bad.returncode == 2 and "--pairs 'b64'" in bad.stderr
