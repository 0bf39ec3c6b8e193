"""The dispatch table (rwkv_clip.ops.dispatch): ``auto`` checks each candidate against
the reference, drops the ones that raise or miss with one line each, times the rest,
caches the winner on disk and reports it once; pins and the override win; the WKV op
goes through it. A test-only op in the same table stands for an op with bad candidates."""
from __future__ import annotations

import json
import time

import pytest
import torch

from rwkv_clip.errors import WKVError
from rwkv_clip.ops import WKV, dispatch, wkv6_bidirectional, wkv6_bidirectional_reference
from rwkv_clip.ops.dispatch import DispatchError, Implementation, Op

OP = "test-double"


def _on_cpu(device, dtype, shape):
    return None if device.type == "cpu" else f"needs CPU tensors, got {device}"


def _good(x):
    return x * torch.full_like(x, 2.0)  # saves a tensor for backward


def _slow(x):
    time.sleep(0.02)
    return x * 2


def _raises(x):
    raise RuntimeError("no kernel for this machine")


def _wrong(x):
    return x * 2.1


def _check_inputs(device, dtype, attrs, shape):
    return [torch.linspace(-1, 1, 16, device=device, dtype=dtype)], {}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A test-only op with a good, a slow, a raising and a wrong implementation (the
    bad ones fastest), a fresh cache folder, and the lines the table reports."""
    monkeypatch.setenv("RWKV_CLIP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(dispatch.OVERRIDE_ENV_VAR, raising=False)
    op = dispatch.register_op(Op(
        name=OP, reference=lambda x: 2 * x, check_inputs=_check_inputs,
        tolerance={torch.float64: 1e-9, torch.float32: 1e-6, torch.bfloat16: 1e-2},
        shape_class=lambda x: {"n": int(x.shape[-1])}))
    for name, fn in (("good", _good), ("slow", _slow), ("raises", _raises), ("wrong", _wrong)):
        op.register(Implementation(name, fn, _on_cpu, ("cpu",)))
    lines: dict[str, list[str]] = {"info": [], "warn": []}
    dispatch.reset()
    dispatch.set_reporter(lines["info"].append, lines["warn"].append)
    yield lines
    dispatch.set_reporter()
    dispatch.reset()
    dispatch.TABLE.pop(OP)


def _x(n=64):
    return torch.randn(3, n, requires_grad=True)


def test_auto_checks_times_caches_and_a_fresh_process_reads_the_cache(table, tmp_path):
    impl = dispatch.choose(OP, (_x(),))
    assert impl.name == "good"
    assert dispatch.counters == {"checked": 4, "timed": 2}  # raises, wrong: never timed
    assert len(table["info"]) == 1
    line = table["info"][0]
    assert line.startswith(f"{OP}: good (") and " over slow (" in line
    assert line.endswith(", float32, n=64 pass=fwd+bwd") and "cached" not in line
    stored = json.loads((tmp_path / "cache" / "kernels" / dispatch.CACHE_FILE).read_text())
    (key, record), = stored["choices"].items()
    assert key == dispatch.cache_key(OP, dispatch.device_name(torch.device("cpu")),
                                     torch.float32, {"n": 64, "pass": "fwd+bwd"})
    assert record["implementation"] == "good" and set(record["times_ms"]) == {"good", "slow"}

    dispatch.reset()  # what a new process starts from: the disk cache only
    assert dispatch.choose(OP, (_x(),)).name == "good"
    assert dispatch.counters == {"checked": 0, "timed": 0}
    assert table["info"][-1].startswith(f"{OP}: good (") and ", cached)" in table["info"][-1]
    assert dispatch.choices()[f"{OP} cpu float32 n=64 pass=fwd+bwd"]["how"] == "cache"


def test_a_candidate_that_raises_or_misses_is_dropped_with_one_line(table):
    for n in (8, 64, 64, 9):
        assert dispatch.choose(OP, (_x(n),)).name == "good"
    warn = table["warn"]
    assert len(warn) == 2, warn
    raised, = (w for w in warn if "raises" in w)
    assert raised == (f"dispatch: {OP}: dropped raises: raised RuntimeError: no kernel for this "
                      "machine")
    wrong, = (w for w in warn if "wrong" in w)
    assert wrong.startswith(f"dispatch: {OP}: dropped wrong: output differs from the reference "
                            "by 5.00e-02 (tolerance 1e-09, float64)")
    assert {c["implementation"] for c in dispatch.choices().values()} == {"good"}


def test_the_choice_line_is_printed_once_per_process(table):
    for _ in range(3):
        dispatch.choose(OP, (_x(16),))
    dispatch.choose(OP, (_x(32),))  # another shape class: its own choice and line
    assert [ln.split(" (")[0] for ln in table["info"]] == [f"{OP}: good", f"{OP}: good"]
    assert [ln.rsplit(", ", 1)[1] for ln in table["info"]] == ["n=16 pass=fwd+bwd", "n=32 pass=fwd+bwd"]
    assert dispatch.counters["timed"] == 4  # good and slow, once per shape class


def test_pins_and_the_override_choose_without_timing(table, monkeypatch):
    assert dispatch.choose(OP, (_x(),), pinned="slow").name == "slow"
    dispatch.pin({OP: "wrong"})  # a pin is trusted: nothing checked
    assert dispatch.choose(OP, (_x(),)).name == "wrong"
    assert dispatch.pins() == {OP: "wrong"}
    assert table["info"] == [f"{OP}: slow (pinned), float32, n=64 pass=fwd+bwd",
                             f"{OP}: wrong (pinned), float32, n=64 pass=fwd+bwd"]
    dispatch.pin(f"{OP}=auto")
    monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR, f"{OP}=slow")
    dispatch.reset()
    table["info"].clear()
    assert dispatch.choose(OP, (_x(),)).name == "slow"
    assert dispatch.counters == {"checked": 0, "timed": 0}
    assert table["info"] == [f"{OP}: slow (override), float32, n=64 pass=fwd+bwd"]


def test_an_unknown_name_is_one_clear_error(table, monkeypatch):
    with pytest.raises(DispatchError, match=f"unknown op 'nope'; expected one of .*{OP}"):
        dispatch.pin({"nope": "good"})
    with pytest.raises(Exception, match=(f"unknown {OP} implementation 'fast' \\(from pin\\); "
                                         "expected one of auto, good, slow, raises, wrong")):
        dispatch.pin({OP: "fast"})
    monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR, "wkv=fastest")
    dispatch.reset()
    with pytest.raises(WKVError, match="unknown wkv implementation 'fastest' .*cpu, reference"):
        dispatch.override()
    monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR, "wkv")
    dispatch.reset()
    with pytest.raises(DispatchError, match="'wkv' is not op=implementation"):
        dispatch.override()
    monkeypatch.delenv(dispatch.OVERRIDE_ENV_VAR)
    dispatch.reset()
    with pytest.raises(WKVError, match="'cuda-fast' .* cannot run here: needs CUDA tensors"):
        wkv6_bidirectional(*(torch.randn(1, 3, 4) for _ in range(4)), torch.randn(1, 4),
                           backend="cuda-fast")


def test_the_cache_key_follows_device_torch_version_and_shape_class(table, monkeypatch):
    from rwkv_clip import cpu_isa
    cpu = torch.device("cpu")
    dispatch.choose(OP, (_x(),))
    assert dispatch.counters["timed"] == 2
    dispatch.reset()
    monkeypatch.setattr(torch, "__version__", "99.0")  # another torch: measured again
    dispatch.choose(OP, (_x(),))
    assert dispatch.counters["timed"] == 2
    dispatch.reset()
    dispatch.choose(OP, (_x(65),))  # another shape class: measured again
    assert dispatch.counters["timed"] == 2
    keys = {dispatch.cache_key(OP, dispatch.device_name(cpu), dt, {"n": 64})
            for dt in (torch.float32, torch.bfloat16)}
    assert len(keys) == 2
    if cpu_isa.cpu_info().hardware_level != "base":  # the same CPU capped: another key
        uncapped = dispatch.device_name(cpu)
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
        assert dispatch.device_name(cpu) != uncapped and dispatch.device_name(cpu).endswith("base")


def test_the_measuring_runs_are_hidden_from_the_callers_saved_tensor_hooks(table):
    """A memory count or an offload policy around the first call sees that call only."""
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t
    x = _x()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        impl = dispatch.choose(OP, (x,))
        assert dispatch.counters["timed"] == 2 and packed == []
        impl.fn(x)
    assert packed == [x.shape]


def test_under_compile_nothing_is_timed_and_the_graph_is_whole(table):
    def double(x):
        return dispatch.choose(OP, (x,)).fn(x)

    import torch._dynamo
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    y = torch.compile(double, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(y, 2 * x)  # the first registered: good
    assert dispatch.counters == {"checked": 0, "timed": 0} and table["info"] == []


@pytest.mark.parametrize("dtype, grad_tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_wkv_through_the_table_matches_the_reference(dtype, grad_tol, tmp_path, monkeypatch):
    monkeypatch.delenv(dispatch.OVERRIDE_ENV_VAR, raising=False)
    dispatch.reset()
    lines: list[str] = []
    dispatch.set_reporter(lines.append)
    try:
        g = torch.Generator().manual_seed(0)
        B, T, H, N = 2, 7, 2, 16
        r, k, v = (torch.randn(B, T, H * N, generator=g) for _ in range(3))
        w = torch.randn(B, T, H * N, generator=g) * 0.7 - 1.5
        u = torch.randn(H, N, generator=g) * 0.5
        xs = [x.to(dtype).requires_grad_() for x in (r, k, v, w, u)]
        y = wkv6_bidirectional(*xs)
        gy = torch.randn(y.shape, generator=g)
        grads = torch.autograd.grad(y, xs, gy)
        exact = [x.detach().double().requires_grad_() for x in xs]
        y_ref = wkv6_bidirectional_reference(*exact)
        ref_grads = torch.autograd.grad(y_ref, exact, gy.double())

        def rel(a, b):
            return float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max())
        assert rel(y, y_ref) <= 1e-5
        for a, b, x in zip(grads, ref_grads, xs, strict=True):
            assert a.dtype == x.dtype and rel(a, b) <= grad_tol
        chosen, = dispatch.choices().values()
        assert chosen["op"] == "wkv" and chosen["implementation"] in ("cpu", "reference")
        assert lines and lines[0].startswith(f"wkv: {chosen['implementation']} (")
        assert lines[0].endswith(f", {str(dtype)[6:]}, T={T} N={N} pass=fwd+bwd")
    finally:
        dispatch.set_reporter()
        dispatch.reset()


def test_every_wkv_implementation_states_where_it_runs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    shape = {"T": 49, "N": 64}
    names = {n: i.supports(cpu, torch.float32, shape) for n, i in WKV.implementations.items()}
    assert names["cpu"] is None and names["reference"] is None
    assert all("CUDA tensors" in names[n] or "Triton" in names[n]
               for n in ("cuda-fast", "cuda-faithful", "chunked"))
    assert WKV.implementations["cpu"].supports(cuda, torch.float32, shape) is not None
    assert "N=256" not in (WKV.implementations["cuda-fast"].supports(
        cuda, torch.bfloat16, {"T": 3, "N": 256}) or "")
    assert "N=260" in WKV.implementations["cuda-fast"].supports(cuda, torch.float32,
                                                                {"T": 3, "N": 260})
    assert WKV.resolve("cuda", "cuda") == "cuda-fast"  # the old backend name
    assert dispatch.check(WKV, WKV.implementations["reference"], cpu, torch.float32) is None


@pytest.fixture
def wkv_table(tmp_path, monkeypatch):
    """The real table's WKV op, no override, a cache of the test's own, choice lines off."""
    monkeypatch.delenv(dispatch.OVERRIDE_ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "cache_path", lambda: tmp_path / "dispatch.json")
    dispatch.reset()
    dispatch.set_reporter(lambda line: None)
    yield dispatch
    dispatch.set_reporter()
    dispatch.reset()


def test_the_reference_is_timed_only_when_nothing_else_passes(wkv_table):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, 5, 32, generator=g) for _ in range(4)]
    wkv6_bidirectional(*xs, torch.randn(2, 16, generator=g))
    chosen, = dispatch.choices().values()
    assert chosen["implementation"] == "cpu" and set(chosen["times_ms"]) == {"cpu"}
    assert dispatch.counters == {"checked": 2, "timed": 1}


def test_a_first_choice_inside_selective_checkpointing_leaves_the_recompute_alone(wkv_table):
    """The measuring runs are hidden from the caller's dispatch modes: selective activation
    checkpointing replays the forward's saved outputs in the recompute by their order, so
    a check seen in the forward (and not in the recompute, the choice being made) would
    hand the model the check's tensors."""
    from functools import partial

    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 6, 32, generator=g) for _ in range(4)] + [
        torch.randn(2, 16, generator=g)]
    xs = [x.requires_grad_() for x in xs]
    context = partial(create_selective_checkpoint_contexts,
                      lambda ctx, op, *a, **k: CheckpointPolicy.MUST_SAVE)

    def block(*t):  # the WKV output is saved for the backward (the square's)
        return wkv6_bidirectional(*t).view(-1, 32).square()

    y = checkpoint(block, *xs, use_reentrant=False, context_fn=context)
    grads = torch.autograd.grad(y.sum(), xs)
    exact = [x.detach().double().requires_grad_() for x in xs]
    y_ref = wkv6_bidirectional_reference(*exact).view(-1, 32).square()
    for a, b in zip((y, *grads), (y_ref, *torch.autograd.grad(y_ref.sum(), exact)),
                    strict=True):
        assert float((a.detach().double() - b).abs().max()) <= 1e-5 * float(b.abs().max())


