"""What a benchmark's JSON says it measured: the git commit of the checkout (``-dirty``
when tracked files differ from it) and the UTC time, so a figure can be traced to the code
it ran on (CONTRIBUTING.md, "Figures")."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def code_commit(repo: Path = REPO) -> str:
    """``git rev-parse HEAD`` of ``repo``, with ``-dirty`` when a tracked file differs
    from it; ``unknown`` outside a git checkout (an installed package)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def measured() -> dict[str, str]:
    """``{"commit": ..., "date": ...}`` for a benchmark's JSON."""
    return {"commit": code_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


__all__ = ["code_commit", "measured"]
