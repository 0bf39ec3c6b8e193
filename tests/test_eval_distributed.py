"""Sharded evaluation over 2 gloo ranks on CPU gives the 1-process results."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
TINY = "RWKV_CLIP_tiny"
TEMPLATES = ["a photo of a {}.", "{}"]


def make_data(root: Path) -> tuple[Path, Path]:
    """5 images in 2 classes (an odd count: uneven shards) and a JSONL over them."""
    rng = np.random.default_rng(1)
    folder = root / "folder"
    rows = []
    for cls, n in (("cat", 3), ("dog", 2)):
        (folder / cls).mkdir(parents=True)
        for i in range(n):
            img = rng.integers(0, 255, (16 + i, 20, 3), dtype=np.uint8)
            Image.fromarray(img).save(folder / cls / f"{i}.png")
            rows.append({"image": f"folder/{cls}/{i}.png",
                         "captions": [f"a {cls} number {i}", f"{cls}"][: 1 + i % 2]})
    jsonl = root / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, jsonl


def evaluate(folder: Path, jsonl: Path):
    from rwkv_clip import create_RWKV_Model, image_transform, load_model_configs
    from rwkv_clip.eval.datasets import image_folder_set
    from rwkv_clip.eval.retrieval import evaluate_retrieval, load_retrieval_file
    from rwkv_clip.eval.zeroshot import (
        build_classifier,
        classification_logits,
        evaluate_classification,
    )

    torch.manual_seed(11)
    model = create_RWKV_Model(load_model_configs(TINY)).eval()
    tf = image_transform(16, is_train=False)
    s = image_folder_set(folder, tf, templates=TEMPLATES)
    w = build_classifier(model, s.classnames, s.templates, "cpu")
    logits, targets = classification_logits(model, s, w, "cpu", batch_size=2)
    cls = evaluate_classification(model, s, "cpu", batch_size=2)
    ret = evaluate_retrieval(model, load_retrieval_file(jsonl), tf, "cpu", batch_size=2, text_batch_size=3)
    return {"logits": logits, "targets": targets, "cls": cls, "ret": ret}


def _worker(rank: int, world: int, port: int, folder: str, jsonl: str, out: str):
    import torch.distributed as dist
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)  # two ranks share the CPU
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from rwkv_clip.eval.distributed import current
        assert current().world_size == world
        result = evaluate(Path(folder), Path(jsonl))
        torch.save(result, f"{out}.rank{rank}")
        dist.barrier()  # leave together: gloo can abort at exit if a peer tears down first
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gather_worker(rank: int, world: int, port: int, out: str):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from rwkv_clip.eval.distributed import current, gather_rows, shard_range
        info = current()
        results = {}
        for n in (0, 1, 7):
            shard = torch.tensor(list(shard_range(n, info.rank, info.world_size)), dtype=torch.long)
            # rows computed from the global index only, in reverse order within the shard
            idx = shard.flip(0)
            rows = torch.stack([idx.float() * 0.5, idx.float() ** 2], dim=1) if len(idx) else torch.zeros(0, 2)
            labels = idx * 3
            results[n] = gather_rows(idx, labels, rows, info=info)
        torch.save(results, f"{out}.rank{rank}")
        dist.barrier()  # leave together: gloo can abort at exit if a peer tears down first
    finally:
        dist.destroy_process_group()


def test_gather_rows_two_gloo_ranks(tmp_path):
    out = str(tmp_path / "g")
    mp.start_processes(_gather_worker, args=(2, _free_port(), out), nprocs=2, join=True,
                       start_method="spawn")
    for rank in range(2):
        results = torch.load(f"{out}.rank{rank}")
        for n, (labels, rows) in results.items():
            full = torch.arange(n)
            assert torch.equal(labels, full * 3), (rank, n)
            assert torch.equal(rows, torch.stack([full.float() * 0.5, full.float() ** 2], dim=1).reshape(n, 2))


@pytest.mark.slow  # two fresh interpreters import torch and open_clip
def test_two_rank_gather_equals_one_rank(tmp_path):
    folder, jsonl = make_data(tmp_path)
    single = evaluate(folder, jsonl)
    out = str(tmp_path / "res")
    mp.start_processes(_worker, args=(2, _free_port(), str(folder), str(jsonl), out), nprocs=2,
                       join=True, start_method="spawn")
    for rank in range(2):
        multi = torch.load(f"{out}.rank{rank}", weights_only=False)
        assert torch.equal(multi["targets"], single["targets"])
        assert multi["logits"].shape == (5, 2)
        torch.testing.assert_close(multi["logits"], single["logits"], rtol=1e-5, atol=1e-5)
        for key in ("acc1", "mean_per_class_recall", "num_samples"):
            assert multi["cls"][key] == pytest.approx(single["cls"][key]), key
        assert multi["ret"] == pytest.approx(single["ret"])
        assert multi["ret"]["num_texts"] == 7 and multi["ret"]["num_images"] == 5


@pytest.mark.slow
def test_torchrun_cli_matches_single_process(tmp_path):
    folder, jsonl = make_data(tmp_path)
    tpl = tmp_path / "t.json"
    tpl.write_text(json.dumps(TEMPLATES))
    common = ["zero_shot.py", "--config", TINY, "--dataset", "imagefolder", "--data-root", str(folder),
              "--templates", str(tpl), "--workers", "0", "--device", "cpu", "--batch-size", "2"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, *common, "--output-dir", str(tmp_path / "one")], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(_free_port()), *common,
                          "--output-dir", str(tmp_path / "two")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    a = json.loads((tmp_path / "one" / "imagefolder_zeroshot_classification.json").read_text())
    b = json.loads((tmp_path / "two" / "imagefolder_zeroshot_classification.json").read_text())
    assert a["metrics"] == pytest.approx(b["metrics"]) and a["num_samples"] == b["num_samples"] == 5
    assert two.stdout.count("wrote ") == 1  # only rank 0 writes


def _failing_worker(rank: int, world: int, port: int, folder: str, out: str):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from rwkv_clip import create_RWKV_Model, image_transform, load_model_configs
        from rwkv_clip.eval.datasets import image_folder_set
        from rwkv_clip.eval.zeroshot import evaluate_classification
        model = create_RWKV_Model(load_model_configs(TINY)).eval()
        s = image_folder_set(Path(folder), image_transform(16, is_train=False), templates=TEMPLATES)
        try:
            evaluate_classification(model, s, "cpu", batch_size=2)
            outcome = "no error"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        Path(f"{out}.rank{rank}").write_text(outcome)
        dist.barrier()  # leave together: gloo can abort at exit if a peer tears down first
    finally:
        dist.destroy_process_group()


def test_unreadable_image_on_one_rank_stops_every_rank(tmp_path):
    folder, _ = make_data(tmp_path)
    (folder / "dog" / "1.png").write_bytes(b"not a png")  # the last sample: rank 1's shard
    out = str(tmp_path / "fail")
    mp.start_processes(_failing_worker, args=(2, _free_port(), str(folder), out), nprocs=2,
                       join=True, start_method="spawn")  # a hang would time the test out
    rank0 = Path(f"{out}.rank0").read_text()
    rank1 = Path(f"{out}.rank1").read_text()
    assert rank0.startswith("PeerRankError") and "other rank" in rank0
    assert rank1.startswith("ImageReadError") and "1.png" in rank1