def test_adopted_choices_are_used_per_shape_and_the_rest_is_chosen(table, tmp_path):
    """Another process's choices (rank 0's, a run's dispatch.json) taken as they are:
    nothing checked or timed for the shapes they cover; another shape is chosen as usual."""
    dispatch.choose(OP, (_x(64),))
    stored = dispatch.choices()
    stored[f"{OP} cpu float32 n=64 pass=fwd+bwd"]["implementation"] = "slow"  # what the other chose
    path = tmp_path / "dispatch.json"
    path.write_text(json.dumps(stored))
    dispatch.reset()
    assert dispatch.apply_setting(str(path), "--dispatch") == f"1 choice(s) adopted from {path}"
    assert dispatch.choose(OP, (_x(64),)).name == "slow"
    assert dispatch.counters == {"checked": 0, "timed": 0}
    assert table["info"][-1] == f"{OP}: slow (adopted), float32, n=64 pass=fwd+bwd"
    assert dispatch.choose(OP, (_x(32),)).name == "good"  # not covered: auto
    assert dispatch.choices()[f"{OP} cpu float32 n=32 pass=fwd+bwd"]["how"] == "auto"


def test_the_dispatch_setting_pins_or_says_what_is_wrong(table, tmp_path):
    assert dispatch.apply_setting("", "--dispatch") == "auto"
    assert dispatch.apply_setting("auto", "--dispatch") == "auto"
    assert dispatch.apply_setting(f"{OP}=slow", "--dispatch") == f"pinned {OP}=slow"
    assert dispatch.choose(OP, (_x(),)).name == "slow"
    with pytest.raises(DispatchError, match="--dispatch: unknown op 'nope'; expected one of"):
        dispatch.apply_setting("nope=x", "--dispatch")
    missing = tmp_path / "missing.json"
    with pytest.raises(DispatchError, match="cannot read the dispatch choices .*missing.json"):
        dispatch.apply_setting(str(missing), "--dispatch")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(DispatchError, match="expected a run's dispatch.json"):
        dispatch.apply_setting(str(bad), "--dispatch")
    bad.write_text(json.dumps({"k": {"op": "nope", "implementation": "x", "device": "cpu",
                                     "dtype": "float32", "shape": "n=1"}}))
    with pytest.raises(DispatchError, match="unknown op 'nope'"):
        dispatch.apply_setting(str(bad), "--dispatch")
    bad.write_text(json.dumps({"k": {"op": OP}}))
    with pytest.raises(DispatchError, match="is not a dispatch choice"):
        dispatch.apply_setting(str(bad), "--dispatch")


