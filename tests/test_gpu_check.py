"""The GPU check's offline install stage: the travelling wheels cover what the project
imports on a lent device, and they install and import the way gpu_check.sh does it.

The device is offline, so a wheel missing from scripts/device_wheels.txt is only found
there, at the cost of the whole lent slot. These tests find it here: statically (every
third-party import of the project is preinstalled on the device or travels as a wheel),
and, with the wheels at hand (.whl/, or fetched by scripts/device_wheels.sh where pip can
reach an index), by installing them into a fresh target folder and importing the stack.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up there
spec.loader.exec_module(gpu_check)

# imported only where they exist (importorskip / try-import), never needed on the device
OPTIONAL = {"matplotlib",  # report.png only; train.py logs "report not drawn" without it
            "nvidia", "fla_anchor", "train_util", "test_data_common", "zero_shot", "train",
            "dali_top", "mxnet",
            # the optional extras (onnx, lora, linear-probe, wandb): imported inside the
            # functions that need them, a one-line error where missing
            "onnx", "onnxruntime", "onnxscript", "peft", "sklearn", "wandb"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed_dists() -> set[str]:
    text = (REPO / "scripts" / "device_wheels.txt").read_text()
    reqs = [re.sub(r"#.*", "", line).strip() for line in text.splitlines()]
    return {norm(r.split("==")[0]) for r in reqs if r} | {"torchvision"}


def project_imports() -> set[str]:
    """Top-level names of every absolute import in the code the check runs."""
    files = [*(REPO / "rwkv_clip").rglob("*.py"), *(REPO / "scripts").glob("*.py"),
             *(REPO / "tests").glob("*.py"), REPO / "train.py", REPO / "zero_shot.py",
             REPO / "dali.py"]
    names = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_wheel_list_matches_the_checks_table():
    assert listed_dists() == {norm(d) for d in gpu_check.WHEEL_DISTS}


def test_every_project_import_is_preinstalled_or_travels():
    own_modules = {p.stem for folder in ("tests", "scripts", ".") for p in (REPO / folder).glob("*.py")}
    available = (set(sys.stdlib_module_names) | set(gpu_check.WHEEL_DISTS.values())
                 | set(gpu_check.DEVICE_PREINSTALLED.values()) | {"rwkv_clip"} | OPTIONAL
                 | own_modules)  # the tests' and scripts' own helpers travel with the tree
    missing = sorted(project_imports() - available)
    assert not missing, f"imported by the project but neither on the device nor in .whl/: {missing}"


def wheel_requirements(whl: Path) -> set[str]:
    """Unconditional Requires-Dist names of a wheel (extras and markers dropped)."""
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    reqs = set()
    for line in lines:
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            reqs.add(norm(re.split(r"[\s;(<>=!~\[]", line.split(":", 1)[1].strip())[0]))
    return reqs


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    folder = REPO / ".whl"
    if not list(folder.glob("*.whl")):
        folder = tmp_path_factory.mktemp("whl")
        try:
            proc = subprocess.run(["bash", str(REPO / "scripts" / "device_wheels.sh"),
                                   "--dest", str(folder)], capture_output=True, text=True,
                                  timeout=300)
        except subprocess.TimeoutExpired:
            pytest.skip("no .whl/ and scripts/device_wheels.sh timed out (no index reachable?)")
        if proc.returncode != 0:
            pytest.skip(f"no .whl/ and scripts/device_wheels.sh failed (no index reachable?): "
                        f"{proc.stderr.strip()[-300:]}")
    return folder


def test_wheels_bring_their_own_requirements(wheels):
    """Installed with --no-deps, so each wheel's requirements must travel or be there."""
    have = {norm(d) for d in (*gpu_check.WHEEL_DISTS, *gpu_check.DEVICE_PREINSTALLED)}
    present = {norm(gpu_check.wheel_name_tags(w)[0]) for w in wheels.glob("*.whl")}
    assert listed_dists() <= present, f"not downloaded: {sorted(listed_dists() - present)}"
    for whl in wheels.glob("*.whl"):
        missing = wheel_requirements(whl) - have
        assert not missing, f"{whl.name} needs {sorted(missing)}: add them to device_wheels.txt"


