"""A benchmark's JSON names the code it measured: the checkout's commit, ``-dirty`` when a
tracked file differs from it (rwkv_clip.bench.provenance)."""
import re
import subprocess

from rwkv_clip.bench.provenance import code_commit, measured


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_commit_is_the_checkouts_and_dirty_when_a_tracked_file_changed(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert code_commit(tmp_path) == head
    (tmp_path / "new.txt").write_text("untracked files do not count\n")
    assert code_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert code_commit(tmp_path) == head + "-dirty"


def test_outside_a_checkout_the_commit_is_unknown(tmp_path):
    assert code_commit(tmp_path) == "unknown"


def test_measured_names_commit_and_utc_date():
    record = measured()
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", record["commit"])
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC", record["date"])
