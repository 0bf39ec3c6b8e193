"""Every command shown in README.md and docs/**/*.md runs.

The commands are collected from the ```bash / ```sh / ```shell code blocks (and the ``$ ``
lines of ```console blocks) of whatever pages exist. Each must have an entry in
:data:`COMMANDS`, which says how it runs here:

* ``"help"``: its program with ``--help`` (derived from the line: ``python X.py``,
  ``python -m MOD [SUBCOMMAND]``, ``bash SCRIPT``, ``torchrun ... X.py``, each part of an
  ``&&`` chain), for commands that need data, a GPU, 8 GPUs or the network;
* ``"help: PROGRAM"``: that program with ``--help``, when the line's own program cannot
  stand for it (the reason is the entry's comment);
* ``"run"``: literally, in the repository (fast and harmless);
* ``"page"``: exactly as written, in document order, as part of its page's worked
  example, run in a sandbox that holds the page's inputs made here (a few generated
  images, weights of the shape the page's names stand for). Nothing is appended: a page
  whose example needs small settings writes them, so the user runs what the test runs.

A documented command without an entry fails :func:`test_every_documented_command_has_an_entry`:
add it to the table, so that no documented command goes untested.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(bash|sh|shell|console)[ \t]*\n(.*?)^```", re.S | re.M)
# the pages whose commands are one worked example, run in order in a sandbox
WORKED_EXAMPLES = ("docs/own-data.md", "docs/hub-cache.md")

COMMANDS: dict[str, str] = {
    # the two commands: CI runs them from a fresh clone (.ci/run); here their programs
    "bash scripts/bootstrap.sh && .venv/bin/python train.py": "help",
    "bash scripts/bootstrap.sh && .venv/bin/python -m pytest --slow -q -n 2": "help",
    # training (real data, B/32, 8 GPUs): the flags parse, the run is other tests' job
    "python train.py --help": "run",
    "python train.py --config model_config/RWKV_CLIP_B32.json --train-data /data/yfcc15m "
    "--data-format rec --batch-size 512 --epochs 32 --lr 1e-3 --weight-decay 0.2 "
    "--precision bf16": "help",
    "torchrun --nproc_per_node 8 train.py --config RWKV_CLIP_B32 --train-data /data/yfcc15m "
    "...": "help",
    "python train.py --resume latest --output runs/b32": "help",
    # docs/training.md, other image sizes (tests/test_image_size.py trains the tiny config
    # at 896 px from 16 px weights)
    "python train.py --config RWKV_CLIP_B16 --pretrained weights_224.pt --force-image-size 896 "
    "--train-data /data/yfcc15m --batch-size 16 --precision bf16": "help",
    "python -m rwkv_clip.memory --config RWKV_CLIP_B16 --input-size 896 --batch-size 16 "
    "--precision bf16": "run",
    # data
    "python scripts/make_rec.py pairs.jsonl data/train": "help",
    "python scripts/make_rec.py img2dataset_out/ data/train --format wds": "help",
    "python scripts/make_rec.py pairs.csv data/train --encoding latin-1": "help",
    "python train.py --train-data 'i2d_out/{00000..00099}.parquet'": "help",
    "python train.py --data-format parquet --train-data yfcc15m/data/": "help",
    "python train.py --train-data 'i2d/*.parquet' --caption-columns caption,syn,gen": "help",
    "python train.py --train-data data/train --caption-tokens raw_ofa.npy": "help",
    "python scripts/make_rec.py 'yfcc15m/data/train-*.parquet' data/yfcc15m": "help",
    "python scripts/bench_data.py --workers 2,4,8 --bench-train": "help",
    # docs/data.md, captions of any length (tests/test_long_captions.py runs each path)
    "python scripts/make_rec.py pairs.jsonl data/long --ctx-len 248": "help",
    "python scripts/make_rec.py pairs.jsonl data/long --ctx-len 248 --format wds": "help",
    "python train.py --train-data data/long --ctx-len 248": "help",
    "python train.py --train-data 'i2d/*.parquet' --ctx-len 248": "help",
    "python train.py --train-data data/train --caption-tokens long.npy --ctx-len 248": "help",
    "python text_image_retrieval.py --model-weight run/checkpoints/epoch_1.pt --ctx-len 248 "
    "--retrieval-file long.jsonl": "help",
    # docs/evaluation.md, long captions (tests/test_long_captions.py reads each layout, runs
    # the retrieval CLI, the built-in split, the job's parts and a fine-tune at 128 tokens)
    "python text_image_retrieval.py --model-weight w.pt --dataset urban1k --data-root "
    "/data/Urban1k --ctx-len 248": "help",
    "python text_image_retrieval.py --model-weight w.pt --dataset sharegpt4v --retrieval-file "
    "sharegpt4v_instruct_gpt4-vision_cap100k.json --data-root /data/ShareGPT4V/data "
    "--ctx-len 248": "help",
    "python text_image_retrieval.py --model-weight w.pt --dataset dci --retrieval-file "
    "dci_long.json --data-root /data/dci --ctx-len 248": "help",
    "python scripts/long_captions.py --seeds 0,1 --output docs/results/long_captions.json":
        "help",
    "python train.py --pretrained runs/default/checkpoints/epoch_latest.pt --ctx-len 248 "
    "--train-data data/long --lora-rank 16 --output runs/long": "help",
    "python train.py --pretrained runs/default/checkpoints/epoch_latest.pt --ctx-len 248 "
    "--train-data data/long --lock-image --output runs/long": "help",
    # its memory plan (tests/test_memory.py checks the context length is what it plans)
    "python -m rwkv_clip.memory --config RWKV_CLIP_small --ctx-len 248 --lora-rank 16": "run",
    # evaluation (the paper's sets, 8 GPUs, downloads)
    "python zero_shot.py": "help",
    "python zero_shot.py --model-weight runs/default/checkpoints/epoch_latest.pt": "help",
    "python zero_shot.py --pretrained RWKV-CLIP-B32:yfcc15m --dataset cifar10,cifar100,"
    "food101,pets,flowers,sun397,stanford_car,dtd,caltech101,aircraft,imagenet --data-root "
    "/data --output-dir results/": "help",
    "python zero_shot.py --model-weight w.pt --dataset imagefolder --data-root my_images/ "
    "--templates t.json": "help",
    "python zero_shot.py --model-weight w.pt --dataset mscoco,flickr30k --data-root "
    "/data/retrieval": "help",
    "python zero_shot.py --model-weight w.pt --task zeroshot_retrieval --retrieval-file "
    "pairs.jsonl": "help",
    "torchrun --nproc_per_node 8 zero_shot.py --model-weight w.pt --dataset imagenet "
    "--data-root /data": "help",
    "D=/data": "run",
    "python zero_shot.py --pretrained RWKV-CLIP-B32:yfcc15m --data-root $D --output-dir "
    "results/ --dataset cifar10,cifar100,food101,pets,flowers,sun397,stanford_car,dtd,"
    "caltech101,aircraft,imagenet": "help",
    "python text_image_retrieval.py --pretrained RWKV-CLIP-B32:yfcc15m --dataset coco "
    "--data-root $D/coco --output-dir results/": "help",
    "python text_image_retrieval.py --pretrained RWKV-CLIP-B32:yfcc15m --dataset flickr "
    "--data-root $D/flickr30k --output-dir results/": "help",
    "torchrun --nproc_per_node 8 zero_shot.py --model-weight model_31.pt --data-root $D "
    "--dataset imagenet": "help",
    # the original's scripts come from deepglint/RWKV-CLIP (not shipped): what they run
    "bash test_zero_shot_classificaiton.sh": "help: python zero_shot.py",
    "bash test_zero_shot_retrieval.sh": "help: python text_image_retrieval.py",
    # export of a B/32 run
    "python -m rwkv_clip.export runs/b32/checkpoints/epoch_latest.pt model_31.pt "
    "--ddp-prefix": "help",
    "python -m rwkv_clip.export runs/b32/checkpoints/epoch_latest.pt model.safetensors": "help",
    # GPU check, CUDA 12 cluster (network, a GPU machine)
    "bash scripts/device_wheels.sh": "help",
    "bash scripts/gpu_check.sh gpu_check.json": "help",
    "bash scripts/bootstrap.sh && .venv/bin/python scripts/gpu_check.py --out gpu_check.json":
        "help",
    # docs/performance.md's GPU figures (an H200)
    "python scripts/bench_resolution.py --device cuda --model B16 --precisions bf16 --sides "
    "224,448,896 --batch-size 4 --train-batch-size 4 --warmup 2 --repeats 4 --max-seconds 150":
        "help",
    "python scripts/bench_wkv.py --shapes 4,3136,12,64 --backends cuda-faithful,cuda-fast "
    "--dtype bf16 --check-batch 1": "help",
    "python scripts/bench_wkv.py --device cuda --dtype bf16 --shapes issue47 --backends "
    "cuda-chunked,cuda-fast,cuda-faithful,fla-chunk,sdpa": "help",
    "python3 -m venv .venv": "help",
    ".venv/bin/pip install torch==2.14.1 torchvision==0.29.1 --index-url "
    '"$TORCH_CU12_INDEX"': "help",
    '.venv/bin/pip install -e ".[dev,dali-cuda120]"': "help",
    "CUDA_HOME=/usr/local/cuda-12.6 .venv/bin/python -m rwkv_clip.ops build": "help",
    # benchmarks (minutes each on B/32): their flags
    "python scripts/bench_infer.py --repeats 5 --modes eager --precisions fp32,bf16 "
    "--breakdown": "help",
    # serving (tests/test_onnx_serving.py runs a small case; test_docs_tables.py holds the
    # page's table equal to the JSON)
    "python scripts/bench_serving.py --pairs b32 --repeats 6 --out docs/results/serving_b32.json":
        "help",
    "python scripts/bench_serving.py --pairs b16,b16-448 --towers image --batch-sizes 1 "
    "--repeats 3 --out docs/results/serving_b16.json": "help",
    "python scripts/bench_serving.py --pairs b32 --towers text --runtimes onnxruntime,openvino "
    "--precisions fp32 --batch-sizes 1 --repeats 1 --warmup 0 --accuracy "
    "runs/default/checkpoints/epoch_latest.pt --out docs/results/serving_int8_accuracy.json":
        "help",
    "python scripts/bench_train.py --versus --repeats 5 --modes eager --batch-sizes 4,16 "
    "--precisions fp32,bf16 --breakdown": "help",
    "python scripts/bench_resolution.py --precisions fp32,bf16 --threads 2 "
    "--plot docs/img/resolution.png": "help",
    "python scripts/bench_resolution.py --model B32 --sides 224 --batch-size 16 "
    "--train-batch-size 16 --precisions fp32,bf16 --repeats 3 --threads 2 --out "
    "docs/results/resolution_b32_224.json": "help",
    # three runs of command 1's train.py (tests/test_bench_versus.py reads a run's log)
    "python scripts/bench_main_job.py --seeds 0,1 --paths native,avx2 --threads 1,2 --out "
    "docs/results/main_job_grid.json": "help",
    # ... and command 1's time beside another checkout's (tests/test_bench_versus.py)
    "python scripts/bench_main_job.py --seeds 0 --against ../before --repeats 1 --out "
    "docs/results/main_job_time.json": "help",
    # docs/glue.md: the glue ops' benchmark (its CPU run: tests/test_bench_glue.py)
    "python scripts/bench_glue.py --device cuda --batch 256 --dtype bf16": "help",
    "python scripts/bench_wkv.py --shapes 16,77,10,64": "help",
    "python scripts/bench_wkv.py --backends cpu --threads 1 --clock cpu": "help",
    "python scripts/bench_wkv.py --backends cpu --threads 1 --clock cpu --dtype bf16": "help",
    "python -m rwkv_clip.memory --config RWKV_CLIP_B32 --batch-size 16 --precision fp32 "
    "--device cpu --measure --json": "help",
    # docs/lora.md: a fine-tune of a trained run (tests/test_lora.py runs the same steps on
    # the tiny config); the planner's B/32 table
    "python train.py --pretrained runs/default/checkpoints/epoch_latest.pt --train-data "
    "data/train --lora-rank 16 --lr 1e-3 --output runs/lora": "help",
    "python zero_shot.py --model-weight runs/lora/checkpoints/epoch_latest.pt": "help",
    "python -m rwkv_clip.export runs/lora/checkpoints/epoch_latest.pt lora_merged.pt "
    "--merge-lora": "help",
    "python -m rwkv_clip.memory --config RWKV_CLIP_B32 --precision bf16 --lora-rank 16": "help",
    # docs/export.md: tests/test_onnx_export.py runs this page's commands as written (slow)
    "python -m rwkv_clip.export runs/default/checkpoints/epoch_latest.pt --format hub --output "
    "exported/hub --repo-id ORG/NAME": "help",
    "python -m rwkv_clip.export runs/default/checkpoints/epoch_latest.pt --format onnx --output "
    "exported/onnx": "help",
    "python scripts/bench_onnx.py --config RWKV_CLIP_tiny --repeats 3": "help",
    "python -m rwkv_clip.quantize exported/onnx --output exported/onnx-int8": "help",
    "python zero_shot.py --onnx exported/onnx-int8 --dataset builtin,builtin_shifted": "help",

    # docs/losses.md: tests/test_train_siglip.py and test_train_captions.py train with these
    "python train.py --siglip": "help",
    "python train.py --caption-weights 1,0,0": "help",
    "python train.py --siglip --caption-weights 2,1,1": "help",
    "python train.py --siglip --siglip-dist-impl gather --gradient-acc 2 --accum-mode exact":
        "help",
    # its CLIP-vs-SigLIP table: tests/test_docs_tables.py holds it equal to the JSON
    "python scripts/compare_losses.py --max-steps 80 --out docs/results/losses_builtin.json":
        "help",
    # docs/linear-probe-and-validation.md: tests/test_linear_probe.py and
    # test_train_validation.py run the probe, validation and offline wandb on tiny data
    "python train.py": "help",
    "WANDB_MODE=offline python train.py --report-to wandb --name offline-run": "help",
    "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python scripts/bench_infer.py --repeats 5 "
    "--modes eager --precisions fp32,bf16": "help",
    "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python scripts/bench_train.py --versus "
    "--repeats 5 --modes eager --batch-sizes 4,16 --precisions fp32": "help",
    "ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512 python scripts/bench_infer.py "
    "--repeats 5 --modes eager --precisions fp32,bf16": "help",
    "ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512 python scripts/bench_train.py "
    "--versus --repeats 5 --modes eager --batch-sizes 4,16 --precisions fp32": "help",
    "python train.py --report-to tensorboard,wandb --wandb-project-name rwkv-clip --name "
    "small-builtin": "help",
    "python train.py --train-data data/train --val-data data/val --val-frequency 2": "help",
    "python zero_shot.py --model-weight runs/default/checkpoints/epoch_latest.pt --task "
    "linear_probe": "help",
    "python zero_shot.py --model-weight w.pt --task linear_probe --dataset imagefolder "
    "--data-root my_set/ --fewshot-k 16": "help",
    "python zero_shot.py --pretrained RWKV-CLIP-B32:yfcc15m --task linear_probe --data-root "
    "/data --dataset cifar10,cifar100,food101": "help",
    # docs/faults.md: tests/test_lost_rank.py kills ranks under torchrun (2 CPU processes)
    "torchrun --nproc_per_node 8 --max-restarts 3 train.py --config RWKV_CLIP_B32 --train-data "
    "/data/yfcc15m --save-every-steps 500 --output runs/b32": "help",
    # docs/own-data.md: the worked example as written (8 training pairs, batch 8)
    "python scripts/make_rec.py my_pairs/pairs.jsonl data/train": "page",
    "python train.py --train-data data/train --zero-shot-data my_images --output runs/mine "
    "--epochs 3 --batch-size 8": "page",
    "python zero_shot.py --model-weight runs/mine/checkpoints/epoch_latest.pt --dataset "
    "imagefolder --data-root my_images": "page",
    "python zero_shot.py --model-weight runs/mine/checkpoints/epoch_latest.pt --dataset jsonl "
    "--retrieval-file my_pairs/test.jsonl": "page",
    # docs/hub-cache.md: the cache entry built by hand from a model_31.pt of B/32's shapes
    "hf download Kaichengalex/RWKV-CLIP-B32-YFCC15M model_31.pt --cache-dir hub-cache": "help",
    "export HF_HUB_CACHE=$HOME/.cache/huggingface/hub": "page",
    "ENTRY=$HF_HUB_CACHE/models--Kaichengalex--RWKV-CLIP-B32-YFCC15M": "page",
    "mkdir -p $ENTRY/refs $ENTRY/snapshots/manual": "page",
    "printf manual > $ENTRY/refs/main": "page",
    "cp model_31.pt $ENTRY/snapshots/manual/model_31.pt": "page",
    "export HF_HUB_OFFLINE=1": "page",
    "python zero_shot.py --pretrained RWKV-CLIP-B32:yfcc15m --dataset imagefolder --data-root "
    "my_images": "page",
    # a B/32 fine-tune on a real set (the sandbox's 8 pairs are below its batch of 64);
    # tests/test_pretrained.py loads names from a hand-made cache as train.py does
    "python train.py --pretrained RWKV-CLIP-B32:yfcc15m --train-data data/train --output "
    "runs/finetune": "help",
}


# ----------------------------------------------------------------------------- collecting
def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def page_commands(text: str) -> list[str]:
    """The command lines of a page's shell code blocks, continuation lines joined, comments
    and blank lines dropped, whitespace normalised."""
    out = []
    for lang, body in FENCE.findall(text):
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            line = line.strip()
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line or line.startswith("#"):
                continue
            line = re.sub(r"\s+#\s.*$", "", line)  # a trailing comment
            out.append(" ".join(line.split()))
    return out


def documented() -> list[tuple[str, str]]:
    """[(page, command)] over README.md and docs/**/*.md."""
    return [(str(p.relative_to(REPO)), c) for p in doc_pages() for c in page_commands(p.read_text())]


def help_argv(command: str) -> list[list[str]]:
    """The ``--help`` runs standing for ``command``: one per part of an ``&&`` chain."""
    runs = []
    for part in command.split("&&"):
        words = shlex.split(part)
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words.pop(0)  # VAR=value prefixes
        if words[0] == "torchrun":  # torchrun [options] SCRIPT ...: the script's help
            words = ["python", next(w for w in words if w.endswith(".py"))]
        head = Path(words[0]).name
        if head in ("python", "python3"):
            if words[1] == "-m":
                argv = ["python", "-m", words[2]]
                argv += [w for w in words[3:4] if re.fullmatch(r"[a-z]+", w)]  # subcommand
            else:
                argv = ["python", words[1]]
        elif head == "pip":
            argv = ["python", "-m", "pip", *words[1:2]]
        elif head == "bash":
            argv = ["bash", words[1]]
        else:
            argv = [head, *[w for w in words[1:2] if re.fullmatch(r"[a-z]+", w)]]
        runs.append(argv)
    return runs


def resolve(argv: list[str]) -> list[str]:
    """This interpreter for ``python`` / ``python3``; the venv's tools by name."""
    if argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    if argv[0] != "bash":
        local = Path(sys.executable).parent / argv[0]
        if local.exists():
            return [str(local), *argv[1:]]
    return argv


