"""Every precision runs a step on CPU; activation checkpointing leaves gradients unchanged."""
import copy
import math

import pytest
import torch
from train_util import TINY_CONFIG, record_step_grads, tiny_model

from rwkv_clip import ClipLoss
from rwkv_clip.errors import PrecisionError
from rwkv_clip.precision import canonical_precision, get_precision
from rwkv_clip.train.accumulation import caption_generator, make_micro_batches, train_step
from rwkv_clip.train.args import parse_args
from rwkv_clip.train.loop import build_optimizer

pytestmark = pytest.mark.cpu_isa  # bf16 and fp16 steps take the CPU's product path


def _micro_batches(n=6, k=1):
    g = torch.Generator().manual_seed(3)
    images = torch.randn(n, 3, 16, 16, generator=g)
    tokens = torch.randint(1, 3000, (n, 231), generator=g)
    tokens[:, torch.arange(231) % 77 > 10] = 0  # short captions, zero padded
    m = n // k
    return make_micro_batches(list(images.split(m)), list(tokens.split(m)),
                              caption_generator(0, 0, 0, 0), torch.device("cpu"))


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_each_precision_takes_a_step_on_cpu(precision):
    device = torch.device("cpu")
    base = tiny_model()
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prec = get_precision(precision, device)
    scaler = prec.scaler()
    assert (scaler is not None) == (precision == "fp16")
    if scaler is not None:
        assert scaler.get_scale() == 128.0
        assert scaler.get_growth_interval() == 200
    autocast = prec.autocast_factory
    mbs = _micro_batches(k=2)
    result = train_step(model, mbs, ClipLoss(), opt, scaler=scaler, autocast=autocast)
    # the same step in plain fp32: the autocast loss is close to it, not just finite
    ref_model = copy.deepcopy(base)
    reference = train_step(ref_model, mbs, ClipLoss(), torch.optim.SGD(ref_model.parameters(),
                                                                        lr=0.0))
    assert math.isfinite(result.loss)
    assert result.loss == pytest.approx(reference.loss, rel=2e-2)
    after, before = model.state_dict(), base.state_dict()
    moved = max((after[k].float() - before[k].float()).abs().max().item() for k in before)
    assert moved > 0, "the optimizer step changed nothing"


def test_autocast_dtype_is_what_the_flag_says():
    device = torch.device("cpu")
    x = torch.randn(4, 4)
    for precision, dtype in (("fp32", torch.float32), ("tf32", torch.float32),
                             ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with get_precision(precision, device).autocast():
            assert (x @ x).dtype == dtype, precision


def test_precision_names_and_aliases():
    assert [canonical_precision(n) for n in ("amp", "amp_bf16", "float32", "16", "BF16")] == [
        "fp16", "bf16", "fp32", "fp16", "bf16"]
    with pytest.raises(PrecisionError, match="precision 'int8': expected one of fp32, tf32"):
        canonical_precision("int8")


def test_activation_checkpointing_gives_the_same_gradients():
    base = tiny_model(dropout=0.0, drop_path_rate=0.0)
    grads = []
    for cp in (False, True):
        model = copy.deepcopy(base)
        model.set_grad_checkpointing(cp)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        grads.append(record_step_grads(model, opt))
        train_step(model, _micro_batches(k=2), ClipLoss(), opt, clip_grad_norm=None)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        a, b = grads[0][name].double(), grads[1][name].double()
        assert ((a - b).norm() / b.norm().clamp_min(1e-30)).item() < 1e-6, name


def test_weight_decay_exclusion_groups(tmp_path):
    model = tiny_model()
    args = parse_args(["--config", TINY_CONFIG, "--exclude-decay", "True",
                       "--weight-decay", "0.3", "--output", str(tmp_path)])
    opt = build_optimizer(model, args)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.3 and no_decay["weight_decay"] == 0.0
    ids = {id(p) for p in no_decay["params"]}
    assert id(model.logit_scale) in ids
    names = {n for n, p in model.named_parameters() if id(p) in ids}
    assert any(".ln" in n for n in names) and any(n.endswith("bias") for n in names)
    assert all(p.ndim >= 2 for p in decay["params"])
    args = parse_args(["--config", TINY_CONFIG, "--output", str(tmp_path)])
    assert args.exclude_decay is True  # the built-in dataset's default (the main job)
    args = parse_args(["--config", TINY_CONFIG, "--exclude-decay", "false",
                       "--output", str(tmp_path)])
    assert len(build_optimizer(model, args).param_groups) == 1  # the original: decay all


def test_out_of_memory_message_suggests_the_remedies(tmp_path):
    from rwkv_clip.train.loop import _is_oom, out_of_memory_message
    args = parse_args(["--config", TINY_CONFIG, "--batch-size", "32", "--output", str(tmp_path)])
    assert _is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert _is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: out of memory"))
    assert not _is_oom(RuntimeError("shape mismatch"))
    msg = out_of_memory_message(torch.OutOfMemoryError("CUDA out of memory"), args)
    assert "--open-checkpoint True" in msg and "--gradient-acc" in msg
    assert "--batch-size 32" in msg


def test_constant_mark_is_torchs_and_importing_does_not_load_dynamo():
    """ops.products.assume_constant_result sets the mark torch's own decorator sets, and
    importing the package, the trainer and the evaluator leaves torch._dynamo unloaded
    (it cost 2.4 s of every process's start-up)."""
    import subprocess
    import sys

    import torch._dynamo

    from rwkv_clip.ops.products import assume_constant_result, cpu_matmul_in_fp32

    def theirs():
        return 1

    def ours():
        return 1
    torch._dynamo.assume_constant_result(theirs)
    assume_constant_result(ours)
    assert vars(ours) == vars(theirs) == {"_dynamo_marked_constant": True}
    assert cpu_matmul_in_fp32._dynamo_marked_constant is True
    code = ("import sys, rwkv_clip, rwkv_clip.model, rwkv_clip.train.loop, rwkv_clip.eval.cli; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip() == "False"