@pytest.mark.slow  # imports torch, open_clip, timm and fla in a fresh interpreter
def test_install_and_import_stage(wheels, tmp_path):
    site = tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = gpu_check.install_wheels(sys.executable, site, [wheels], env)
    assert res["status"] == "ok", res["stderr_tail"]
    pure = [w for w in res["installed"] if w.endswith("-none-any.whl")]
    # every wheel is either installed or left out with its reason; no pure one is left out
    assert set(res["installed"]) | set(res["left_out"]) == {w.name for w in wheels.glob("*.whl")}
    assert sorted(pure) == sorted(w.name for w in wheels.glob("*-none-any.whl")), res
    env.update(PYTHONPATH=f"{site}{os.pathsep}{REPO}", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"),
                           "--subcommand", "imports", str(site)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and not out["missing"], out["missing"] or proc.stderr[-2000:]
    assert out["rwkv_clip"]["tokens_shape"] == [1, 77]
    # the pure-Python wheels are the ones imported (first on the path), not the host's
    for dist, module in gpu_check.WHEEL_DISTS.items():
        if any(norm(w).startswith(norm(dist) + "-") for w in pure):
            assert out["modules"][module]["from_wheels"], (module, out["modules"][module])


def test_binary_wheel_for_another_python_is_left_out(tmp_path):
    """The cp312 torchvision meant for the device is not installed into this Python."""
    other = "cp312" if sys.version_info[:2] != (3, 12) else "cp311"
    fake = tmp_path / f"torchvision-0.26.0-{other}-{other}-manylinux_2_28_x86_64.whl"
    fake.write_bytes(b"")
    dist, tags = gpu_check.wheel_name_tags(fake)
    assert dist == "torchvision" and f"{other}-{other}-manylinux_2_28_x86_64" in tags
    assert not tags & gpu_check.wheel_tags(sys.executable)
    res = gpu_check.install_wheels(sys.executable, tmp_path / "site", [tmp_path], dict(os.environ))
    assert res["installed"] == [] and fake.name in res["left_out"] and res["status"] == "failed"


def test_last_json_reads_indented_and_one_line_output():
    assert gpu_check.last_json('noise\n{"a": 1}\n') == {"a": 1}
    assert gpu_check.last_json('{\n "b": [\n  2\n ]\n}') == {"b": [2]}
    assert gpu_check.last_json("warning: x\n{\n \"c\": 3\n}\n") == {"c": 3}
    assert gpu_check.last_json("no json here") is None


def test_the_check_imports_names_the_project_has():
    """Every ``from rwkv_clip... import NAME`` in the check's scripts exists (the check must
    work the first time on a lent machine; a renamed helper would only fail there)."""
    import ast
    import importlib

    for script in ("gpu_check.py", "bench_train.py", "bench_wkv.py", "bench_infer.py",
                   "profile_step.py", "bench_glue.py"):
        path = Path(__file__).resolve().parents[1] / "scripts" / script
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rwkv_clip"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{script}: {node.module}.{alias.name}"


def test_summary_carries_the_resolution_sweep():
    runner = gpu_check.Runner(100, {}, rehearse=True, cuda=False)
    case = {"task": "infer", "precision": "bf16", "side": 896, "tokens": 3136, "batch": 4,
            "rwkv_clip": {"median_s": 0.02}, "open_clip": {"error": "RuntimeError: x"}}
    fits = [{"model": "rwkv_clip", "task": "infer", "time_slope": 1.01}]
    runner.steps["resolution_bf16"] = {"status": "ok",
                                       "result": {"cases": [case], "slopes": fits}}
    assert gpu_check.summarize(runner)["resolution"] == {
        "cases": [{"task": "infer", "side": 896, "tokens": 3136, "rwkv_clip": 0.02,
                   "open_clip": "RuntimeError: x"}],
        "slopes": fits}
    runner.steps.clear()  # the step skipped or failed without JSON: an empty record
    assert gpu_check.summarize(runner)["resolution"] == {"cases": [], "slopes": []}


def test_only_runs_the_selected_steps():
    runner = gpu_check.Runner(100, dict(os.environ), rehearse=False, cuda=False, only={"kept"})
    assert runner.run(gpu_check.Step("kept", [sys.executable, "-c", "print('{}')"], 30))[
        "status"] == "ok"
    rec = runner.run(gpu_check.Step("left", [sys.executable, "-c", "raise SystemExit(1)"], 30))
    assert rec["status"] == "skipped" and "not selected" in rec["reason"]


def test_speed_steps_parse_with_their_scripts_flags():
    """The speed steps' commands (and dry forms) are accepted by the scripts they run: a
    misspelt flag would otherwise surface only on the lent machine."""
    import argparse

    from rwkv_clip.bench.resolution import add_flags
    spec = importlib.util.spec_from_file_location("profile_step",
                                                  REPO / "scripts" / "profile_step.py")
    profile_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_step)
    steps = gpu_check.speed_steps({name: 60 for name in gpu_check.SPEED_STEPS})
    assert [s.name for s in steps] == list(gpu_check.SPEED_STEPS)
    for step in steps:
        assert step.cuda and step.dry
        for cmd in (step.cmd, step.dry):
            script = Path(cmd[1]).name
            if script == "bench_resolution.py":
                ap = argparse.ArgumentParser()
                add_flags(ap)
            else:
                assert script == "profile_step.py"
                ap = profile_step.build_parser()
            ns = ap.parse_args(cmd[2:])
            assert ns.device == ("cuda" if cmd is step.cmd else "cpu")
    versus = gpu_check.speed_steps({name: 60 for name in gpu_check.SPEED_STEPS})[0].cmd
    assert versus[versus.index("--batch-size") + 1] == "256"


