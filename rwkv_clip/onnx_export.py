"""RWKV-CLIP -> two ONNX encoders (``image_encoder.onnx``, ``text_encoder.onnx``).

Each tower is captured with ``torch.export`` (dynamic batch), its operators replaced by
plain PyTorch (:func:`export_decompositions`) and written by ``torch.onnx.export``. Needs
``onnx`` and ``onnxscript`` (``pip install rwkv-clip[onnx]``); checks need ``onnxruntime``.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .errors import CheckpointError
from .ops.chunked_plain import wkv6_bidirectional_chunked_plain

IMAGE_FILE = "image_encoder.onnx"
TEXT_FILE = "text_encoder.onnx"
ONNX_CONFIG_FILE = "onnx_config.json"
EXPORT_BATCH = 2  # the example batch traced; the batch dimension stays dynamic
PROTOBUF_LIMIT = 1_800_000_000  # bytes of weights one .onnx file may hold (protobuf: 2 GiB)
VERIFY_TOLERANCE = 1e-4  # max |onnxruntime - PyTorch| / max |PyTorch feature|


# up to this many tokens a shift is one product with (parts, T, T) 0/1 matrices (few large
# operators); past it, whose matrices would grow as T^2, a pad and a slice per part
MATRIX_SHIFT_TOKENS = 256


def _move_matrix(sources: np.ndarray) -> torch.Tensor:
    """(P, T) source token per part and token (-1: none) -> (P, T, T) 0/1 matrices with
    ``out[p, t] = x[p, sources[p, t]]`` as one product (exact: one term per sum)."""
    parts, T = sources.shape
    matrix = np.zeros((parts, T, T), dtype=np.float32)
    p, t = np.nonzero(sources >= 0)
    matrix[p, t, sources[p, t]] = 1.0
    return torch.from_numpy(matrix)


def _shift_parts(x: torch.Tensor, sources: np.ndarray) -> torch.Tensor:
    """x (B, T, heads, head_dim) with each head cut into P equal parts; part p of token t
    taken from token ``sources[p, t]`` (zeros where -1): one batched product of 0/1
    matrices, a few large operators instead of a slice and a copy per part."""
    B, T, heads, hd = x.shape
    parts = sources.shape[0]
    xp = x.reshape(-1, T, heads, parts, hd // parts).permute(0, 3, 1, 2, 4)
    moved = torch.matmul(_move_matrix(sources).to(x.dtype), xp.reshape(-1, parts, T,
                                                                      heads * hd // parts))
    moved = moved.reshape(-1, parts, T, heads, hd // parts).permute(0, 2, 3, 1, 4)
    return moved.reshape(x.shape)


def _source(index: np.ndarray, offset: int, size: int) -> np.ndarray:
    """index - offset where that stays in [0, size), else -1 (out[i] = x[i - offset])."""
    source = index - offset
    return np.where((source >= 0) & (source < size), source, -1)


def _q_shift(grid: torch.Tensor, s: int, adjoint: bool) -> torch.Tensor:
    """``rwkv_clip::q_shift``: quarters of each head from the left, right, up, down pixel."""
    B, H, W, heads, hd = grid.shape
    sign = -1 if adjoint else 1
    if hd % 4 or H * W > MATRIX_SHIFT_TOKENS:  # slices and concatenations
        return _q_shift_slices(grid, s, adjoint)
    row, col = np.divmod(np.arange(H * W), W)
    from_col = lambda off: np.where(_source(col, off, W) >= 0, row * W + col - off, -1)
    from_row = lambda off: np.where(_source(row, off, H) >= 0, (row - off) * W + col, -1)
    sources = np.stack((from_col(sign * s), from_col(-sign * s), from_row(sign * s),
                        from_row(-sign * s)))
    return _shift_parts(grid.reshape(-1, H * W, heads, hd), sources).reshape(grid.shape)


def _sequence_shift(seq: torch.Tensor, s: int, adjoint: bool) -> torch.Tensor:
    """``rwkv_clip::sequence_shift``: first half of each head from t - s, second from t + s."""
    T, hd = seq.shape[1], seq.shape[3]
    sign = -1 if adjoint else 1
    if hd % 2 or T > MATRIX_SHIFT_TOKENS:
        return _sequence_shift_slices(seq, s, adjoint)
    t = np.arange(T)
    return _shift_parts(seq, np.stack((_source(t, sign * s, T), _source(t, -sign * s, T))))


def _shifted(x: torch.Tensor, dim: int, offset: int) -> torch.Tensor:
    """x moved by ``offset`` along ``dim`` (out[i] = x[i - offset]), zeros where it has no
    source: a pad and a slice."""
    n, s = x.shape[dim], abs(offset)
    pad = [0, 0] * (x.dim() - dim - 1) + ([s, 0] if offset > 0 else [0, s])
    return F.pad(x, pad).narrow(dim, 0 if offset > 0 else s, n)


def _q_shift_slices(grid: torch.Tensor, s: int, adjoint: bool) -> torch.Tensor:
    q, sign = grid.shape[4] // 4, -1 if adjoint else 1
    left, right, up, down = grid.split([q, q, q, grid.shape[4] - 3 * q], dim=4)
    return torch.cat((_shifted(left, 2, sign * s), _shifted(right, 2, -sign * s),
                      _shifted(up, 1, sign * s), _shifted(down, 1, -sign * s)), dim=4)


def _sequence_shift_slices(seq: torch.Tensor, s: int, adjoint: bool) -> torch.Tensor:
    half, sign = seq.shape[3] // 2, -1 if adjoint else 1
    back, ahead = seq.split([half, seq.shape[3] - half], dim=3)
    return torch.cat((_shifted(back, 1, sign * s), _shifted(ahead, 1, -sign * s)), dim=3)


def _square(x: torch.Tensor) -> torch.Tensor:
    # the squared ReLU's square as one multiplication (onnxruntime's Pow is slower)
    return x * x


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # three operators; torch's decomposition picks between two formulas per element
    return start + weight * (end - start)


def _wkv(r, k, v, w, u, cuda_variant: str = "") -> torch.Tensor:
    return wkv6_bidirectional_chunked_plain(r, k, v, w, u)


def _onednn_linear(x, weight, bias, *rest) -> torch.Tensor:
    return F.linear(x, weight, bias)


def export_decompositions() -> dict[Any, Callable]:
    """The package's operators as exportable PyTorch (``ExportedProgram.run_decompositions``):
    the WKV by its chunked form in plain operators
    (:func:`rwkv_clip.ops.chunked_plain.wkv6_bidirectional_chunked_plain`),
    the token shifts by products with 0/1 matrices (pads and slices past
    ``MATRIX_SHIFT_TOKENS``), the oneDNN linear by ``F.linear``; ``torch.lerp`` and
    ``torch.square`` by the fewer operators onnxruntime runs faster."""
    from .ops import kernels as _wkv_ops  # noqa: F401 - registers rwkv_clip::wkv6_forward
    from .ops import products as _linear_ops  # noqa: F401 - registers rwkv_clip::onednn_linear
    from .ops import shift as _shift_ops  # noqa: F401 - registers the shift operators

    table: dict[Any, Callable] = {
        torch.ops.rwkv_clip.wkv6_forward.default: _wkv,
        torch.ops.rwkv_clip.q_shift.default: _q_shift,
        torch.ops.rwkv_clip.sequence_shift.default: _sequence_shift,
        torch.ops.rwkv_clip.onednn_linear.default: _onednn_linear,
        torch.ops.aten.lerp.Tensor: _lerp,
        torch.ops.aten.square.default: _square,
    }
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):  # eager inference calls it directly
        table[torch.ops.mkldnn._linear_pointwise.default] = _onednn_linear
    return table


class ImageEncoder(nn.Module):
    """``model.encode_image`` as a module of one input (what is exported)."""

    def __init__(self, model: Any, normalize: bool = False) -> None:
        super().__init__()
        self.model, self.normalize = model, normalize

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(image, normalize=self.normalize)


class TextEncoder(nn.Module):
    """``model.encode_text`` as a module of one input (what is exported)."""

    def __init__(self, model: Any, normalize: bool = False) -> None:
        super().__init__()
        self.model, self.normalize = model, normalize

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        return self.model.encode_text(text, normalize=self.normalize)


def model_input_shapes(model: Any) -> tuple[int, int]:
    """``(image size, context length)`` the model was built for."""
    from .eval.zeroshot import model_input_size

    return model_input_size(model), int(model.text_model.args.ctx_len)


def example_inputs(model: Any, batch: int, seed: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random normalised-looking images and token ids of the model's shapes."""
    size, ctx_len = model_input_shapes(model)
    g = torch.Generator().manual_seed(seed)
    vocab = int(model.text_model.emb.num_embeddings)
    return (torch.randn(batch, 3, size, size, generator=g),
            torch.randint(1, vocab, (batch, ctx_len), generator=g))