def python_on_path(tmp_path: Path) -> Path:
    """A folder whose ``python`` is this interpreter (a wrapper: a symlink elsewhere would
    not find the virtual environment)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return bin_dir


def env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO) + os.pathsep
                + os.environ.get("PYTHONPATH", ""))


# ----------------------------------------------------------------------------- tests
def test_every_documented_command_has_an_entry():
    missing = sorted({c for _, c in documented() if c not in COMMANDS})
    where = {c: p for p, c in documented()}
    assert not missing, (
        "documented commands that tests/test_docs_commands.py does not run; add each to "
        "COMMANDS (help / run / page):\n"
        + "\n".join(f"  {where[c]}: {c}" for c in missing))
    for command, how in COMMANDS.items():
        assert re.fullmatch(r"help|help: .+|run|page", how), (command, how)


def test_the_collector_reads_every_kind_of_block():
    text = ("```bash\n# comment\npython a.py \\\n   --x 1   # trailing\n\n```\n"
            "```console\n$ python b.py\noutput line\n```\n```python\nprint(1)\n```\n"
            "```sh\nbash c.sh\n```\n")
    assert page_commands(text) == ["python a.py --x 1", "python b.py", "bash c.sh"]


def _help_runs() -> list[tuple[str, ...]]:
    runs: set[tuple[str, ...]] = set()
    for command in sorted({c for _, c in documented()}):
        how = COMMANDS.get(command)
        if how == "help":
            runs.update(tuple(a) for a in help_argv(command))
        elif how and how.startswith("help: "):
            runs.add(tuple(shlex.split(how[len("help: "):])))
    return sorted(runs)


@pytest.mark.parametrize("argv", _help_runs(), ids=" ".join)
def test_help(argv):
    res = subprocess.run([*resolve(list(argv)), "--help"], cwd=REPO, env=env(),
                         capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "Traceback (most recent call last)" not in out, out
    assert "usage" in out.lower() or len(out.splitlines()) > 3, out


def _literal_runs() -> list[str]:
    return sorted({c for p, c in documented() if COMMANDS.get(c) == "run"
                   and p not in WORKED_EXAMPLES})


@pytest.mark.parametrize("command", _literal_runs())
def test_run(command, tmp_path):
    e = env()
    e["PATH"] = f"{python_on_path(tmp_path)}{os.pathsep}{e['PATH']}"
    res = subprocess.run(["bash", "-c", f"set -e; {command}"], cwd=REPO, env=e,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr


# ------------------------------------------------------------- the worked examples
def _png(colour, size=24, shape="square"):
    from PIL import Image, ImageDraw
    im = Image.new("RGB", (size, size), (128, 128, 128))
    draw = ImageDraw.Draw(im)
    box = (size // 4, size // 4, 3 * size // 4, 3 * size // 4)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=colour)
    return im


def make_inputs(root: Path, weights: bool = False) -> None:
    """The inputs the worked examples start from: my_pairs/ (train and held-out JSONL),
    my_images/ (two classes) and, with ``weights``, model_31.pt (random weights of the
    published B/32 model's names and shapes, as its file holds them)."""
    import torch

    from rwkv_clip import create_RWKV_Model, load_model_configs
    colours = {"red": (220, 30, 30), "blue": (30, 40, 220)}
    (root / "my_pairs" / "images").mkdir(parents=True)
    lines, test = [], []
    for i in range(12):
        name = list(colours)[i % 2]
        shape = "square" if i % 3 else "circle"
        _png(colours[name], shape=shape).save(root / "my_pairs" / "images" / f"{i:04d}.png")
        row = {"image": f"images/{i:04d}.png", "raw": f"a {name} {shape}",
               "synthetic": f"a photo of a {name} {shape}"}
        (test if i >= 8 else lines).append(json.dumps(row))
    (root / "my_pairs" / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    (root / "my_pairs" / "test.jsonl").write_text("\n".join(test) + "\n")
    for name, colour in colours.items():
        (root / "my_images" / name).mkdir(parents=True)
        for j in range(3):
            _png(colour, shape="square" if j else "circle").save(
                root / "my_images" / name / f"{j}.png")
    if not weights:
        return
    with torch.device("meta"):  # shapes only: the values are drawn below, cheaply
        model = create_RWKV_Model(load_model_configs("RWKV_CLIP_B32"))
    g = torch.Generator().manual_seed(0)
    state = {f"module.{k}": 0.02 * torch.randn(v.shape, generator=g, dtype=v.dtype)
             for k, v in model.state_dict().items()}
    torch.save(state, root / "model_31.pt")


def sandbox(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "work"
    root.mkdir()
    for name in ("train.py", "zero_shot.py", "text_image_retrieval.py", "dali.py", "scripts",
                 "model_config"):
        (root / name).symlink_to(REPO / name)
    bin_dir = python_on_path(tmp_path)
    e = env()
    e.pop("HF_HUB_CACHE", None)
    e.pop("HF_HUB_OFFLINE", None)  # the page sets it where it means to
    e.update(HOME=str(tmp_path / "home"), PATH=f"{bin_dir}{os.pathsep}{e['PATH']}",
             HF_HUB_OFFLINE="1")
    return root, e


@pytest.mark.slow
@pytest.mark.parametrize("page", WORKED_EXAMPLES)
def test_worked_example(page, tmp_path):
    path = REPO / page
    if not path.is_file():
        pytest.skip(f"{page} does not exist")
    root, e = sandbox(tmp_path)
    make_inputs(root, weights=page == "docs/hub-cache.md")
    script = ["set -e"]
    script += [c for c in page_commands(path.read_text()) if COMMANDS.get(c) == "page"]
    res = subprocess.run(["bash", "-c", "\n".join(script)], cwd=root, env=e,
                         capture_output=True, text=True, timeout=1200)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Traceback" not in out, out
    if page == "docs/own-data.md":
        assert (root / "data" / "train.rec").is_file() and (root / "data" / "train.idx").is_file()
        results = root / "runs" / "mine" / "eval_results"
        cls = json.loads((results / "imagefolder_zeroshot_classification.json").read_text())
        assert 0 <= cls["metrics"]["acc1"] <= 1
        ret = json.loads((results / "jsonl_zeroshot_retrieval.json").read_text())
        assert "image_retrieval_recall@1" in ret["metrics"]
        assert (root / "runs" / "mine" / "report.png").is_file()
        assert "final zero-shot accuracy:" in (root / "runs" / "mine" / "training.log").read_text()
    else:
        record = json.loads((root / "runs" / "pretrained" / "RWKV-CLIP-B32_yfcc15m"
                             / "eval_results" / "imagefolder_zeroshot_classification.json")
                            .read_text())
        assert record["model"] == "RWKV_CLIP_B32" and record["num_samples"] == 6
