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
LINK_AND_COMMIT = re.compile(r"\]\(((?:docs/)?results/[\w.-]+\.json)\)( \(`([0-9a-f]+)`\))?")


@pytest.mark.parametrize("result", RESULTS, ids=lambda p: p.name)
def test_every_result_names_the_commit_it_measured(result):
    data = json.loads(result.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", data.get("commit", "")), result.name
    assert re.match(r"\d{4}-\d{2}-\d{2}", str(data.get("date", ""))), result.name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_to_a_result_names_its_commit(page):
    """Each link to a docs/results JSON is followed by the commit it measured, so a reader
    sees which code a figure belongs to."""
    for m in LINK_AND_COMMIT.finditer(page.read_text()):
        target = (page.parent / m.group(1)).resolve()
        commit = json.loads(target.read_text())["commit"][:7]
        assert m.group(3) == commit, f"{page.name}: {m.group(1)} should be followed by " \
            f"(`{commit}`), the commit in its JSON"


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
