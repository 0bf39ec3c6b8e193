"""The README and docs/: every Python example runs as written, the README's test command is
the one CI runs, the README stays a short guide (size, no commit hashes, few dates), and
every relative link points at a file and heading that exist."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rwkv_clip.pretrained import PRETRAINED, PretrainedCfg

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_BYTES = 16_000


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def _python_examples() -> list:
    """One pytest param per ```python block of README.md and docs/*.md; a block that loads
    published weights by name is slow (the test lays out a B/32-sized Hub cache for it), and
    so is one that exports to ONNX."""
    params = []
    for page in PAGES:
        for i, block in enumerate(_blocks(page.read_text(), "python")):
            published = [cfg for cfg in PRETRAINED
                         if f'"{cfg.model_name}", "{cfg.tag}"' in block
                         or f"{cfg.model_name}:{cfg.tag}" in block]
            exports_onnx = '"--format", "onnx"' in block  # an ONNX export: minutes on a CPU
            marks = [pytest.mark.slow] if published or exports_onnx else []
            params.append(pytest.param(block, published, marks=marks,
                                       id=f"{page.relative_to(REPO)}#{i}"))
    return params


def _lay_out_hub_cache(cache: Path, cfg: PretrainedCfg, reference_dir: Path) -> None:
    """What the Hub would put in HF_HUB_CACHE for ``cfg``: a random state dict with the
    published keys (``module.`` prefixed), shapes and dtypes, under a fixed revision."""
    keys = json.loads((reference_dir / f"keys_{cfg.config.split('_')[-1]}.json").read_text())
    gen = torch.Generator().manual_seed(0)
    state = {"module." + name: (torch.randn(shape, generator=gen) * 0.02).to(getattr(torch, dtype))
             for name, shape, dtype in keys["keys"]}
    revision = "0" * 40
    folder = cache / ("models--" + cfg.hf_repo.replace("/", "--"))
    (folder / "snapshots" / revision).mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(revision)
    torch.save(state, folder / "snapshots" / revision / cfg.filename)


@pytest.mark.parametrize("block, published", _python_examples())
def test_python_example_runs(block, published, tmp_path, reference_dir):
    cache = tmp_path / "hub"
    cache.mkdir()
    for cfg in published:
        _lay_out_hub_cache(cache, cfg, reference_dir)
    script = tmp_path / "example.py"
    script.write_text(block)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    result = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    if "print(probs)" in block:
        assert "tensor([[" in result.stdout  # the printed probabilities


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_json_blocks_parse(page):
    """What a page shows as printed JSON is JSON (json.loads, not a sketch of it)."""
    for block in _blocks(page.read_text(), "json"):
        json.loads(block)


def test_the_notebook_example_is_in_the_readme():
    blocks = _blocks((REPO / "README.md").read_text(), "python")
    assert any("create_RWKV_Model" in b and "print(probs)" in b for b in blocks)


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    commands = [line for block in _blocks(readme, "bash") for line in block.splitlines()
                if line and not line.startswith("#")]
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (REPO / ".ci" / "run").read_text()


def _commits(words: set[str]) -> set[str]:
    """The words that name a commit of this repository (empty outside a git checkout)."""
    found = set()
    for word in words:
        result = subprocess.run(["git", "rev-parse", "--quiet", "--verify", f"{word}^{{commit}}"],
                                cwd=REPO, capture_output=True, text=True)
        if result.returncode == 0:
            found.add(word)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_commit_hashes(page):
    """A hex word of 7-40 digits that mixes letters and digits, or that git resolves to a
    commit, is a commit hash: the pages describe the current code, git keeps the history."""
    words = set(re.findall(r"\b[0-9a-f]{7,40}\b", page.read_text()))
    hash_like = {w for w in words if re.search(r"[0-9]", w) and re.search(r"[a-f]", w)}
    assert not (hash_like | _commits(words)), page.name


def test_readme_is_a_short_guide():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= README_MAX_BYTES
    assert len(re.findall(r"\b20\d\d-\d\d-\d\d\b", readme)) <= 2
    assert "this project's" not in readme.lower()


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, a
    repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


@pytest.mark.parametrize("page", PAGES + [REPO / "CONTRIBUTING.md"],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_file():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{page.name}: links to missing files or headings: {broken}"


def test_docs_site_builds_strict(tmp_path):
    """mkdocs (material theme) builds docs/ offline with no warning: every page in the nav
    exists and every link and anchor between pages resolves."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                             str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "site" / "performance" / "index.html").is_file()
