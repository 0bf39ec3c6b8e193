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
