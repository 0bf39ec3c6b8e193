"""The table's auto path over the glue ops, end to end on the CPU: the Triton candidates
run under Triton's interpreter (the CPU stands in for the GPU), are checked against the
reference, timed beside the others and reported; a candidate that returns wrong numbers
or raises is dropped with its line, and the model's results stay the reference's.

The interpreter must be switched on before Triton is imported, so the cases run in a
subprocess (this file as a script)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GLUE_OPS = ("shift_lerp", "head_norm_gate", "relu_square")


def _tiny_step(pins: dict[str, str] | None = None):
    """Features and gradients of the tiny model's forward + backward (batch 2)."""
    import torch

    from rwkv_clip import create_RWKV_Model, load_model_configs
    from rwkv_clip.ops import dispatch
    dispatch.reset()
    dispatch.pin(pins or {})
    torch.manual_seed(0)
    args = load_model_configs(str(REPO / "model_config" / "RWKV_CLIP_tiny.json"))
    model = create_RWKV_Model(args)
    size = int(args.input_size)
    images = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(1, 1000, (2, int(args.ctx_len)),
                           generator=torch.Generator().manual_seed(2))
    img, txt, _ = model(images, tokens)
    (img.square().sum() + txt.square().sum()).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return [img.detach(), txt.detach()], grads


def _small_calls(pins: dict[str, str] | None = None):
    """The three glue ops at small shapes, each shift kind: results and input gradients."""
    import torch

    from rwkv_clip.ops import dispatch
    from rwkv_clip.ops.glue import Shift, head_norm_gate, relu_square, shift_lerp
    dispatch.reset()
    dispatch.pin(pins or {})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 16, generator=g, requires_grad=True)
    w = torch.rand(2, 1, 1, 16, generator=g, requires_grad=True)
    y = torch.randn(2, 12, 16, generator=g, requires_grad=True)
    p = torch.rand(16, generator=g) + 0.5
    outs = [*shift_lerp(x, w, Shift("q", 8, 1, (3, 4))), *shift_lerp(x, w, Shift("sequence", 8)),
            head_norm_gate(y, p, p - 1, x, 2, 1e-5), relu_square(y)]
    grads = torch.autograd.grad(sum(o.square().sum() for o in outs), (x, w, y))
    return [o.detach() for o in outs], list(grads)


def _max_rel(a, b) -> float:
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))
               for x, y in zip(a, b, strict=True))


def run(case: str) -> dict:
    from rwkv_clip.ops import dispatch
    lines: list[str] = []
    dispatch.set_reporter(lines.append, lines.append)
    if case == "wrong":  # the Triton squared ReLU off by 1%, the Triton shift raising
        from rwkv_clip.ops.glue import relu_square_kernel, shift_lerp_kernel
        forward = relu_square_kernel.forward
        relu_square_kernel.forward = lambda x: forward(x) * 1.01

        def broken(*args, **kwargs):
            raise RuntimeError("launch failed")
        shift_lerp_kernel.forward = broken
    step = _tiny_step if case == "good" else _small_calls
    outs, grads = step()
    chosen, auto_lines = dispatch.choices(), list(lines)
    ref_outs, ref_grads = step({op: "reference" for op in GLUE_OPS})
    return {"lines": auto_lines, "choices": chosen, "out_error": _max_rel(outs, ref_outs),
            "grad_error": _max_rel(grads, ref_grads)}


def _run(case: str, tmp_path) -> dict:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", RWKV_CLIP_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RWKV_CLIP_DISPATCH", None)
    res = subprocess.run([sys.executable, __file__, case], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_auto_checks_and_times_the_triton_candidates_in_the_interpreter(tmp_path):
    res = _run("good", tmp_path)
    by_op: dict[str, list[dict]] = {}
    for choice in res["choices"].values():
        by_op.setdefault(choice["op"], []).append(choice)
    assert set(GLUE_OPS) <= set(by_op)
    for op in GLUE_OPS:
        for choice in by_op[op]:
            assert choice["how"] == "auto"
            # every candidate passed its check and was timed; the fastest won
            assert {"triton", "reference"} <= set(choice["times_ms"]) and \
                len(choice["times_ms"]) == 3, choice
            times = choice["times_ms"]
            assert choice["implementation"] == min(times, key=times.__getitem__)
    reported = [line for line in res["lines"] if line.startswith(GLUE_OPS)]
    assert len(reported) == sum(len(v) for op, v in by_op.items() if op in GLUE_OPS)
    assert all(" over " in line and "triton (" in line for line in reported)
    assert not any("dropped" in line for line in res["lines"])
    assert res["out_error"] < 1e-5 and res["grad_error"] < 1e-4


def test_a_wrong_or_raising_candidate_is_dropped_with_its_line(tmp_path):
    res = _run("wrong", tmp_path)
    dropped = [line for line in res["lines"] if "dropped" in line]
    assert any(line.startswith("dispatch: relu_square: dropped triton: output differs")
               for line in dropped), dropped
    assert any(line.startswith("dispatch: shift_lerp: dropped triton: raised RuntimeError: "
                               "launch failed") for line in dropped), dropped
    for choice in res["choices"].values():
        if choice["op"] in ("relu_square", "shift_lerp"):
            assert "triton" not in choice["times_ms"] and choice["implementation"] != "triton"
    # each drop said once, however many shapes asked
    assert len(dropped) == len(set(dropped)) == 2
    assert res["out_error"] < 1e-5 and res["grad_error"] < 1e-4


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