def test_glue_step_parses_with_its_scripts_flags():
    """The glue group's timing step (and its dry form) parse with bench_glue.py's flags, at
    B/32 batch 256 bf16 on CUDA, tiny and trace-only on the CPU; its time guard leaves the
    step's last case room to finish."""
    spec = importlib.util.spec_from_file_location("bench_glue", REPO / "scripts" / "bench_glue.py")
    bench_glue = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_glue)
    step = gpu_check.glue_step(240)
    assert step.name in gpu_check.STEP_GROUPS["glue"] and step.cuda and step.dry
    ns = bench_glue.build_parser().parse_args(step.cmd[2:])
    assert (ns.device, ns.batch, ns.dtype, ns.config) == ("cuda", 256, "bf16", gpu_check.B32)
    assert ns.max_seconds < step.timeout
    dry = bench_glue.build_parser().parse_args(step.dry[2:])
    assert (dry.device, dry.batch, dry.compile_backend) == ("cpu", 1, "aot_eager")
    assert (REPO / gpu_check.GLUE_TESTS).is_file()  # the group's tests, by path


def test_summary_carries_the_glue_ratios():
    runner = gpu_check.Runner(100, {}, rehearse=True, cuda=False)
    ratio = {"ratio": 1.8, "ratio_range": [1.5, 2.0], "gain": "ours"}
    runner.steps["glue_ops"] = {"status": "ok", "result": {"cases": [
        {"name": "image_relu_square", "fastest": "triton", "triton_vs_eager": ratio,
         "compiled_vs_eager": dict(ratio, ratio=1.2), "modes": {}},
        {"name": "text_relu_square", "op": "relu_square", "skipped": "out of time"}]}}
    assert gpu_check.summarize(runner)["glue"] == [
        {"name": "image_relu_square", "fastest": "triton", "triton_vs_eager": 1.8,
         "compiled_vs_eager": 1.2},
        {"name": "text_relu_square", "fastest": None, "skipped": "out of time"}]
    runner.steps.clear()
    assert gpu_check.summarize(runner)["glue"] == []


def test_selection_adds_what_every_step_needs():
    """GPU_CHECK_ONLY: groups expand to their steps; the environment and imports always run,
    the kernel build unless only the glue group (no native kernel) is selected."""
    assert gpu_check.selected_steps(None) is None and gpu_check.selected_steps(" ,") is None
    glue = gpu_check.selected_steps("glue")
    assert glue == {"environment", "imports", *gpu_check.GLUE_STEPS}
    speed = gpu_check.selected_steps("speed, glue_ops")
    assert speed == {*gpu_check.ALWAYS, *gpu_check.SPEED_STEPS, "glue_ops"}
    assert gpu_check.selected_steps("wkv_bf16") == {*gpu_check.ALWAYS, "wkv_bf16"}


def test_an_ordinary_environment_needs_no_wheels(tmp_path):
    """docs/gpu-check.md's first way: the project's venv runs the check with no .whl/; the
    wheels step is skipped, saying so, and the site folder holds nothing to shadow the
    venv's packages."""
    empty = tmp_path / "whl"
    empty.mkdir()
    res = gpu_check.install_wheels(sys.executable, tmp_path / "site", [empty], dict(os.environ))
    assert res["status"] == "skipped" and "own packages" in res["reason"]
    assert res["installed"] == [] and list((tmp_path / "site").iterdir()) == []