def require_exporter() -> None:
    """Raise one error naming the missing packages unless onnx and onnxscript import."""
    missing = []
    for name in ("onnx", "onnxscript"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise CheckpointError(f"ONNX export needs {' and '.join(missing)}: pip install "
                              "'rwkv-clip[onnx]' (or pip install onnx onnxscript onnxruntime)")


def export_module(module: nn.Module, example: torch.Tensor, name: str, path: Path) -> Path:
    """``module(example)`` -> ONNX at ``path`` with a dynamic batch; input ``name``,
    output ``features``."""
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},),
                                  strict=False)
    program = program.run_decompositions(export_decompositions())
    # one self-contained file unless the weights pass protobuf's 2 GB limit: then they go
    # to PATH.data beside it (written in place, where onnxruntime looks for them)
    weight_bytes = sum(t.numel() * t.element_size() for t in program.state_dict.values())
    if weight_bytes > PROTOBUF_LIMIT:
        torch.onnx.export(program, (example,), str(path), dynamo=True, input_names=[name],
                          output_names=["features"], external_data=True, optimize=True,
                          verbose=False)
        for written in path.parent.glob(path.name + "*"):
            os.chmod(written, 0o644)
        return path
    tmp = path.with_name(path.name + ".tmp")
    torch.onnx.export(program, (example,), str(tmp), dynamo=True, input_names=[name],
                      output_names=["features"], external_data=False, optimize=True,
                      verbose=False)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def export_onnx(model: Any, out_dir: str | os.PathLike, model_config: dict[str, Any],
                normalize: bool = False) -> dict[str, Path]:
    """Write ``image_encoder.onnx``, ``text_encoder.onnx``, the model config, the
    preprocessing config and ``onnx_config.json`` (inputs, shapes, ``normalize``) into
    ``out_dir``; returns the written paths by name."""
    from .hub import write_config_files, write_json

    require_exporter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    was_training = model.training
    model.eval()
    image, text = example_inputs(model, EXPORT_BATCH)
    size, ctx_len = model_input_shapes(model)
    try:
        written = {"image_encoder": export_module(ImageEncoder(model, normalize), image,
                                                  "image", out / IMAGE_FILE),
                   "text_encoder": export_module(TextEncoder(model, normalize), text, "text",
                                                 out / TEXT_FILE)}
    finally:
        model.train(was_training)
    written.update(write_config_files(out, model_config, size))
    info = {"image_encoder": IMAGE_FILE, "text_encoder": TEXT_FILE,
            "image_input": {"name": "image", "shape": ["batch", 3, size, size],
                            "dtype": "float32"},
            "text_input": {"name": "text", "shape": ["batch", ctx_len], "dtype": "int64"},
            "output": {"name": "features", "shape": ["batch", feature_width(model)],
                       "dtype": "float32"},
            "normalize": bool(normalize), "wkv": "chunked, plain operators (rwkv_clip.ops.chunked_plain)",
            **logit_head(model)}
    written["onnx_config"] = write_json(out / ONNX_CONFIG_FILE, info)
    return written


