"""The original's evaluation protocol: per-set preprocessing (ImageNet's resize + crop
against an independent PIL computation and against DALI's own operators), ImageNet from
val.rec + val.idx, fp32 compute whatever --precision says, and how architecture flags
combine with the chosen config."""
import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from rwkv_clip.config import load_model_configs
from rwkv_clip.data import DataError, IRHeader, RecordIOWriter, pack
from rwkv_clip.eval import eval_transform
from rwkv_clip.transform import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

TINY = "RWKV_CLIP_tiny"


def random_image(w, h, seed=0):
    rng = np.random.default_rng(seed)
    small = (rng.random((h // 4 + 1, w // 4 + 1, 3)) * 255).astype(np.uint8)
    return Image.fromarray(small).resize((w, h), Image.BICUBIC)  # smooth, non-trivial content


def imagenet_by_hand(img, s):
    """The paper's evaluation protocol, computed independently with PIL and numpy."""
    short_target = int(256 / 224 * s)
    w, h = img.size
    if w <= h:
        new_w, new_h = short_target, math.floor(h * short_target / w + 0.5)
    else:
        new_w, new_h = math.floor(w * short_target / h + 0.5), short_target
    resized = np.asarray(img.convert("RGB").resize((new_w, new_h), Image.Resampling.BILINEAR),
                         dtype=np.float64)
    top = math.floor((new_h - s) / 2 + 0.5)
    left = math.floor((new_w - s) / 2 + 0.5)
    crop = resized[top:top + s, left:left + s] / 255.0
    out = (crop - np.array(OPENAI_DATASET_MEAN)) / np.array(OPENAI_DATASET_STD)
    return torch.from_numpy(out.transpose(2, 0, 1).astype(np.float32))


@pytest.mark.parametrize("wh", [(61, 40), (40, 61), (301, 97), (20, 27), (48, 48)])
def test_imagenet_transform_matches_pil(wh):
    img = random_image(*wh, seed=wh[0])
    out = eval_transform("imagenet", 32)(img)
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    torch.testing.assert_close(out, imagenet_by_hand(img, 32), rtol=0, atol=1e-5)


def test_imagenet_sizes_and_offsets():
    t = eval_transform("imagenet", 224)
    assert t.resize_to == 256
    assert t.resized_size(500, 375) == (341, 256)  # 500 * 256 / 375 = 341.33
    assert t.resized_size(375, 500) == (256, 341)
    assert t.resized_size(501, 333) == (385, 256)  # 385.15
    assert eval_transform("imagenet1k", 32).resize_to == 36  # int(256 / 224 * 32)


@pytest.mark.parametrize("name", ["cifar10", "sun397", "imagefolder", "mscoco", "flickr30k"])
def test_other_sets_keep_open_clip_transform(name):
    from open_clip.transform import image_transform

    reference = image_transform(32, is_train=False, mean=OPENAI_DATASET_MEAN,
                                std=OPENAI_DATASET_STD)
    for wh in ((61, 40), (30, 70)):
        img = random_image(*wh, seed=1)
        assert torch.equal(eval_transform(name, 32)(img), reference(img))
    # and it is not the ImageNet protocol
    img = random_image(61, 40)
    assert not torch.allclose(eval_transform(name, 32)(img), eval_transform("imagenet", 32)(img))


def smooth_image(w, h, seed=0):
    """Photo-like content: random colours at 1/8 resolution, bilinearly enlarged."""
    rng = np.random.default_rng(seed)
    small = (rng.random((h // 8 + 1, w // 8 + 1, 3)) * 255).astype(np.uint8)
    return Image.fromarray(small).resize((w, h), Image.BILINEAR)


def test_imagenet_transform_matches_dali(tmp_path):
    """DALI's CPU operators configured as the original's val pipeline: the same output
    size and crop window; pixels within the two filter implementations' difference
    (PIL rounds to 8 bits; measured max 2/255, mean 0.15/255 on such images)."""
    pytest.importorskip("nvidia.dali")
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali.pipeline import Pipeline

    s, sizes = 224, [(501, 333), (333, 501), (300, 300), (200, 150)]
    files = []
    for i, wh in enumerate(sizes):
        files.append(str(tmp_path / f"{i}.png"))
        smooth_image(*wh, seed=i).save(files[-1])
    pipe = Pipeline(batch_size=1, num_threads=1, device_id=None)
    with pipe:
        data, _ = fn.readers.file(files=files, labels=list(range(len(files))))
        images = fn.decoders.image(data, device="cpu", output_type=types.RGB)
        images = fn.resize(images, size=int(256 / 224 * s), mode="not_smaller",
                           interp_type=types.INTERP_TRIANGULAR)
        images = fn.crop_mirror_normalize(
            images, dtype=types.FLOAT, output_layout="CHW", crop=(s, s),
            mean=[m * 255 for m in OPENAI_DATASET_MEAN], std=[v * 255 for v in OPENAI_DATASET_STD])
        pipe.set_outputs(images)
    pipe.build()
    std = torch.tensor(OPENAI_DATASET_STD).view(3, 1, 1)
    for path in files:
        (out,) = pipe.run()
        dali = torch.from_numpy(np.array(out.as_array()[0]))
        ours = eval_transform("imagenet", s)(Image.open(path))
        assert dali.shape == ours.shape
        diff = ((dali - ours) * std).abs() * 255  # in 8-bit levels
        assert diff.max().item() <= 3.01 and diff.mean().item() <= 0.4
        # a crop one pixel off is far worse: the comparison can tell
        shifted = eval_transform("imagenet", s + 2)(Image.open(path))[:, 1:-1, 2:]
        assert ((dali - shifted) * std).abs().mul(255).mean().item() > 1.0


# ---------------------------------------------------------------- ImageNet from val.rec
def jpeg(img):
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def write_imagenet_rec(folder, labels, images, header_label=True):
    folder.mkdir(parents=True, exist_ok=True)
    with RecordIOWriter(str(folder / "val.rec"), str(folder / "val.idx")) as w:
        for key, (label, data) in enumerate(zip(labels, images, strict=True)):
            if header_label:  # im2rec's layout: flag 0, the class index in the header
                w.write(key, pack(IRHeader(0, float(label), key, 0), None, data))
            else:  # a label vector whose first entry is the class
                w.write(key, pack(IRHeader(0, 0.0, key, 0), np.array([label, 0.0]), data))


@pytest.mark.parametrize("header_label", [True, False])
def test_imagenet_from_val_rec(tmp_path, header_label):
    from rwkv_clip.eval.datasets import build_classification_set

    labels = [3, 999, 0, 500]
    pictures = [random_image(40 + 7 * i, 60 - 5 * i, seed=i) for i in range(4)]
    blobs = [jpeg(p) for p in pictures]
    write_imagenet_rec(tmp_path / "imagenet", labels, blobs, header_label)
    transform = eval_transform("imagenet", 32)
    s = build_classification_set("imagenet", tmp_path, transform)
    assert len(s) == 4 and s.num_classes == 1000
    for i in range(4):
        image, target = s.dataset[i]
        assert target == labels[i]
        assert torch.equal(image, transform(Image.open(io.BytesIO(blobs[i]))))
    assert "val.rec record 1" in s.describe(1)


def test_imagenet_rec_bad_input(tmp_path):
    from rwkv_clip.errors import DatasetNotFoundError
    from rwkv_clip.eval.datasets import build_classification_set

    good = jpeg(random_image(40, 30))
    write_imagenet_rec(tmp_path / "imagenet", [1, 1000, 2], [good, good, good[:50]])
    s = build_classification_set("imagenet", tmp_path, eval_transform("imagenet", 32))
    with pytest.raises(DataError, match=r"label 1000.0 is not a class index \(0..999\).*val.rec"):
        s.dataset[1]
    with pytest.raises(DataError, match=r"undecodable image.*val.rec.*record: 2"):
        s.dataset[2]
    (tmp_path / "imagenet" / "val.idx").unlink()
    with pytest.raises(DataError, match="index file not found.*val.idx"):
        build_classification_set("imagenet", tmp_path, None)
    with pytest.raises(DatasetNotFoundError, match="val.rec"):
        build_classification_set("imagenet", tmp_path / "nothing", None)


def test_cli_imagenet_rec_end_to_end(tmp_path, capsys):
    from zero_shot import main

    write_imagenet_rec(tmp_path / "data" / "imagenet", [5, 7],
                       [jpeg(random_image(50, 40, seed=i)) for i in range(2)])
    (tmp_path / "t.json").write_text(json.dumps(["a photo of a {}."]))
    rc = main(["--config", TINY, "--dataset", "imagenet", "--data-root", str(tmp_path / "data"),
               "--templates", str(tmp_path / "t.json"), "--device", "cpu", "--workers", "0",
               "--output-dir", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "256/224" in out  # the protocol line names the ImageNet resize
    record = json.loads((tmp_path / "out" / "imagenet_zeroshot_classification.json").read_text())
    assert record["num_samples"] == 2


# ---------------------------------------------------------------- precision
def encode(opts, dataset):
    from rwkv_clip.distributed import DistInfo
    from rwkv_clip.eval.common import encode_image_shard
    from rwkv_clip.eval.runner import build_eval_model, evaluation_precision

    info = DistInfo()
    model, *_ = build_eval_model(opts, torch.device("cpu"), info)
    _, _, feats = encode_image_shard(model, dataset, torch.device("cpu"), batch_size=3,
                                     precision=evaluation_precision(opts), info=info)
    return feats


def test_fp32_whatever_precision_says():
    from rwkv_clip.eval.cli import parse_options

    torch.manual_seed(0)
    images = [(torch.randn(3, 16, 16), 0) for _ in range(5)]
    base = ["--config", TINY, "--device", "cpu", "--wkv-backend", "reference"]
    fp32 = encode(parse_options(base + ["--precision", "fp32"]), images)
    for precision in ("bf16", "fp16"):
        assert torch.equal(encode(parse_options(base + ["--precision", precision]), images), fp32)
    amp = encode(parse_options(base + ["--precision", "bf16", "--amp", "bf16"]), images)
    assert not torch.equal(amp, fp32)  # the opt-in does change the arithmetic
    torch.testing.assert_close(amp, fp32, rtol=0, atol=5e-2)


# ---------------------------------------------------------------- config resolution
SHELL_B32_FLAGS = ["--image-num-heads", "8", "--model-type", "V_T_rwkv", "--model-name",
                   "ViT-B-32-384", "--batch-size", "120", "--dropout", "0.0",
                   "--precision", "bf16", "--image-depth", "12", "--image-embed-dims", "640",
                   "--image-patch-size", "32", "--image-hidden-rate", "5", "--ctx-len", "77",
                   "--vocab-size", "49408", "--head-size", "64", "--head-size-divisor", "8",
                   "--n-embd", "640", "--n-layer", "6", "--text-initialization", "True"]


def test_original_shell_flags_resolve_to_b32():
    """shell/test_zero_shot_*.sh pass these (no --input-size, no --config) with the B/32
    checkpoint: the config fitting the checkpoint with those flags is exactly B/32."""
    from rwkv_clip import create_RWKV_Model, load_model_configs
    from rwkv_clip.config import ModelArgs, apply_overrides, read_config_json
    from rwkv_clip.eval.cli import parse_options
    from rwkv_clip.eval.runner import _arch_overrides
    from rwkv_clip.factory import infer_config

    overrides = _arch_overrides(parse_options(SHELL_B32_FLAGS))
    with torch.device("meta"):
        b32 = create_RWKV_Model(load_model_configs("RWKV_CLIP_B32")).state_dict()
    assert infer_config(b32, overrides) == "RWKV_CLIP_B32"
    resolved = ModelArgs.from_dict(apply_overrides(read_config_json("RWKV_CLIP_B32")[0],
                                                    overrides))
    assert vars(resolved) == vars(load_model_configs("RWKV_CLIP_B32"))


def test_single_flag_overrides_small_default():
    from rwkv_clip.distributed import DistInfo
    from rwkv_clip.eval.cli import parse_options
    from rwkv_clip.eval.runner import build_eval_model

    opts = parse_options(["--image-depth", "3", "--device", "cpu"])
    model, args, name, _ = build_eval_model(opts, torch.device("cpu"), DistInfo())
    assert name == "RWKV_CLIP_small" and args.image_depth == 3
    small = load_model_configs("RWKV_CLIP_small")  # the rest: small's
    assert (args.image_embed_dims, args.input_size) == (small.image_embed_dims, small.input_size)
    assert len(model.image_model.layers) == 3


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P", "CMYK", "I;16"])
@pytest.mark.parametrize("wh,size", [((61, 40), 32), ((30, 70), 32), ((32, 32), 32),
                                     ((33, 17), 16), ((7, 9), 24), ((225, 224), 224)])
def test_eval_transform_equals_open_clips_in_every_value(mode, wh, size):
    """EvalTransform computes open_clip's eval transform without importing it (or
    torchvision): the same tensor for any size, aspect and PIL mode, upscaling included."""
    from open_clip.transform import image_transform as open_clip_transform

    from rwkv_clip.transform import EvalTransform

    img = random_image(*wh, seed=sum(wh))
    img = img.convert(mode) if mode != "I;16" else Image.fromarray(
        np.asarray(img.convert("L"), np.uint16) * 257)
    ours = EvalTransform(size)
    reference = open_clip_transform(size, is_train=False, mean=OPENAI_DATASET_MEAN,
                                    std=OPENAI_DATASET_STD)
    assert torch.equal(ours(img), reference(img))
    tensor = reference(img)  # a tensor input goes through open_clip's own transform
    assert torch.equal(ours(tensor), reference(tensor))


def test_eval_transform_imports_neither_open_clip_nor_torchvision():
    code = ("import sys\nfrom PIL import Image\nfrom rwkv_clip.transform import EvalTransform\n"
            "x = EvalTransform(16)(Image.new('RGB', (20, 30)))\n"
            "assert x.shape == (3, 16, 16), x.shape\n"
            "print(sorted(m for m in ('open_clip', 'torchvision') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
