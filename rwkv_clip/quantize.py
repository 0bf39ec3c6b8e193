"""``python -m rwkv_clip.quantize ONNX_DIR --output INT8_DIR``: INT8 encoders for serving.

Reads a folder of ``python -m rwkv_clip.export ... --format onnx`` and writes the same
folder with both encoders quantised by onnxruntime's dynamic quantisation: the weights of
every matrix product with a 2-D weight (the linear layers and the LoRAs) as per-channel
int8, activations quantised per call. The WKV, norms and glue stay float32.
:class:`rwkv_clip.onnx.OnnxCLIP` serves the result as it serves the float32 folder.
"""
from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .errors import CheckpointError, OneLineArgumentParser, run_cli

QUANTIZATION = ("int8 dynamic (onnxruntime.quantization.quantize_dynamic): per-channel "
                "int8 weights of the products with 2-D weights, uint8 activations per call")
ENCODERS = ("image_encoder", "text_encoder")


def weight_products(path: Path) -> list[str]:
    """The MatMul / Gemm nodes of ``path`` whose second input is a 2-D weight (an
    initializer): the ones quantised. Products of two activations (the WKV's) and the
    LoRAs' stacked 3-D weights are left in float32."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    ranks = {init.name: len(init.dims) for init in model.graph.initializer}
    return [node.name for node in model.graph.node
            if node.op_type in ("MatMul", "Gemm") and ranks.get(node.input[1]) == 2]


def quantize_encoder(src: Path, dst: Path) -> Path:
    """One ``.onnx`` encoder -> its INT8 copy at ``dst`` (written whole, then renamed)."""
    try:
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError:
        raise CheckpointError("quantising needs onnxruntime: pip install onnxruntime "
                              "(or pip install 'rwkv-clip[onnx]')") from None
    tmp = dst.with_name(dst.name + ".tmp")
    quantize_dynamic(src, tmp, weight_type=QuantType.QInt8, per_channel=True,
                     nodes_to_quantize=weight_products(src))
    tmp.chmod(0o644)
    tmp.replace(dst)
    return dst


def quantize_folder(src: str | Path, dst: str | Path) -> dict[str, Path]:
    """Quantise the encoders of the ONNX folder ``src`` into ``dst`` (configs copied,
    ``onnx_config.json`` naming the quantisation); returns the written paths by name."""
    from .hub import write_json
    from .json_files import read_json_object
    from .onnx import ONNX_CONFIG_FILE

    src, dst = Path(src), Path(dst)
    config = read_json_object(src / ONNX_CONFIG_FILE, missing_hint="expected a folder "
                              "written by python -m rwkv_clip.export CHECKPOINT --format onnx")
    if config.get("quantization"):
        raise CheckpointError(f"{src} is quantised already ({config['quantization']})")
    if src.resolve() == dst.resolve():
        raise CheckpointError(f"--output {dst}: expected another folder than the input")
    dst.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in ENCODERS:
        model = src / config[name]
        if not model.is_file():
            raise CheckpointError(f"{model} does not exist (named in {ONNX_CONFIG_FILE})")
        written[name] = quantize_encoder(model, dst / config[name])
    for other in src.glob("*.json"):
        if other.name != ONNX_CONFIG_FILE:
            written[other.stem] = Path(shutil.copyfile(other, dst / other.name))
    written["onnx_config"] = write_json(dst / ONNX_CONFIG_FILE,
                                        {**config, "quantization": QUANTIZATION})
    return written


def feature_agreement(fp32_dir: Path, int8_dir: Path, batch: int = 8, seed: int = 0
                      ) -> dict[str, float]:
    """The smallest cosine similarity between the float32 and the INT8 features of random
    inputs (token ids within the model config's vocabulary), per encoder (``image``,
    ``text``)."""
    from .hub import MODEL_CONFIG_FILE
    from .json_files import read_json_object
    from .onnx import OnnxCLIP

    fp32, int8 = OnnxCLIP(fp32_dir), OnnxCLIP(int8_dir)
    rng = np.random.default_rng(seed)
    image = rng.standard_normal((batch, 3, fp32.image_size, fp32.image_size), np.float32)
    vocab = int(read_json_object(fp32_dir / MODEL_CONFIG_FILE).get("vocab_size", 49408))
    text = rng.integers(1, vocab, (batch, fp32.context_length))
    result = {}
    for name, a, b in (("image", fp32.encode_image(image), int8.encode_image(image)),
                       ("text", fp32.encode_text(text), int8.encode_text(text))):
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        result[name] = float(cos.min())
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = OneLineArgumentParser(prog="python -m rwkv_clip.quantize",
                               description=__doc__.split("\n")[0])
    ap.add_argument("folder", help="a folder of python -m rwkv_clip.export ... --format onnx")
    ap.add_argument("--output", required=True, help="the folder to write the INT8 encoders to")
    ap.add_argument("--no-verify", dest="verify", action="store_false",
                    help="skip comparing the INT8 features with the float32 ones")
    ns = ap.parse_args(argv)

    def run() -> int:
        written = quantize_folder(ns.folder, ns.output)
        sizes = ", ".join(f"{written[n].name} {written[n].stat().st_size / 2**20:.1f} MiB"
                          for n in ENCODERS)
        print(f"wrote {ns.output}: {sizes} ({QUANTIZATION})", flush=True)
        if ns.verify:
            agreement = feature_agreement(Path(ns.folder), Path(ns.output))
            print("INT8 vs float32 features on random inputs, smallest cosine similarity: "
                  + ", ".join(f"{k} {v:.4f}" for k, v in agreement.items()), flush=True)
        return 0

    return run_cli(run, prog="python -m rwkv_clip.quantize")


__all__ = ["QUANTIZATION", "quantize_encoder", "quantize_folder", "feature_agreement", "weight_products"]

if __name__ == "__main__":
    sys.exit(main())
