import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
# Data produced by running the original model (see tests/reference/README.md). The
# project's shared/reference beside the checkout is preferred when present (it is the
# source of truth); tests/reference holds a copy so a lone clone can run the tests.
_REFERENCE_CANDIDATES = [Path(os.environ["RWKV_CLIP_REFERENCE_DIR"])] if "RWKV_CLIP_REFERENCE_DIR" in os.environ \
    else [REPO.parent / "shared" / "reference", REPO / "tests" / "reference"]


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    for candidate in _REFERENCE_CANDIDATES:
        if (candidate / "golden_small.pt").is_file():
            return candidate
    pytest.fail(f"reference data not found in {[str(c) for c in _REFERENCE_CANDIDATES]}")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def pytest_configure(config):
    """Compiled kernels in a cache folder of this CPU level's own (rwkv_clip.compiling):
    inductor's default one is shared with runs at other levels (the forced-path stage)."""
    from rwkv_clip.compiling import isolate_inductor_cache
    isolate_inductor_cache()


def pytest_sessionstart(session):
    """Where the run happened, first in its output (with -q too): the CPU, the level the
    project runs at (capped by ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA in the forced-path
    stage) and the paths that level picks. Once, in the controller of an xdist run."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or hasattr(session.config, "workerinput"):
        return
    for line in _machine_lines():
        reporter.write_line(line)


def _machine_lines() -> list[str]:
    import torch

    from rwkv_clip.cpu_isa import cpu_info
    from rwkv_clip.ops import build
    from rwkv_clip.ops.products import cpu_matmul_in_fp32
    bf16 = "fp32 GEMM of rounded operands" if cpu_matmul_in_fp32(torch.bfloat16) else "native"
    return [f"cpu: {cpu_info().describe()}",
            f"torch cpu capability: {torch.backends.cpu.get_cpu_capability()}; WKV CPU build: "
            f"{build.cpu_kernel_name()}; CPU bf16 autocast products: {bf16}"]


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run tests marked slow (CI does)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow (CI does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def choose(monkeypatch):
    """Pin a CPU product op (``linear``, ``lowp_matmul``) through
    ``$RWKV_CLIP_DISPATCH`` for one test (the override and the choices are cached:
    cleared around it)."""
    from rwkv_clip.ops import dispatch
    chosen: dict[str, str] = {}

    def set_choice(switch: str, choice: str) -> None:
        chosen[switch] = choice
        monkeypatch.setenv(dispatch.OVERRIDE_ENV_VAR,
                           ",".join(f"{k}={v}" for k, v in chosen.items()))
        dispatch.reset()
    yield set_choice
    monkeypatch.delenv(dispatch.OVERRIDE_ENV_VAR, raising=False)
    dispatch.reset()


# the implementations rwkv_clip.memory's walker counts (its saved tensors): where they run
WALKED_IMPLEMENTATIONS = {"shift_lerp": "copies", "head_norm_gate": "layer-norm",
                          "relu_square": "short-backward"}


@pytest.fixture
def walked_implementations():
    """Prefer the implementations the memory walker models, so a count does not depend
    on which one the table's timing picked on this machine."""
    from rwkv_clip.ops import dispatch
    dispatch.prefer(WALKED_IMPLEMENTATIONS)
    yield
    dispatch.prefer({})
