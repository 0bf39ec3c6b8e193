"""The rule for figures (CONTRIBUTING.md): every ratio in a README or docs table links the
committed JSON it came from; a ratio shown with its spread is the JSON's median and min-max
of the paired ratios, and bold only when that range lies above 1.0; the README's parameter
count and main-job range are the model's and the seed runs' own."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RATIO = re.compile(r"\d+(?:\.\d+)?x\b")
RESULTS_LINK = re.compile(r"\]\(((?:docs/)?results/[\w.-]+\.json)\)")
WITH_SPREAD = re.compile(r"(\*\*)?(\d+\.\d+)x(?:\*\*)? \((\d+\.\d+)-(\d+\.\d+)\)")


def _table_rows(page: Path) -> list[str]:
    return [line for line in page.read_text().splitlines()
            if line.startswith("|") and not line.startswith("| ---")]


def _linked(page: Path, row: str) -> list[Path]:
    return [(page.parent / target).resolve() for target in RESULTS_LINK.findall(row)]


def _paired(path: Path) -> set[tuple[str, str, str]]:
    """Every (median, min, max) of the paired ratios a versus / resolution JSON holds,
    formatted as the pages print them."""
    data = json.loads(path.read_text())
    found = set()
    for row in data.get("rows", data.get("cases", [])):
        if "rwkv_clip" not in row or "step_s" not in row.get("open_clip", {}):
            continue
        paired = [b / a for a, b in zip(row["rwkv_clip"]["step_s"], row["open_clip"]["step_s"],
                                        strict=True)]
        found.add(tuple(f"{v:.2f}" for v in (statistics.median(paired), min(paired),
                                             max(paired))))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_ratio_in_a_table_links_its_json(page):
    unlinked = [row for row in _table_rows(page)
                if RATIO.search(row.split("|", 2)[2]) and not _linked(page, row)]
    assert not unlinked, f"{page.name}: table rows with a ratio but no results/*.json link"
    missing = [str(p) for row in _table_rows(page) for p in _linked(page, row) if not p.is_file()]
    assert not missing, f"{page.name} links results that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_ratios_with_a_spread_are_the_jsons_and_bold_only_as_gains(page):
    for row in _table_rows(page):
        cells = WITH_SPREAD.findall(row)
        if not cells:
            continue
        known = set().union(*(_paired(p) for p in _linked(page, row)))
        for bold, median, low, high in cells:
            assert (median, low, high) in known, f"{page.name}: {median}x ({low}-{high}) " \
                f"is not a paired ratio of the JSON its row links: {row}"
            if bold:
                assert float(low) > 1.0, f"{page.name}: bold {median}x but its range " \
                    f"{low}-{high} reaches 1.0"


RESULTS = sorted((REPO / "docs" / "results").glob("*.json"))


@pytest.mark.parametrize("result", RESULTS, ids=lambda p: p.name)
def test_every_result_names_the_commit_it_measured(result):
    """The pages stay free of commit hashes (tests/test_readme.py); the JSON a figure links
    names the code it ran on."""
    data = json.loads(result.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", data.get("commit", "")), result.name
    assert re.match(r"\d{4}-\d{2}-\d{2}", str(data.get("date", ""))), result.name


PROSE_FIGURE = re.compile(
    r"(?<![\w.=])\d+(?:\.\d+)?(?:x\b| ?(?:ms|s|GiB|MiB|GB|%|min|minutes|seconds|hours)\b)")


def _settings() -> dict[tuple[str, str], bool]:
    """Figures in prose that state a setting of the code, not a measurement: each one
    with whether the code still says so."""
    import importlib
    import inspect

    from rwkv_clip import faults, host_memory
    from rwkv_clip.data import builtin
    from rwkv_clip.eval import common
    estimate = importlib.import_module("rwkv_clip.memory.estimate")  # the package's
    # `estimate` attribute is the function of that name
    gpu_check = (REPO / "scripts" / "gpu_check.sh").read_text()
    mmap_gib, trim_gib = host_memory.MMAP_THRESHOLD >> 30, (host_memory.TRIM_THRESHOLD + 1) >> 30
    quiet = inspect.signature(common.ProgressLines).parameters["min_seconds"].default
    return {
        ("data.md", "2x"): builtin._SS == 2,
        ("differences.md", "2 GiB"): (mmap_gib, trim_gib) == (1, 2),
        ("training.md", "1 GiB"): mmap_gib == 1,
        ("training.md", "2 GiB"): trim_gib == 2,
        ("faults.md", "30 s"): faults.SILENCE_LIMIT == 30,
        ("gpu-check.md", "465 s"): "${GPU_CHECK_BUDGET_S:-465}" in gpu_check,
        ("linear-probe-and-validation.md", "20 s"): quiet == 20.0,
        ("lora.md", "1 GiB"): estimate.CARD_RESERVE_GIB == 1.0
        and estimate.CARD_USABLE_FRACTION == 0.92,
    }


def _sections(text: str) -> list[tuple[str, str]]:
    """The page's sections (split at headings): each whole, and its prose alone (no code
    blocks, tables or inline code)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"(?m)^(?: {4}.*\n)+", "", text)
    return [(section, re.sub(r"`[^`]*`", "", re.sub(r"(?m)^\|.*\n", "", section)))
            for section in re.split(r"(?m)^#+ .*$", text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_prose_figures_link_their_json_or_are_the_codes_settings(page):
    """A number with a unit or a ratio in prose is either in a section that links the
    JSON it came from, or a setting the code holds (checked against the code)."""
    settings = _settings()
    unexplained = []
    for section, prose in _sections(page.read_text()):
        if RESULTS_LINK.search(section):
            continue
        for figure in PROSE_FIGURE.findall(prose):
            key = (page.name, figure)
            if key not in settings:
                unexplained.append(figure)
            else:
                assert settings[key], f"{page.name}: {figure!r} no longer matches the code"
    assert not unexplained, f"{page.name}: figures in prose without a JSON in their section " \
        f"and not a setting of the code: {unexplained}"


def test_a_row_without_a_link_fails_the_check(tmp_path):
    page = REPO / "README.md"
    assert not _linked(page, "| B/32 inference | 1.30x |")
    assert _linked(page, "| x | 1.3x | [j](docs/results/b32_inference.json) |")
    # their time over ours per repeat: 1.0, 1.2, 1.5 -> median 1.20, range 1.00-1.50
    row = {"rwkv_clip": {"step_s": [2.0, 1.0, 2.0]}, "open_clip": {"step_s": [2.0, 1.2, 3.0]}}
    (tmp_path / "r.json").write_text(json.dumps({"rows": [row, {"rwkv_clip": {}}]}))
    assert _paired(tmp_path / "r.json") == {("1.20", "1.00", "1.50")}


def test_the_readme_parameter_count_is_the_models():
    from rwkv_clip import create_RWKV_Model, load_model_configs

    model = create_RWKV_Model(load_model_configs("RWKV_CLIP_small"), model_weight_path=None)
    count = f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters"
    for page in (REPO / "README.md", REPO / "docs" / "training.md"):
        text = page.read_text()
        stated = re.findall(r"RWKV_CLIP_small\.json` \((\d+\.\dM)\s+parameters", text)
        assert stated, f"{page.name} names the small config's parameter count"
        assert all(f"{s} parameters" == count for s in stated), (page.name, stated, count)


def test_the_readme_main_job_range_is_the_grid():
    """The README quotes command 1's accuracy only as the range of the committed grid of
    runs (scripts/bench_main_job.py: seeds x CPU paths x thread counts), and no accuracy
    at all while none is committed."""
    readme = (REPO / "README.md").read_text()
    section = " ".join(readme[readme.index("## The two commands"):
                              readme.index("## Use in a notebook")].split())
    stated = re.findall(r"\d+(?:\.\d)?%", section.replace("chance 3.3%", ""))
    path = REPO / "docs" / "results" / "main_job_grid.json"
    if not path.is_file():
        assert not stated, f"the README states command 1's accuracy without a JSON: {stated}"
        return
    result = json.loads(path.read_text())
    over = result["top1_over_seeds"]
    for key in ("held_out_top1", "shifted_top1"):
        quoted = f"{over[key]['min']:.1f}-{over[key]['max']:.1f}%"
        assert quoted in section, f"README should quote {key} over seeds as {quoted}"
    assert "main_job_grid.json" in section
    runs = result["runs"]
    assert len({r["seed"] for r in runs}) >= 2 and len({r["path"] for r in runs}) >= 2
    assert len({r["threads"] for r in runs}) >= 2 and result["machine"]["cpu"]
