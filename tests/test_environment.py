"""The environment variables rwkv_clip reads: the few that cannot be configuration (the
cache root, the kernel lock timeout, the dispatch override), listed once in
docs/training.md; every variable no longer read stops a run with one line naming its
replacement."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rwkv_clip.errors import DispatchError
from rwkv_clip.ops import build, dispatch

REPO = Path(__file__).resolve().parents[1]
NAME = re.compile(r"RWKV_CLIP_[A-Z0-9_]*[A-Z0-9]\b")
CONFIG_NAMES = {p.stem for p in (REPO / "model_config").glob("RWKV_CLIP_*.json")}
MAX_VARIABLES = 4


def _sources() -> list[Path]:
    """The package, the scripts and the top-level programs."""
    files = [*REPO.glob("rwkv_clip/**/*.py"), *REPO.glob("scripts/*"), *REPO.glob("*.py")]
    return sorted(p for p in files if p.is_file() and p.suffix in (".py", ".sh"))


def _names_in_sources() -> dict[str, set[str]]:
    """Each ``RWKV_CLIP_*`` name in the sources (config names aside) -> the files naming it."""
    found: dict[str, set[str]] = {}
    for path in _sources():
        for name in NAME.findall(path.read_text()):
            if name not in CONFIG_NAMES:
                found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


def _documented() -> list[str]:
    """The variables listed under "Environment variables" in docs/training.md."""
    text = (REPO / "docs" / "training.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- `(RWKV_CLIP_[A-Z_]+)`", section, re.M)


def test_the_package_reads_only_the_documented_variables():
    """Every name in the sources is a variable read (dispatch.ENV_VARS, at most four,
    the list of the docs) or, only in dispatch.REPLACED_ENV_VARS, one no longer read."""
    found = _names_in_sources()
    replaced = set(dispatch.REPLACED_ENV_VARS)
    for name in replaced & set(found):
        assert found[name] == {"rwkv_clip/ops/dispatch.py"}, (name, found[name])
        text = (REPO / "rwkv_clip" / "ops" / "dispatch.py").read_text()
        assert text.count(f'"{name}"') == 1 and text.count(name) == 1, name
    read = set(found) - replaced
    assert read == set(dispatch.ENV_VARS)
    assert len(read) <= MAX_VARIABLES
    assert sorted(_documented()) == sorted(dispatch.ENV_VARS)


def test_every_replaced_variable_is_in_the_docs_table():
    section = (REPO / "docs" / "training.md").read_text().split("## Environment variables", 1)[1]
    for name in dispatch.REPLACED_ENV_VARS:
        assert f"`{name}`" in section, name


@pytest.fixture
def fresh_override(monkeypatch):
    """The override read afresh, no replaced variable set."""
    for name in dispatch.REPLACED_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(dispatch.OVERRIDE_ENV_VAR, raising=False)
    dispatch.reset()
    yield
    dispatch.reset()


@pytest.mark.parametrize("name", sorted(dispatch.REPLACED_ENV_VARS))
def test_a_replaced_variable_stops_the_override_with_one_line(name, monkeypatch, fresh_override):
    monkeypatch.setenv(name, "x")
    with pytest.raises(DispatchError) as exc:
        dispatch.override()
    message = str(exc.value)
    assert "\n" not in message
    assert message == (f"{name} is not read; use {dispatch.REPLACED_ENV_VARS[name]} instead "
                       "(docs/training.md#environment-variables)")


def test_a_replaced_variable_stops_zero_shot_py_in_one_line():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(Path.home()),
           "RWKV_CLIP_DATA_ROOT": "/data"}
    out = subprocess.run([sys.executable, "zero_shot.py", "--device", "cpu"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip() == ("zero_shot.py: error: RWKV_CLIP_DATA_ROOT is not read; use "
                                  "the flag --data-root DIR instead "
                                  "(docs/training.md#environment-variables)")


def test_the_products_are_pinnable_and_checked(monkeypatch, fresh_override):
    """linear and lowp_matmul take their choices through the override and pin; an
    unknown choice or op is one line naming the allowed ones."""
    assert {"linear", "lowp_matmul"} <= set(dispatch.TABLE)
    monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR, "linear=mkl,lowp_matmul=fp32,wkv=reference")
    assert dispatch.override() == {"linear": "mkl", "lowp_matmul": "fp32", "wkv": "reference"}
    assert dispatch.pinned("linear") == "mkl" and dispatch.pinned("lowp_matmul") == "fp32"
    dispatch.reset()
    monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR, "linear=auto")
    assert dispatch.pinned("linear") is None
    dispatch.reset()
    monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR, "linear=blas")
    with pytest.raises(DispatchError, match=r"^unknown linear implementation 'blas' \(from "
                                            r"RWKV_CLIP_DISPATCH\); expected one of auto, "
                                            r"aten, onednn, mkl$"):
        dispatch.override()
    dispatch.reset()
    monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR, "matmul=fp32")
    with pytest.raises(DispatchError, match=r"unknown op 'matmul'; expected one of wkv, .*"
                                            r"linear, lowp_matmul"):
        dispatch.override()
    monkeypatch.delenv(dispatch.OVERRIDE_ENV_VAR)
    dispatch.reset()
    dispatch.pin({"lowp_matmul": "native"})
    assert dispatch.pinned("lowp_matmul") == "native"
    with pytest.raises(DispatchError, match="unknown lowp_matmul implementation 'bf16' "
                                            "\\(from pin\\)"):
        dispatch.pin("lowp_matmul=bf16")


def test_the_kernel_cache_lives_under_the_cache_root(tmp_path, monkeypatch):
    from rwkv_clip.ops import cache
    monkeypatch.setenv("RWKV_CLIP_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch"))
    assert cache.cache_root() == tmp_path / "kernels"
    assert dispatch.cache_path() == tmp_path / "kernels" / dispatch.CACHE_FILE
    monkeypatch.delenv("RWKV_CLIP_CACHE")
    assert cache.cache_root() == tmp_path / "torch" / "rwkv_clip"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert cache.cache_root() == Path.home() / ".cache" / "rwkv_clip" / "kernels"


def test_the_portable_cpu_build_follows_the_level_cap(monkeypatch):
    """With the level capped (cpu_isa), the WKV CPU kernel is the portable build; nothing
    else chooses it."""
    monkeypatch.setattr(build, "cpu_level_capped", lambda: True)
    assert build.cpu_kernel_spec() == build.cpu_kernel_spec(portable=True)
    assert not hasattr(build, "CPU_ISA_ENV_VAR")
