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
