"""Weights by name (never over the network: a Hub cache laid out by the test, with
HF_HUB_OFFLINE=1), the offline miss, .safetensors loading and the export round trip."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import rwkv_clip
from rwkv_clip.errors import CheckpointError
from rwkv_clip.pretrained import resolve_pretrained

TINY = "RWKV_CLIP_tiny"
REV = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(cache, repo, filename, obj, revision=REV):
    """The layout huggingface_hub reads offline: models--OWNER--NAME/snapshots/REV/FILE
    and refs/main holding REV."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    (folder / "snapshots" / revision).mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(revision)
    path = folder / "snapshots" / revision / filename
    torch.save(obj, path)
    return path


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def tiny_state(seed=5):
    torch.manual_seed(seed)
    return rwkv_clip.create_RWKV_Model(rwkv_clip.load_model_configs(TINY)).state_dict()


def test_list_pretrained_and_names():
    assert rwkv_clip.list_pretrained() == [
        ("RWKV-CLIP-B32", "yfcc15m"), ("RWKV-CLIP-B32", "laion10m"),
        ("RWKV-CLIP-B32", "laion30m"), ("RWKV-CLIP-B16", "laion10m")]
    from rwkv_clip.pretrained import get_pretrained_cfg, model_config
    assert model_config("RWKV-CLIP-B32") == model_config("RWKV_CLIP_B32") == "RWKV_CLIP_B32"
    cfg = get_pretrained_cfg("RWKV-CLIP-B16", "laion10m")
    assert (cfg.hf_repo, cfg.filename, cfg.config) == (
        "Kaichengalex/RWKV-CLIP-B16-LAION10M", "model_31.pt", "RWKV_CLIP_B16")
    with pytest.raises(CheckpointError, match="its tags: laion10m"):
        get_pretrained_cfg("RWKV-CLIP-B16", "yfcc15m")
    with pytest.raises(rwkv_clip.ConfigError, match="unknown model 'RWKV-CLIP-L14'"):
        model_config("RWKV-CLIP-L14")
    tok = rwkv_clip.get_tokenizer("RWKV-CLIP-B32")
    assert torch.equal(tok(["a cat"]), rwkv_clip.tokenize(["a cat"], context_length=77))


