#!/usr/bin/env python
"""The main job (README command 1, ``train.py`` with no flags) over several seeds, CPU paths
and thread counts, one JSON.

Each run trains into RUNS/seedN (``--runs``, default runs/main_job; RUNS/PATH-tN-seedN in
a grid) and its final zero-shot top-1 on the held-out and the shifted split is read from
its training.log; the JSON holds every run, their min / median / max and the machine (CPU
model, ISA). A CPU path forces the arithmetic of another CPU on this one (``avx2``,
``avx512``: the instruction-set level; ``mkl``, ``onednn``: the fp32 GEMM; joined by
``+``). See rwkv_clip.bench.main_job.

    python scripts/bench_main_job.py --seeds 0,1 --paths native,avx2 --threads 1,2 \
        --out docs/results/main_job_grid.json
    python scripts/bench_main_job.py --seeds 0,1,2 --runs runs --reuse   # runs already there
    python scripts/bench_main_job.py --seeds 0,1 --paths native,avx2,avx2+mkl --threads 1,2

``--against DIR`` times command 1 here against another checkout (e.g. the commit before a
recipe change, ``git worktree add ../before HEAD~1``): ``--repeats`` pairs in ABBA order,
each run generating the built-in set afresh, the paired ratio of wall times in the JSON.

    python scripts/bench_main_job.py --seeds 0 --against ../before --out docs/results/main_job_time.json

Arguments after ``--`` go to train.py (e.g. ``-- --epochs 3``).
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rwkv_clip.bench.main_job import main as run
from rwkv_clip.errors import run_cli


def main(argv=None) -> int:
    import argparse
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")],
                    help="comma-separated seeds (default: 0,1,2)")
    ap.add_argument("--paths", default="native", type=lambda s: s.split(","),
                    help="comma-separated CPU paths (native, avx2, avx512, mkl, onednn; "
                         "combined with '+'; default: native)")
    ap.add_argument("--threads", default=None,
                    type=lambda s: [int(x) for x in s.split(",")],
                    help="comma-separated thread counts (OMP_NUM_THREADS; default: torch's)")
    ap.add_argument("--runs", default="runs/main_job", help="folder of the run folders")
    ap.add_argument("--reuse", action="store_true",
                    help="read a seed's finished run from RUNS/seedN instead of training it")
    ap.add_argument("--out", help="also write the JSON to this file")
    ap.add_argument("--against", metavar="DIR",
                    help="time command 1 here against the checkout in DIR (paired, ABBA; "
                         "the first seed only)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="pairs of runs with --against (default: 2)")
    ns = ap.parse_args(argv)
    ns.train_args = train_args
    return run(ns)


if __name__ == "__main__":
    sys.exit(run_cli(main))
