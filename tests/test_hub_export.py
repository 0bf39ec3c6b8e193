"""Hub folders: what ``--format hub`` writes (weights, configs, a model card holding the
evaluation JSON's figures), loading it back by ``local-dir:`` and ``hf-hub:`` (a local Hub
cache laid out as huggingface_hub lays it out, offline) with the original's outputs."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rwkv_clip.errors import RWKVCLIPError

REPO = Path(__file__).resolve().parents[1]
METRICS = {"acc1": 0.4667, "acc5": 0.8333, "mean_per_class_recall": 0.45}


def _tiny_model(seed=0):
    from rwkv_clip import create_RWKV_Model, load_model_configs

    torch.manual_seed(seed)
    return create_RWKV_Model(load_model_configs("RWKV_CLIP_tiny")).eval()


def _export(*args, cwd=REPO):
    from rwkv_clip.export import main

    return main([str(a) for a in args])


def _record(dataset, task="zeroshot_classification", metrics=METRICS):
    from rwkv_clip.eval.results import result_record

    return result_record(dataset, "RWKV_CLIP_tiny", "tiny.pt", task,
                         dict(metrics, headline_metric="acc1", headline=metrics.get("acc1"),
                              num_samples=60))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny model's weights, one result JSON, and the folder exported from them."""
    from rwkv_clip.eval.results import write_result

    root = tmp_path_factory.mktemp("hub")
    model = _tiny_model(seed=4)
    weights = root / "run" / "tiny.pt"
    weights.parent.mkdir()
    torch.save({"module." + k: v for k, v in model.state_dict().items()}, weights)
    results = write_result(_record("builtin-zeroshot"), root / "results")
    out = root / "folder"
    assert _export(weights, "--format", "hub", "--output", out, "--eval-json", results,
                   "--repo-id", "someone/rwkv-clip-tiny", "--dataset", "builtin-shapes") == 0
    return {"model": model, "weights": weights, "results": results, "out": out}


def test_folder_files_and_modes(exported):
    out = exported["out"]
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "model_config.json",
                                               "preprocess_config.json", "README.md"}
    for p in out.iterdir():
        assert p.stat().st_mode & 0o777 == 0o644, p  # safetensors alone would write 0600
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    expected = exported["model"].state_dict()
    assert set(state) == set(expected)  # the original's names, no module.
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
    config = json.loads((out / "model_config.json").read_text())
    assert config == json.loads((REPO / "model_config" / "RWKV_CLIP_tiny.json").read_text())
    assert json.loads((out / "preprocess_config.json").read_text())["size"] == 16


def test_model_card_holds_the_given_metrics(exported):
    from huggingface_hub import ModelCard

    card = ModelCard.load(exported["out"] / "README.md")
    data = card.data
    assert data.license == "mit" and data.library_name == "rwkv-clip"
    assert "clip" in data.tags and "rwkv" in data.tags
    assert data.datasets == ["builtin-shapes"]
    got = {r.metric_name: r.metric_value for r in data.eval_results}
    assert got == pytest.approx({"top-1 accuracy": 46.67, "top-5 accuracy": 83.33,
                                 "mean per-class recall": 45.0})
    assert {r.dataset_name for r in data.eval_results} == {"builtin-zeroshot"}
    assert {r.task_type for r in data.eval_results} == {"zero-shot-image-classification"}
    body = card.text
    assert 'create_model_and_transforms("hf-hub:someone/rwkv-clip-tiny")' in body
    assert "| builtin-zeroshot | zeroshot_classification | top-1 accuracy | 46.67 |" in body


def test_card_finds_results_beside_the_checkpoint(tmp_path):
    from huggingface_hub import ModelCard

    from rwkv_clip.eval.results import write_result

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    weights = run / "checkpoints" / "epoch_1.pt"
    torch.save(_tiny_model().state_dict(), weights)
    retrieval = {"text_retrieval_recall@1": 0.25, "image_retrieval_recall@1": 0.125}
    write_result(_record("flickr30k", "zeroshot_retrieval", retrieval), run)
    assert _export(weights, "--format", "hub", "--output", tmp_path / "out") == 0
    card = ModelCard.load(tmp_path / "out" / "README.md")
    got = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert got == pytest.approx({"image-to-text R@1": 25.0, "text-to-image R@1": 12.5})


