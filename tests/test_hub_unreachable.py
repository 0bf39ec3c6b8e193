"""``--pretrained NAME`` on a machine that cannot reach the Hub (no HF_HUB_OFFLINE set)
fails fast: one try, then the one-line hint, not huggingface_hub's retries (~30 s)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLOSED_PORT = "http://127.0.0.1:9"  # the discard port: nothing listens, the connect is refused


def test_pretrained_name_without_network_fails_in_seconds_with_the_hint(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=CLOSED_PORT, HF_HOME=str(tmp_path / "hf"), CUDA_VISIBLE_DEVICES="")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "zero_shot.py", "--pretrained",
                          "hf-hub:Kaichengalex/RWKV-CLIP-B32-YFCC15M", "--device", "cpu"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("zero_shot.py: error: file model_31.pt of Hub repository "
                                "Kaichengalex/RWKV-CLIP-B32-YFCC15M is not in the cache")
    assert "the Hub cannot be reached; fetch it with: hf download" in lines[-1]
    assert "Retrying" not in out.stderr
    assert elapsed < 15, f"took {elapsed:.0f} s"
