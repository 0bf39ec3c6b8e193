"""The planner's fine-tuning modes (locked towers, LoRA) against the real model, autograd
and a measured step."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from train_util import TINY_CONFIG, tiny_model

from rwkv_clip import ClipLoss, load_model_configs
from rwkv_clip.memory import (
    activation_segments,
    measure,
    parameter_table,
    synthetic_batch,
    training_peak,
)
from rwkv_clip.memory.cli import run as run_planner
from rwkv_clip.memory.finetune import FineTune
from rwkv_clip.memory.measure import apply_finetune

pytestmark = pytest.mark.usefixtures("walked_implementations")

pytest.importorskip("peft")

MODES = [FineTune(lock_image=True), FineTune(lock_text=True), FineTune(lora_rank=4),
         FineTune(lora_rank=4, lora_base_precision="bf16", lock_text=True),
         FineTune(lora_rank=3, lora_targets=("att.key", "ffn.value"), lora_dropout=0.1)]


def _tuned(ft):
    model = tiny_model()
    apply_finetune(model, {**ft.__dict__, "lora_targets": list(ft.lora_targets)})
    return model


@pytest.mark.parametrize("ft", MODES, ids=lambda ft: ft.label)
def test_table_matches_the_fine_tuned_model(ft):
    """Parameter count, bytes (bf16 base included) and trainable bytes equal the model
    that train.py's code builds."""
    model = _tuned(ft)
    table = parameter_table(load_model_configs(TINY_CONFIG), ft)
    params = list(model.parameters())
    assert table.count() == sum(p.numel() for p in params)
    assert table.nbytes() == sum(p.numel() * p.element_size() for p in params)
    assert table.trainable_nbytes() == sum(p.numel() * p.element_size() for p in params
                                           if p.requires_grad)


@pytest.mark.parametrize("ft", MODES, ids=lambda ft: ft.label)
def test_saved_activations_match_autograd(ft):
    """What autograd saves in a fine-tune's forward (fp32, CPU; bf16 base under bf16
    autocast), counted op by op: frozen weights save no inputs, a locked tower nothing,
    each adapter its input and rank-sized output."""
    args = load_model_configs(TINY_CONFIG)
    model = _tuned(ft)
    if ft.lora_dropout:
        model.train()
    batch = 3
    images, tokens = synthetic_batch(args, batch, "cpu")
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {images.untyped_storage().data_ptr(), tokens.untyped_storage().data_ptr()}
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            storages[st.data_ptr()] = st.nbytes()
        return t

    amp = ft.lora_base_precision == "bf16"
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        img, txt, scale = model(images, tokens)
        loss = ClipLoss()(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), scale)
    real = sum(storages.values())
    del loss
    plan = activation_segments(args, batch, "bf16" if amp else None, "cpu",
                               params=parameter_table(args, ft))
    # under the counting hook (someone else's), the blocks rebuild nothing
    counted = sum(s.saved + s.rebuilt + s.casts for s in plan.segments)
    assert abs(real - counted) / real < 0.02, (real, counted)


def test_lora_needs_less_than_full_and_locking_less_still():
    args = load_model_configs("RWKV_CLIP_B32")
    peak = {ft.label: training_peak(args, 128, "bf16", params=parameter_table(args, ft))
            for ft in (FineTune(), FineTune(lora_rank=16),
                       FineTune(lora_rank=16, lora_base_precision="bf16"),
                       FineTune(lock_image=True))}
    full, lora = peak["full"], peak["LoRA r=16"]
    assert lora["gradient_bytes"] < full["gradient_bytes"] / 30
    assert lora["optimizer_bytes"] == 2 * lora["gradient_bytes"]
    assert peak["LoRA r=16, bf16 base"]["parameter_bytes"] < 0.6 * lora["parameter_bytes"]
    assert full["training_peak_bytes"] > lora["training_peak_bytes"] \
        > peak["LoRA r=16, bf16 base"]["training_peak_bytes"]
    assert peak["lock-image"]["activation_bytes"] < full["activation_bytes"] / 2


@pytest.mark.slow
def test_cli_prints_the_table_by_way_of_fine_tuning(repo_root):
    out = subprocess.run([sys.executable, "-m", "rwkv_clip.memory", "--config", TINY_CONFIG,
                          "--batch-size", "64", "--precision", "bf16", "--lora-rank", "8",
                          "--lora-base-precision", "bf16", "--json"],
                         capture_output=True, text=True, check=True, cwd=repo_root)
    result = json.loads(out.stdout)
    assert result["finetune"] == "LoRA r=8, bf16 base"
    modes = result["max_batch_by_mode"]
    assert list(modes) == ["full", "lock-image", "lock-text", "LoRA r=8",
                           "LoRA r=8, bf16 base"]
    assert result["estimate"]["max_batch"] == modes["LoRA r=8, bf16 base"]
    # the tiny config's weights are a few MB, so LoRA's saving on gradients and optimizer
    # state is small beside the activations, where its adapters add their own saved
    # tensors (the full model's blocks rebuild what its frozen products would have saved)
    for card in ("T4 16GB", "L4 24GB", "A100 40GB", "A100 80GB", "H100 80GB", "H200 141GB"):
        assert modes["LoRA r=8"][card] >= 0.98 * modes["full"][card] > 0


@pytest.mark.parametrize("argv, culprit", [
    (["--lock-image", "--lock-text"], "unlock one tower"),
    (["--lora-rank", "-2"], "--lora-rank"),
    (["--lora-rank", "4", "--lora-targets", "att.nope"], "att.nope"),
])
def test_cli_fine_tune_errors_are_one_line(capsys, argv, culprit):
    assert run_planner(["--config", "RWKV_CLIP_tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and culprit in err[0], err


@pytest.mark.slow
@pytest.mark.parametrize("ft", [FineTune(lora_rank=8), FineTune(lock_image=True)],
                         ids=lambda ft: ft.label)
def test_estimate_within_15_percent_of_measured_cpu(repo_root, ft):
    """The small config, fp32 on the CPU: a LoRA / locked step's estimated peak within 15%
    of the measured one (peak RSS of one real step in a fresh process)."""
    config = str(repo_root / "model_config" / "RWKV_CLIP_small.json")
    args = load_model_configs(config)
    batch = 64
    m = measure(config, batch, "fp32", False, "cpu", timeout=900, finetune=ft)
    est = training_peak(args, batch, "fp32", device="cpu",
                        params=parameter_table(args, ft))["training_peak_bytes"]
    assert abs(est / m["measured_peak_bytes"] - 1) < 0.15, (est, m)