def test_local_dir_round_trip_gives_the_original_outputs(exported):
    import rwkv_clip

    model = exported["model"]
    loaded, _, preprocess = rwkv_clip.create_model_and_transforms(f"local-dir:{exported['out']}")
    loaded.eval()
    torch.manual_seed(0)
    image = torch.randn(3, 3, 16, 16)
    text = rwkv_clip.get_tokenizer(f"local-dir:{exported['out']}")(["a red square", "a cat",
                                                                      "x"])
    assert text.shape == (3, 77)
    with torch.no_grad():
        assert torch.equal(loaded.encode_image(image), model.encode_image(image))
        assert torch.equal(loaded.encode_text(text), model.encode_text(text))
    assert preprocess.transforms[1].size == (16, 16)  # centre crop to the config's size


def _hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = "0" * 40) -> None:
    """huggingface_hub's cache layout: blobs, a snapshot of links, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, path in enumerate(sorted(folder.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob.name))


def test_hf_hub_round_trip_from_the_local_cache(exported, tmp_path, monkeypatch):
    import rwkv_clip

    cache = tmp_path / "hub"
    _hub_cache(cache, "someone/rwkv-clip-tiny", exported["out"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded, _, _ = rwkv_clip.create_model_and_transforms("hf-hub:someone/rwkv-clip-tiny")
    local, _, _ = rwkv_clip.create_model_and_transforms(f"local-dir:{exported['out']}")
    loaded.eval(), local.eval()
    torch.manual_seed(1)
    image, text = torch.randn(2, 3, 16, 16), torch.randint(1, 49408, (2, 77))
    with torch.no_grad():
        assert torch.equal(loaded.encode_image(image), exported["model"].encode_image(image))
        assert torch.equal(loaded.encode_text(text), local.encode_text(text))
    assert rwkv_clip.get_tokenizer("hf-hub:someone/rwkv-clip-tiny")("a cat").shape == (1, 77)
    with pytest.raises(RWKVCLIPError, match="not in the cache"):
        rwkv_clip.create_model_and_transforms("hf-hub:someone/not-cached")


def test_folder_errors(tmp_path, exported):
    import rwkv_clip
    from rwkv_clip.hub import push_to_hub

    with pytest.raises(RWKVCLIPError, match="is not a folder"):
        rwkv_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'nothing'}")
    (tmp_path / "half").mkdir()
    shutil.copy(exported["out"] / "model_config.json", tmp_path / "half")
    with pytest.raises(RWKVCLIPError, match="has no preprocess_config.json"):
        rwkv_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'half'}")
    with pytest.raises(RWKVCLIPError, match="not an exported Hub folder"):
        push_to_hub(tmp_path / "half", "someone/x")


def test_bad_eval_json_is_one_line(exported, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"acc1": 0.5}))
    r = subprocess.run([sys.executable, "-m", "rwkv_clip.export", str(exported["weights"]),
                        "--format", "hub", "--output", str(tmp_path / "out"), "--eval-json",
                        str(bad)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "expected a zero_shot.py result record" in lines[0], r.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_card_finds_results_where_zero_shot_py_writes_them(tmp_path):
    """zero_shot.py's default folder for runs/X/checkpoints/Y.pt is runs/X/eval_results/:
    the export reads the figures from there without --eval-json."""
    from huggingface_hub import ModelCard

    from rwkv_clip.eval.results import write_result
    from rwkv_clip.eval.runner import default_output_dir, options

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    weights = run / "checkpoints" / "epoch_latest.pt"
    torch.save(_tiny_model().state_dict(), weights)
    results = default_output_dir(options(model_weight=str(weights)))
    assert results == run / "eval_results"
    write_result(_record("builtin"), results)
    write_result(_record("builtin", metrics=dict(METRICS, acc1=0.9)), results)  # a rerun
    assert _export(weights, "--format", "hub", "--output", tmp_path / "out") == 0
    card = ModelCard.load(tmp_path / "out" / "README.md")
    got = [(r.dataset_name, r.metric_name, r.metric_value) for r in card.data.eval_results]
    # the newest run's figures, once: the earlier file kept aside is not read again
    assert ("builtin", "top-1 accuracy", pytest.approx(90.0)) in got
    assert sum(1 for g in got if g[1] == "top-1 accuracy") == 1


@pytest.mark.parametrize("depth,text", [(1, "1 block,"), (2, "2 blocks,")])
def test_card_counts_blocks(depth, text):
    from rwkv_clip.hub import CardInfo, model_card

    config = {"image_depth": depth, "n_layer": depth, "image_embed_dims": 64, "n_embd": 64}
    card = model_card(CardInfo(name="m", model_config=config), [])
    assert f"image tower: {text}" in card and f"text tower: {text}" in card
    assert "1 blocks" not in card