def logit_head(model: Any) -> dict[str, Any]:
    """The model's scoring head, which the encoders leave out: ``loss`` ("clip" or
    "siglip"), ``logit_scale`` (the parameter, a log) and, for SigLIP, ``logit_bias``;
    a pair's SigLIP probability is ``sigmoid(exp(logit_scale) * cosine + logit_bias)``."""
    bias = getattr(model, "logit_bias", None)
    head: dict[str, Any] = {"loss": "clip" if bias is None else "siglip",
                            "logit_scale": float(model.logit_scale.detach().float())}
    if bias is not None:
        head["logit_bias"] = float(bias.detach().float())
    return head


def feature_width(model: Any) -> int:
    return int(model.image_model.embed_dims)


def max_relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b|: the error relative to the largest magnitude of ``b``."""
    scale = float(np.abs(b).max())
    return float(np.abs(a - b).max()) / (scale if scale > 0 else 1.0)


@torch.no_grad()
def verify_onnx(model: Any, out_dir: str | os.PathLike,
                batch_sizes: Iterable[int] = (1, 7), seed: int = 1) -> dict[str, float]:
    """Run the exported encoders with onnxruntime on random inputs and compare them with
    the model in fp32: ``{"image_b1": max relative difference, ...}``."""
    from .onnx import OnnxCLIP

    session = OnnxCLIP(out_dir)
    model = model.eval()
    normalize = session.normalize
    diffs = {}
    for b in batch_sizes:
        image, text = example_inputs(model, b, seed=seed + b)
        ref_image = model.encode_image(image, normalize=normalize).float().numpy()
        ref_text = model.encode_text(text, normalize=normalize).float().numpy()
        diffs[f"image_b{b}"] = max_relative_difference(session.encode_image(image.numpy()),
                                                       ref_image)
        diffs[f"text_b{b}"] = max_relative_difference(session.encode_text(text.numpy()),
                                                      ref_text)
    return diffs


def model_from_state(state: dict[str, torch.Tensor], config: Any) -> nn.Module:
    """The model of ``config`` (a ``ModelArgs``, or a config name or path) holding
    ``state``, in eval mode; a SigLIP state dict (with ``logit_bias``) gives a model with
    that parameter."""
    from .checkpoint_files import check_state_dict
    from .config import ModelArgs, load_model_configs
    from .model import create_RWKV_Model

    args = config if isinstance(config, ModelArgs) else load_model_configs(config)
    with torch.device("meta"):
        model = create_RWKV_Model(args)
        check_state_dict(model, state, "the exported weights")
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def export_onnx_folder(state: dict[str, torch.Tensor], args: Any, config: str, out: Path,
                       normalize: bool = False, verify: bool = True) -> int:
    """The ``--format onnx`` command: export the model of ``args`` (chosen from the config
    ``config``, whose JSON the folder's config follows), then (``verify``) compare with
    onnxruntime."""
    from .config import folder_config

    model = model_from_state(state, args)
    written = export_onnx(model, out, folder_config(args, config), normalize)
    sizes = ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB"
                      for p in (written["image_encoder"], written["text_encoder"]))
    size, ctx_len = model_input_shapes(model)
    print(f"wrote {out}: {sizes}, {written['model_config'].name}, "
          f"{written['preprocess_config'].name}, {ONNX_CONFIG_FILE} (config {config}, "
          f"{'normalised' if normalize else 'raw'} features; text input [batch, {ctx_len}], "
          f"image input [batch, 3, {size}, {size}])", flush=True)
    if verify:
        diffs = verify_onnx(model, out)
        worst = max(diffs.values())
        print("onnxruntime vs PyTorch fp32, max |difference| / max |feature|: "
              + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()), flush=True)
        if worst > VERIFY_TOLERANCE:
            raise CheckpointError(f"the exported encoders in {out} differ from PyTorch by "
                                  f"{worst:.2e} of the largest feature (tolerance "
                                  f"{VERIFY_TOLERANCE:.0e})")
    return 0


__all__ = ["IMAGE_FILE", "TEXT_FILE", "ONNX_CONFIG_FILE", "ImageEncoder", "TextEncoder",
           "export_decompositions", "export_module", "require_exporter", "export_onnx", "export_onnx_folder",
           "verify_onnx", "model_from_state", "max_relative_difference", "example_inputs"]