def test_preferred_implementations_run_where_they_can(table):
    dispatch.prefer({OP: "slow"})
    try:
        assert dispatch.choose(OP, (_x(),)).name == "slow"
        assert dispatch.counters == {"checked": 0, "timed": 0}
        dispatch.reset()  # prefer survives a reset
        assert dispatch.choose(OP, (_x(),)).name == "slow"
    finally:
        dispatch.prefer({})


def test_timing_takes_each_candidates_best_run_in_rounds(table):
    """A load spike slows runs, not candidates: the candidates run in turn and each one's
    best run counts, so a fast implementation slowed twice still wins."""
    calls = {"spiky": 0}

    def spiky(x):
        calls["spiky"] += 1
        if calls["spiky"] in (3, 4, 5):  # three of its timed runs hit a spike
            time.sleep(0.05)
        return x * 2

    def steady(x):
        time.sleep(0.005)
        return x * 2
    op = dispatch.TABLE[OP]
    for name in ("good", "slow", "raises", "wrong"):
        op.implementations.pop(name)
    op.register(Implementation("steady", steady, _on_cpu, ("cpu",)))
    op.register(Implementation("spiky", spiky, _on_cpu, ("cpu",)))
    assert dispatch.choose(OP, (_x(),)).name == "spiky"
    chosen = dispatch.choices()[f"{OP} cpu float32 n=64 pass=fwd+bwd"]["times_ms"]
    assert chosen["spiky"] < 5 <= chosen["steady"]
    # checked once, then one warm-up run and the rounds
    assert calls["spiky"] == 1 + 1 + dispatch.TIMED_ITERATIONS


def test_product_choices_are_reported_stored_and_adopted_per_shape(table):
    """The fp32 Linear's choice (aten or onednn) is one of the table's: one line, kept
    with the choices, adopted by another process for the same product only."""
    x, w = torch.randn(4, 40), torch.randn(24, 40)
    name = dispatch.choose("linear", (x, w, None)).name
    record = dispatch.choices()["linear cpu float32 K=40 N=24"]
    assert record["implementation"] == name and record["how"] == "auto"
    assert table["info"][-1].startswith(f"linear: {name} (") and \
        table["info"][-1].endswith(", float32, K=40 N=24")
    other = next(n for n in ("aten", "onednn") if n != name)
    dispatch.reset()
    dispatch.adopt({"k": dict(record, implementation=other)})
    if dispatch.get_op("linear").implementations[other].supports(x.device, x.dtype, {}) is None:
        assert dispatch.choose("linear", (x, w, None)).name == other
    assert dispatch.choose("linear", (x, torch.randn(8, 40), None)).name in ("aten", "onednn")
    assert dispatch.choices()["linear cpu float32 K=40 N=8"]["how"] in ("auto", "cache")
