"""Memory planner: the arithmetic against the real model, and the estimate against a
measured step (slow)."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from rwkv_clip import ClipLoss, activation_memory, create_RWKV_Model, load_model_configs
from rwkv_clip.errors import MeasurementError
from rwkv_clip.memory import (
    activation_segments,
    estimate,
    make_step,
    measure,
    parameter_table,
    synthetic_batch,
    training_peak,
)
from rwkv_clip.memory.cli import run as run_planner
from rwkv_clip.memory.measure import MeasureSpec

pytestmark = pytest.mark.usefixtures("walked_implementations")


@pytest.fixture(scope="module")
def tiny(repo_root):
    path = repo_root / "model_config" / "RWKV_CLIP_tiny.json"
    args = load_model_configs(str(path))
    torch.manual_seed(0)
    return path, args, create_RWKV_Model(args)


def _rebuilding(args, rebuild):
    """A copy of ``args`` with the config key ``rebuild`` set (the fixture's stays)."""
    out = copy.copy(args)
    out.rebuild = rebuild
    return out


def _set_rebuild(monkeypatch, model, rebuild):
    """The module's model under ``rebuild`` for one test."""
    for layer in model.image_model.layers:
        monkeypatch.setattr(layer, "rebuild", rebuild)
    monkeypatch.setattr(model.text_model.args, "rebuild", rebuild)


def _model_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_parameters_match_model_exactly(tiny):
    _, args, model = tiny
    table = parameter_table(args)
    assert table.count() == sum(p.numel() for p in model.parameters())
    assert table.nbytes() == _model_bytes(model)  # bf16 time_decay/time_faaaa included
    assert table.largest_bytes() == max(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("name", ["small", pytest.param("B32", marks=pytest.mark.slow)])
def test_meta_parameter_table_equals_real_model(repo_root, name):
    """The table read from the meta-device build has the real model's names, sizes and
    dtypes (building B/32 for real takes a while: slow)."""
    args = load_model_configs(str(repo_root / "model_config" / f"RWKV_CLIP_{name}.json"))
    model = create_RWKV_Model(args)
    real = [(n, p.numel(), p.element_size()) for n, p in model.named_parameters()]
    table = parameter_table(args)
    assert [(n, k) for n, k, _ in table.items] == [(n, k) for n, k, _ in real]
    assert table.count() == sum(k for _, k, _ in real)
    assert table.nbytes() == sum(k * size for _, k, size in real)


def test_every_parameter_belongs_to_a_segment(tiny):
    """The segments' gradient bytes add up to all parameters: each parameter name is
    attributed to the embedding, a block, a head or the loss."""
    _, args, model = tiny
    plan = activation_segments(args, 2, None, "cpu")
    assert sum(s.grad_bytes for s in plan.segments) == _model_bytes(model)
    assert all(s.grad_bytes > 0 for s in plan.segments)


def test_step_uses_the_trainers_settings(tiny):
    """AdamW, weight decay, betas and the fp16 GradScaler are the trainer's defaults
    (train.py: --weight-decay 0.1, --beta1 0.9, --beta2 0.98; scaler init 128, growth
    interval 200)."""
    _, _, model = tiny
    step = make_step(model, "fp32", "cpu")
    assert isinstance(step.optimizer, torch.optim.AdamW) and step.scaler is None
    group = step.optimizer.param_groups[0]
    assert group["weight_decay"] == 0.1 and group["betas"] == (0.9, 0.98)
    scaler = make_step(model, "fp16", "cpu").scaler
    assert scaler.get_scale() == 128.0 and scaler.get_growth_interval() == 200


def test_published_parameter_counts(repo_root):
    b32 = load_model_configs(str(repo_root / "model_config" / "RWKV_CLIP_B32.json"))
    b16 = load_model_configs(str(repo_root / "model_config" / "RWKV_CLIP_B16.json"))
    assert parameter_table(b32).count() == 149_561_601
    assert parameter_table(b16).count() == 148_181_121


def test_gradient_and_optimizer_bytes_match_a_real_step(tiny):
    _, args, model = tiny
    step = make_step(model, "fp32", "cpu")
    images, tokens = synthetic_batch(args, 2, "cpu")
    seen: dict[str, int] = {}  # the gradients the optimizer steps with (cleared after it)

    def count_gradients(optimizer, args, kwargs):
        seen["grads"] = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    step.optimizer.register_step_pre_hook(count_gradients)
    step(images, tokens)
    grads = seen["grads"]
    moments = sum(s[k].numel() * s[k].element_size()
                  for s in step.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    tr = training_peak(args, 8, "bf16")
    assert tr["gradient_bytes"] == grads
    assert tr["optimizer_bytes"] == moments
    assert tr["parameter_bytes"] == _model_bytes(model)


def _saved_storages(model, images, tokens, amp, branches=None):
    """{storage address: bytes} autograd saves in a forward, parameters and inputs
    excluded; with ``branches`` (the residual branches under their policy), the
    branches' inputs and what the policy keeps, which autograd's hooks do not see."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {images.untyped_storage().data_ptr(), tokens.untyped_storage().data_ptr()}
    storages = {}

    def count(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            storages[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t), \
            torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        img, txt, scale = model(images, tokens)
        loss = ClipLoss()(F.normalize(img, dim=-1), F.normalize(txt, dim=-1), scale)
    for x, cache in branches or ():
        count(x)
        for entries in cache.values():
            for entry in entries.values():
                for leaf in tree_flatten(entry)[0]:
                    if isinstance(getattr(leaf, "val", None), torch.Tensor):
                        count(leaf.val)
    del loss
    return sum(storages.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_saved_activations_match_autograd(tiny, precision, monkeypatch):
    """The op-by-op count equals the bytes autograd really saves in a forward (CPU, native
    WKV kernel; bf16 = CPU autocast rules, autocast weight copies included), tensors
    sharing storage counted once, parameters and inputs excluded: every branch plain,
    and every branch under the activation-memory policy (config key ``rebuild`` always;
    the tiny batch is below auto's size), where it keeps less."""
    _, args, model = tiny
    batch = 3
    images, tokens = synthetic_batch(args, batch, "cpu")
    amp = None if precision == "fp32" else torch.bfloat16
    _set_rebuild(monkeypatch, model, "never")
    real = _saved_storages(model, images, tokens, amp)
    plan = activation_segments(_rebuilding(args, "never"), batch,
                               None if amp is None else "bf16", "cpu")
    counted = sum(s.saved + s.casts for s in plan.segments)
    assert not any(s.rebuilt for s in plan.segments)
    # equal up to a few scalars and per-row statistics the walker lumps together
    tolerance = 0.01
    print(f"saved by autograd {real}, counted {counted}")
    assert abs(real - counted) / real < tolerance, (real, counted)

    # the policy: counted with the count's own hook in place (someone else's hooks
    # otherwise turn it off)
    _set_rebuild(monkeypatch, model, "always")
    branches = []
    make = activation_memory.create_selective_checkpoint_contexts
    run = activation_memory.checkpoint

    def contexts(policy):
        forward, recompute = make(policy)
        branches[-1][1] = forward.storage
        return forward, recompute

    def checkpoint(fn, x, **kwargs):
        branches.append([x, None])
        return run(fn, x, **kwargs)
    monkeypatch.setattr(activation_memory, "create_selective_checkpoint_contexts", contexts)
    monkeypatch.setattr(activation_memory, "checkpoint", checkpoint)
    monkeypatch.setattr(activation_memory, "applies", lambda x, rebuild: torch.is_grad_enabled())
    kept = _saved_storages(model, images, tokens, amp, branches)
    assert len(branches) == 2 * (args.image_depth + args.n_layer)
    plan = activation_segments(_rebuilding(args, "always"), batch,
                               None if amp is None else "bf16", "cpu")
    planned = sum(s.saved + s.casts for s in plan.segments)
    print(f"kept under the policy {kept}, planned {planned}")
    assert planned < 0.8 * counted
    assert abs(kept - planned) / planned < tolerance, (kept, planned)


def test_checkpointing_reduces_activations(tiny):
    _, args, _ = tiny
    off = training_peak(args, 256, "bf16", checkpointing=False)
    on = training_peak(args, 256, "bf16", checkpointing=True)
    assert on["training_peak_bytes"] < off["training_peak_bytes"]
    # batch 256 is above auto's size: the branches keep about a third of what plain
    # autograd saves; a whole-block checkpoint turns that policy off inside it
    plain = training_peak(_rebuilding(args, "never"), 256, "bf16", checkpointing=False)
    assert off["activation_bytes"] < plain["activation_bytes"] * 0.5
    assert on["activation_bytes"] < plain["activation_bytes"] * 0.7
    assert training_peak(_rebuilding(args, "never"), 256, "bf16", checkpointing=True) == on


def test_gradient_accumulation_divides_activations(tiny):
    _, args, _ = tiny
    full = activation_segments(args, 64, "bf16", "cuda")
    quarter = activation_segments(args, 16, "bf16", "cuda")
    for a, b in zip(full.segments, quarter.segments, strict=True):
        if a.name.startswith(("image.block", "text.block")):
            # per-sample tensors: 4x the samples, 4x the bytes (up to the few (C,)-sized
            # tensors like the image channel mix's 1 - spatial_mix)
            assert abs(a.saved - 4 * b.saved) < 1e-3 * a.saved
    one = training_peak(args, 64, "bf16", gradient_acc=1)
    four = training_peak(args, 64, "bf16", gradient_acc=4)
    assert four["micro_batch"] == 16
    assert four["activation_bytes"] < one["activation_bytes"] / 3.5


def test_gpus_grow_logits_and_add_ddp_buckets(tiny):
    _, args, _ = tiny
    one = training_peak(args, 128, "bf16", gpus=1)
    eight = training_peak(args, 128, "bf16", gpus=8)
    assert eight["ddp_bucket_bytes"] == eight["gradient_bytes"]
    loss1 = activation_segments(args, 128, "bf16", "cuda", world_size=1).segments[-1].saved
    loss8 = activation_segments(args, 128, "bf16", "cuda", world_size=8).segments[-1].saved
    assert loss8 > 30 * loss1  # (8B)^2 logits instead of B^2
    assert eight["training_peak_bytes"] > one["training_peak_bytes"]


def test_bf16_smaller_than_fp32_and_cards_monotonic(repo_root):
    args = load_model_configs(str(repo_root / "model_config" / "RWKV_CLIP_B32.json"))
    # on the CPU, where the squared ReLU keeps its bf16 relu under autocast too (on CUDA,
    # autocast runs its pow in fp32 and saves the fp32 copy; rebuilding leaves that alone)
    fp32 = training_peak(args, 256, "fp32", device="cpu")
    bf16 = training_peak(args, 256, "bf16", device="cpu")
    assert bf16["activation_bytes"] < fp32["activation_bytes"]
    est = estimate(args, 256, "bf16", config_name="B32", inference_batch=1)
    sizes = list(est.max_batch.values())
    assert sizes == sorted(sizes[:3]) + sizes[3:] and sizes[0] > 0
    assert est.max_batch["H200 141GB"] > est.max_batch["A100 80GB"] > est.max_batch["T4 16GB"]
    assert est.inference_peak_bytes < est.training_peak_bytes


def test_cli_json(repo_root):
    # batch 64: large enough that the peak is in backward (activations > 0); at 32 the
    # tiny config's optimizer step (its 49408-token embedding) is the peak
    out = subprocess.run([sys.executable, "-m", "rwkv_clip.memory", "--config",
                          str(repo_root / "model_config" / "RWKV_CLIP_tiny.json"),
                          "--batch-size", "64", "--precision", "bf16", "--checkpointing",
                          "--gradient-acc", "2", "--gpus", "2", "--json"],
                         capture_output=True, text=True, check=True, cwd=repo_root)
    est = json.loads(out.stdout)["estimate"]
    assert est["micro_batch"] == 64 and est["batch_size"] == 128  # train.py's meaning
    assert est["checkpointing"] and est["gpus"] == 2
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes", "activation_bytes",
                "training_peak_bytes", "inference_peak_bytes"):
        assert est[key] > 0
    assert set(est["max_batch"]) == {"T4 16GB", "L4 24GB", "A100 40GB", "A100 80GB",
                                     "H100 80GB", "H200 141GB"}


@pytest.mark.parametrize("argv, culprit", [
    (["--config", "no_such_config.json"], "no_such_config.json"),
    (["--config", "RWKV_CLIP_tiny", "--batch-size", "0"], "--batch-size"),
    (["--config", "RWKV_CLIP_tiny", "--batch-size", "ten"], "--batch-size"),
    (["--config", "RWKV_CLIP_tiny", "--gradient-acc", "0"], "--gradient-acc"),
    (["--config", "RWKV_CLIP_tiny", "--precision", "fp8"], "fp8"),
    (["--config", "RWKV_CLIP_tiny", "--measure", "--gpus", "2"], "--gpus"),
    (["--config", "RWKV_CLIP_tiny", "--no-such-flag"], "--no-such-flag"),
])
def test_cli_user_errors_are_one_line(capsys, argv, culprit):
    assert run_planner(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m rwkv_clip.memory: error:"), err
    assert culprit in err[0]


def test_cli_bad_config_json_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"image_depth": ')
    assert run_planner(["--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.json" in err[0]


def test_measure_spec_round_trips_and_worker_failure_is_reported(tmp_path):
    spec = MeasureSpec("RWKV_CLIP_tiny", 4, "bf16", True, "cpu", "inference", "torch")
    assert MeasureSpec.from_json(spec.to_json()) == spec
    # the worker process fails (no such config): the parent raises with the child's stderr
    with pytest.raises(MeasurementError, match="not found"):
        measure(str(tmp_path / "missing.json"), 2, "fp32", False, "cpu", timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_within_15_percent_of_measured_cpu(tiny, checkpointing):
    path, args, _ = tiny
    batch = 96
    m = measure(str(path), batch, "fp32", checkpointing, "cpu", timeout=600)
    est = training_peak(args, batch, "fp32", checkpointing, device="cpu")["training_peak_bytes"]
    assert abs(est / m["measured_peak_bytes"] - 1) < 0.15, (est, m)


def test_planner_takes_train_py_config_flags_such_as_ctx_len(capsys):
    """docs/evaluation.md's long-caption LoRA run, planned with its flags: a longer
    context costs more activation memory; a bad value names its key in one line."""
    from rwkv_clip.memory.cli import build_planner_parser
    from rwkv_clip.memory.cli import run as planner
    from rwkv_clip.train.args import build_train_parser

    def plan(*flags: str) -> dict:
        assert planner(["--config", "RWKV_CLIP_small", "--lora-rank", "16", "--json",
                        *flags]) == 0
        return json.loads(capsys.readouterr().out)["estimate"]

    long, short = plan("--ctx-len", "248"), plan("--ctx-len", "77")
    assert long["training_peak_bytes"] > short["training_peak_bytes"]
    assert planner(["--ctx-len", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "ctx_len" in err, err
    planner_flags = set(build_planner_parser()._option_string_actions)
    tower = {o for a in build_train_parser()._actions for o in a.option_strings
             if a.dest in ("input_size", "ctx_len", "n_layer", "n_embd", "image_depth",
                           "head_size", "vocab_size", "image_patch_size")}
    assert tower <= planner_flags, tower - planner_flags
