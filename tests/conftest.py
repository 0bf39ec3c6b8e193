import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
# The reference data produced by the original lives beside the checkout (../shared).
REFERENCE_DIR = Path(os.environ.get("RWKV_CLIP_REFERENCE_DIR", REPO.parent / "shared" / "reference"))


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    if not REFERENCE_DIR.is_dir():
        pytest.fail(f"reference data not found at {REFERENCE_DIR} (set RWKV_CLIP_REFERENCE_DIR)")
    return REFERENCE_DIR


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
