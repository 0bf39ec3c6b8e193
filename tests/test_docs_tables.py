"""The tables of figures in docs/ equal the tool or the committed JSON they quote, so a
change to the code behind them (or a hand edit) fails here instead of leaving a stale
table: docs/lora.md's "what fits" against the memory planner's command on the page,
docs/losses.md's CLIP-vs-SigLIP table against docs/results/losses_builtin.json (written
by the command on the page), and the linear-probe page's built-in counts against the
built-in set's definition."""
from __future__ import annotations

import inspect
import json
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _page(name: str) -> str:
    return (REPO / "docs" / name).read_text()


def _commands(text: str) -> list[str]:
    return [" ".join(line.split()) for lang, body in FENCE.findall(text) if lang == "bash"
            for line in re.sub(r"\\\n\s*", " ", body).splitlines()
            if line.strip() and not line.startswith("#")]


def _table(text: str, header_start: str) -> tuple[list[str], list[list[str]]]:
    """(header cells, rows of cells) of the markdown table whose header starts so."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header = [cell.strip() for cell in lines[start].strip().strip("|").split("|")]
    return header, rows


def test_lora_page_what_fits_is_the_planners_output(capsys):
    """Every cell of docs/lora.md's per-card table is what the command above it prints."""
    from rwkv_clip.memory.cli import main

    text = _page("lora.md")
    command = next(c for c in _commands(text) if "rwkv_clip.memory" in c)
    argv = shlex.split(command)[3:]
    assert main([*argv, "--json"]) == 0
    by_mode = json.loads(capsys.readouterr().out)["max_batch_by_mode"]
    header, rows = _table(text, "| card |")
    assert header[1:] == list(by_mode), (header, list(by_mode))
    assert [row[0] for row in rows] == list(next(iter(by_mode.values())))
    for row in rows:
        for mode, cell in zip(header[1:], row[1:], strict=True):
            assert int(cell) == by_mode[mode][row[0]], (row[0], mode, cell)
    precision = argv[argv.index("--precision") + 1]
    assert f"in {precision} without activation checkpointing" in " ".join(text.split())
    assert "--checkpointing" not in argv


def test_losses_page_table_is_the_committed_json():
    """docs/losses.md's CLIP-vs-SigLIP rows: the runs' flags and figures as the JSON that
    the page's command writes holds them, and the run's description (steps, batch)."""
    text = _page("losses.md")
    command = next(c for c in _commands(text) if "compare_losses.py" in c)
    argv = shlex.split(command)
    out = REPO / argv[argv.index("--out") + 1]
    steps = int(argv[argv.index("--max-steps") + 1])
    runs = {name: run for name, run in json.loads(out.read_text()).items()
            if isinstance(run, dict)}  # besides the runs: commit and date
    assert f"]({out.relative_to(REPO / 'docs')})" in text  # the page links the JSON
    header, rows = _table(text, "| loss |")
    assert header == ["loss", "zero-shot top-1", "top-5", "last loss"]
    assert len(rows) == len(runs) == 2
    for row, (name, run) in zip(rows, runs.items(), strict=True):
        shown = re.search(r"`python train.py ([^`]*)`", row[0])
        assert shown and shlex.split(shown.group(1)) == run["argv"], (row[0], run["argv"])
        assert row[0].startswith({"clip": "CLIP (", "siglip": "SigLIP ("}[name])
        assert run["steps"] == steps and run["argv"][-2:] == ["--max-steps", str(steps)]
        assert row[1] == f"{100 * run['zero_shot_top1']:.1f}%"
        assert row[2] == f"{100 * run['zero_shot_top5']:.1f}%"
        assert row[3] == f"{run['last_loss']:.2f}"
    first = next(iter(runs.values()))
    text = " ".join(text.split())  # the prose, its line breaks aside
    assert all(r["batch_size"] == first["batch_size"] and r["seed"] == first["seed"]
               for r in runs.values())
    assert f"{steps} steps of {first['batch_size']} pairs" in text
    clip, siglip = runs["clip"]["zero_shot_top1"], runs["siglip"]["zero_shot_top1"]
    verdict = ("top-1 is the same" if clip == siglip else
               f"at batch {first['batch_size']} favours {'CLIP' if clip > siglip else 'SigLIP'}'s")
    assert verdict in text, verdict  # the prose says what the table shows
    assert f"{first['num_classes']} classes, chance {100 / first['num_classes']:.1f}%" in text
    assert f"the {first['config'].removeprefix('RWKV_CLIP_')} config" in text


def test_linear_probe_page_counts_are_the_builtin_sets():
    """The built-in probe's train split is every built-in training image and its test split
    the held-out folder: the page's count and its example JSON say the same numbers."""
    from rwkv_clip.data.builtin import class_names, ensure_builtin_dataset

    defaults = inspect.signature(ensure_builtin_dataset).parameters
    num_train = defaults["num_train"].default
    num_test = len(class_names()) * defaults["zeroshot_per_class"].default
    text = _page("linear-probe-and-validation.md")
    header, rows = _table(text, "| `--dataset` |")
    builtin = next(row for row in rows if row[0].startswith("`builtin`"))
    assert f"the {num_train:,} built-in training images" in builtin[1], builtin
    assert f"({len(class_names())} classes)" in builtin[2], builtin
    prose = " ".join(text.split())
    assert (f"encodes {num_train + num_test:,} images (the {num_train:,} training images "
            f"and the {num_test} held-out ones)") in prose
    example = next(json.loads(body) for lang, body in FENCE.findall(text) if lang == "json"
                   and '"linear_probe"' in body)
    assert example["num_train"] == num_train and example["num_samples"] == num_test


def test_lora_page_fine_tunes_on_named_data():
    """The page's fine-tune names its data: without --train-data train.py would fine-tune
    on the built-in set."""
    commands = [c for c in _commands(_page("lora.md")) if c.startswith("python train.py")]
    assert commands and all("--train-data" in shlex.split(c) for c in commands), commands


def test_serving_table_is_the_committed_json():
    """docs/performance.md's serving rows: every case of the JSON files its commands write,
    with the figures and the verdict (bold only where the whole range lies above 1)."""
    text = _page("performance.md")
    header, rows = _table(text, "| pair, encoder |")
    assert header[:4] == ["pair, encoder", "runtime", "precision", "batch"]
    shown = {(r[0], r[1], r[2], r[3]): r for r in rows}
    names = {"b32": "B/32 vs ViT-B-32, 224 px", "b16": "B/16 vs ViT-B-16, 224 px",
             "b16-448": "B/16 vs ViT-B-16, 448 px", "b16-896": "B/16 vs ViT-B-16, 896 px"}
    outs = [REPO / shlex.split(c)[shlex.split(c).index("--out") + 1]
            for c in _commands(text) if "bench_serving.py" in c and "--accuracy" not in c]
    cases = [(out, case) for out in outs for case in json.loads(out.read_text())["cases"]]
    assert len(cases) == len(rows)
    for out, c in cases:
        row = shown[(f"{names[c['pair']]}, {c['tower']}", c["runtime"], c["precision"],
                     str(c["batch"]))]
        low, high = c["ratio_range"]
        ratio = f"{c['ratio']:.2f}x"
        assert row[4:7] == [f"{c['rwkv_clip']['median_ms']:.1f}",
                            f"{c['open_clip']['median_ms']:.1f}",
                            f"{f'**{ratio}**' if low > 1 else ratio} ({low:.2f}-{high:.2f})"]
        assert row[7] == f"[{out.name}](results/{out.name})"
