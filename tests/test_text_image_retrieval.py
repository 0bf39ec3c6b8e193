"""text_image_retrieval.py with the flags the original's shell/test_zero_shot_retrieval.sh
passes (the tiny model's values, no --config, no --input-size, --precision bf16), plus
--data-root, on a tiny set in the original's COCO layout."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
TINY = "RWKV_CLIP_tiny"
COLOURS = {"red": (220, 20, 20), "green": (20, 200, 30), "blue": (30, 40, 210)}


def make_coco(root: Path) -> None:
    """coco_karpathy_test.json as the original's dataloaders/coco.py reads it (a list of
    {"image": "val2014/<file>", "caption": [...]}) and the images under val2014/."""
    rng = np.random.default_rng(0)
    (root / "val2014").mkdir(parents=True)
    entries = []
    for i, (name, colour) in enumerate(COLOURS.items()):
        file = f"COCO_val2014_{i:012d}.jpg"
        pixels = np.clip(np.array(colour) * rng.uniform(0.7, 1.0, (30, 40, 1)), 0, 255)
        Image.fromarray(pixels.astype(np.uint8)).save(root / "val2014" / file)
        entries.append({"image": f"val2014/{file}",
                        "caption": [f"a {name} picture", f"something {name}"]})
    (root / "coco_karpathy_test.json").write_text(json.dumps(entries))


def test_original_retrieval_flags_on_coco_layout(tmp_path):
    torch.manual_seed(4)
    from rwkv_clip import create_RWKV_Model, load_model_configs
    model = create_RWKV_Model(load_model_configs(TINY))
    weights = tmp_path / "model_31.pt"
    torch.save({"module." + k: v for k, v in model.state_dict().items()}, weights)
    make_coco(tmp_path / "coco")
    out_file = tmp_path / "out" / "retrieval.txt"
    (tmp_path / "out").mkdir()
    flags = ["--image-num-heads", 2, "--batch-size", 4, "--model-type", "V_T_rwkv",
             "--model-name", "ViT-B-32-384", "--model-weight", weights, "--dataset", "coco",
             "--output-dir", out_file, "--dropout", 0.0, "--precision", "bf16",
             "--image-depth", 2, "--image-embed-dims", 64, "--image-patch-size", 4,
             "--image-hidden-rate", 1, "--ctx-len", 77, "--vocab-size", 49408,
             "--head-size", 32, "--head-size-divisor", 8, "--n-embd", 64, "--n-layer", 2,
             "--text-initialization", "True"]
    # one data root for every set, as the shell script has: the set is its coco/ sub-folder
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "text_image_retrieval.py", *map(str, flags),
                        "--data-root", str(tmp_path), "--workers", "0"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "RWKV_CLIP_tiny (inferred" in r.stdout and "computing in fp32" in r.stdout
    record = json.loads((tmp_path / "out" / "mscoco_zeroshot_retrieval.json").read_text())
    assert record["task"] == "zeroshot_retrieval" and record["model"] == "ViT-B-32-384"
    assert record["num_images"] == 3 and record["num_texts"] == 6
    metrics = record["metrics"]
    assert metrics["image_retrieval_recall@5"] == 1.0  # only 3 images to rank
    values = [float(v) for v in out_file.read_text().strip().split(",")]
    assert len(values) == 6  # the original's line: I2T R@1,5,10 then T2I R@1,5,10
    assert values[0] == round(100 * metrics["text_retrieval_recall@1"], 4)
    assert values[3] == round(100 * metrics["image_retrieval_recall@1"], 4)


def test_retrieval_cli_errors_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "text_image_retrieval.py", "--config", TINY,
                        "--dataset", "flickr", "--data-root", str(tmp_path), "--device", "cpu",
                        "--output-dir", str(tmp_path / "o")], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()  # one error line; details indented below it
    assert lines[0].startswith("text_image_retrieval.py: error:")
    assert all(line.startswith("  ") for line in lines[1:]), r.stderr
    assert "flickr30k_test.json" in r.stderr