def test_hf_hub_name_from_local_cache(offline_cache, tmp_path, capsys):
    state = tiny_state()
    path = lay_out_hub_cache(offline_cache, "someone/tiny-clip", "weights.pt",
                             {"module." + k: v for k, v in state.items()})
    resolved = resolve_pretrained("hf-hub:someone/tiny-clip/weights.pt")
    assert resolved.path.resolve() == path.resolve() and resolved.config is None
    assert resolve_pretrained(f"hf-hub:someone/tiny-clip/weights.pt@{REV}").path.resolve() \
        == path.resolve()
    model, preprocess_train, preprocess_val = rwkv_clip.create_model_and_transforms(
        TINY, "hf-hub:someone/tiny-clip/weights.pt")
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert preprocess_val(Image.new("RGB", (30, 20))).shape == (3, 16, 16)
    # train.py --pretrained goes through load_model_weight, which takes the same names
    fresh = rwkv_clip.create_RWKV_Model(rwkv_clip.load_model_configs(TINY))
    rwkv_clip.load_model_weight(fresh, "hf-hub:someone/tiny-clip/weights.pt")
    assert torch.equal(fresh.logit_scale, state["logit_scale"])
    assert torch.equal(fresh.text_model.emb.weight, state["text_model.emb.weight"])
    # the eval CLI takes the same name; the config is inferred from the shapes
    from zero_shot import main
    folder = tmp_path / "imgs"
    for i, cls in enumerate(("red", "blue")):
        (folder / cls).mkdir(parents=True)
        Image.new("RGB", (20, 18), (200 * (1 - i), 10, 200 * i)).save(
            folder / cls / "a.png")
    rc = main(["--pretrained", "hf-hub:someone/tiny-clip/weights.pt", "--dataset", "imagefolder",
               "--data-root", str(folder), "--device", "cpu", "--workers", "0",
               "--output-dir", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "config: RWKV_CLIP_tiny (inferred" in out
    record = json.loads((tmp_path / "out" / "imagefolder_zeroshot_classification.json").read_text())
    assert record["pretrained"] == "hf-hub:someone/tiny-clip/weights.pt"


def test_offline_miss_is_one_clear_error(offline_cache, tmp_path):
    with pytest.raises(CheckpointError) as info:
        resolve_pretrained("RWKV-CLIP-B32:laion30m")
    message = str(info.value)
    for needle in ("Kaichengalex/RWKV-CLIP-B32-LAION30M", "model_31.pt", "HF_HUB_OFFLINE",
                   "hf download Kaichengalex/RWKV-CLIP-B32-LAION30M model_31.pt",
                   str(offline_cache)):
        assert needle in message, (needle, message)
    # the same from the command line: one line, exit 2, no traceback
    r = subprocess.run([sys.executable, "zero_shot.py", "--pretrained", "RWKV-CLIP-B32:yfcc15m",
                        "--device", "cpu", "--output-dir", str(tmp_path / "o")],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zero_shot.py: error:")
    assert "hf download Kaichengalex/RWKV-CLIP-B32-YFCC15M model_31.pt" in lines[0]


def test_bad_names_and_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_pretrained(str(tmp_path / "nope.pt"))
    with pytest.raises(CheckpointError, match="expected a weights file"):
        resolve_pretrained("yfcc15m")  # a tag needs its model
    with pytest.raises(CheckpointError, match="hf-hub:OWNER/REPO"):
        resolve_pretrained("hf-hub:justowner")


def test_safetensors_load_and_load_model_weight(tmp_path):
    from safetensors.torch import save_file

    state = tiny_state(seed=9)
    path = tmp_path / "w.safetensors"
    save_file({"module." + k: v.contiguous() for k, v in state.items()}, str(path))
    model = rwkv_clip.create_RWKV_Model(rwkv_clip.load_model_configs(TINY))
    rwkv_clip.load_model_weight(model, path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]) and v.dtype == state[k].dtype, k
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        rwkv_clip.load_model_weight(model, bad)


# ---------------------------------------------------------------- export
def run_export(*args):
    from rwkv_clip.export import main
    return main([str(a) for a in args])


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("ddp_prefix", [False, True])
def test_export_round_trip_tiny(tmp_path, capsys, suffix, ddp_prefix):
    state = tiny_state(seed=2)
    training_ckpt = {"state_dict": {"module." + k: v for k, v in state.items()},
                     "optimizer": {"state": {}, "param_groups": []}, "epoch": 3}
    torch.save(training_ckpt, tmp_path / "epoch_3.pt")
    out = tmp_path / ("export" + suffix)
    assert run_export(tmp_path / "epoch_3.pt", out, *(["--ddp-prefix"] if ddp_prefix else [])) == 0
    printed = capsys.readouterr().out
    assert f"sha256 {hashlib.sha256(out.read_bytes()).hexdigest()}" in printed
    assert f"{sum(v.numel() for v in state.values()):,} parameters" in printed
    if suffix == ".safetensors":
        from safetensors.torch import load_file
        loaded = load_file(str(out))
    else:
        loaded = torch.load(out, weights_only=True)
    prefix = "module." if ddp_prefix else ""
    keys = [prefix + k for k in state]  # the model's keys, nothing else
    # .pt keeps the model's order; safetensors stores its own (sorted) order
    assert list(loaded) == keys if suffix == ".pt" else sorted(loaded) == sorted(keys)
    for k, v in state.items():
        assert loaded[prefix + k].dtype == v.dtype and torch.equal(loaded[prefix + k], v)
    # and it loads back strictly (our loader strips module.)
    model = rwkv_clip.create_RWKV_Model(rwkv_clip.load_model_configs(TINY))
    rwkv_clip.load_model_weight(model, out)


def test_export_refuses_mismatch(tmp_path):
    state = tiny_state()
    del state["logit_scale"]
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(rwkv_clip.ConfigError, match="matches none"):
        run_export(tmp_path / "w.pt", tmp_path / "o.pt")
    with pytest.raises(CheckpointError, match="missing keys.*logit_scale"):
        run_export(tmp_path / "w.pt", tmp_path / "o.pt", "--config", TINY)
    with pytest.raises(CheckpointError, match="expected a .pt or .safetensors"):
        run_export(tmp_path / "w.pt", tmp_path / "o.bin")
    assert not (tmp_path / "o.pt").exists()


def b32_random_state(reference_dir, ddp=True):
    ref = json.loads((reference_dir / "keys_B32.json").read_text())
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, shape, dtype in ref["keys"]:
        t = torch.randn(shape, generator=gen) * 0.02
        state[("module." if ddp else "") + name] = t.to(getattr(torch, dtype))
    return state, ref


@pytest.mark.slow
def test_b32_by_name_from_hub_cache_and_export(offline_cache, reference_dir, tmp_path, capsys):
    """A module.-prefixed, B/32-shaped random state dict where the Hub would put
    Kaichengalex/RWKV-CLIP-B32-YFCC15M/model_31.pt: loaded by name, then exported to .pt
    and .safetensors with exactly the original's keys, shapes and dtypes."""
    state, ref = b32_random_state(reference_dir)
    lay_out_hub_cache(offline_cache, "Kaichengalex/RWKV-CLIP-B32-YFCC15M", "model_31.pt", state)
    model, _, preprocess_val = rwkv_clip.create_model_and_transforms("RWKV-CLIP-B32", "yfcc15m")
    assert torch.equal(model.image_model.pos_embed, state["module.image_model.pos_embed"])
    assert preprocess_val(Image.new("RGB", (300, 200))).shape \
        == (3, 224, 224)
    del model
    for suffix in (".pt", ".safetensors"):
        out = tmp_path / ("b32" + suffix)
        assert run_export("RWKV-CLIP-B32:yfcc15m", out, "--ddp-prefix") == 0
        assert "149,561,601 parameters" in capsys.readouterr().out
        if suffix == ".safetensors":
            from safetensors.torch import load_file
            loaded = load_file(str(out))
        else:
            loaded = torch.load(out, weights_only=True)
        entries = [[k[len("module."):], list(v.shape), str(v.dtype).replace("torch.", "")]
                   for k, v in loaded.items()]
        assert entries == ref["keys"] if suffix == ".pt" else sorted(entries) == sorted(ref["keys"])
        assert all(torch.equal(loaded[k], state[k]) for k in state)
        del loaded
