#!/usr/bin/env bash
# One-shot GPU check for a lent machine (one GPU, offline, bare: python3 3.12 with torch
# 2.11, triton, numpy, pillow, tqdm, regex, scipy, tensorboard, huggingface_hub,
# safetensors, pytest, pyarrow, nvcc). Never a venv, never pip from the network: the
# wheels in .whl/ (made here by scripts/device_wheels.sh) are installed with
# `pip install --no-index --no-deps --target`, and the project runs from this checkout
# with PYTHONPATH. Kernel build, GPU tests, WKV parity and timings (ours and fla's),
# training-step variants, memory against the claims, a torchrun NCCL step, DALI if
# importable: each step with its own timeout, under 8 minutes in all, ONE JSON out.
#
#     bash scripts/gpu_check.sh [OUT.json]              # on the device (default gpu_check.json)
#     bash scripts/gpu_check.sh --rehearse OUT.json     # here: the same run in a device-like venv
#
# The rehearsal builds (once) .cache/device-python/venv with torch and only the device's
# preinstalled set, fills .whl/ when needed, adds a torchvision wheel for that venv's
# Python, and runs every step; the CUDA ones run their CPU dry form and are recorded as
# skipped ("no CUDA device"). Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S
# (default 465 on the device, 3600 in the rehearsal), GPU_CHECK_TIMEOUT_SCALE (rehearsal
# only, default 6: its dry runs share 2 CPU cores), GPU_CHECK_ONLY (steps or groups to run,
# e.g. "speed": the whole model beside open_clip and the step's profile; "glue": the fused
# glue ops' GPU tests and their timings beside the reference, eager and compiled, with no
# kernel build), and
# GPU_CHECK_COMPILE_CACHE (inductor/Triton cache, default .cache/gpu_check/compile; with
# $OUT set it is also packed into $OUT/compile-cache.tar.gz for the next run).
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then   # the comment block above is the help
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
    exit 0
fi
REHEARSE=0
if [[ ${1:-} == --rehearse ]]; then REHEARSE=1; shift; fi
OUT_JSON=$(realpath -m "${1:-gpu_check.json}")   # relative to the caller's directory
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
WHEEL_ARGS=(--wheels .whl)

if (( REHEARSE )); then
    DEV=.cache/device-python
    # the device's set: torch (from the same source bootstrap installs it from) and the
    # preinstalled packages, nothing of the project's own requirements
    if [[ ! -f $DEV/ready ]]; then
        rm -rf "$DEV/venv"
        "${PYTHON:-python3}" -m venv "$DEV/venv"
        "$DEV/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
            -c scripts/constraints.txt torch numpy pillow tqdm regex scipy tensorboard \
            huggingface_hub safetensors pytest pyarrow triton \
            2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
        touch "$DEV/ready"
    fi
    PY="$DEV/venv/bin/python"
    [[ -d .whl ]] && ls .whl/*.whl > /dev/null 2>&1 || bash scripts/device_wheels.sh
    # torchvision is binary: the one in .whl/ is for the device's Python and torch
    read -r PYVER TORCHVER < <("$PY" -c "import sys, torch; \
print(f'{sys.version_info[0]}.{sys.version_info[1]}', torch.__version__.split('+')[0])")
    bash scripts/device_wheels.sh --dest "$DEV/wheels" --python-version "$PYVER" \
        --torch "$TORCHVER" --only torchvision,pyyaml > /dev/null
    WHEEL_ARGS+=(--wheels "$DEV/wheels")
    # the dry runs share this machine's 2 cores and the first one builds the kernels cold
    # (minutes of nvcc), hence the longer limits; later rehearsals reuse the built kernels
    exec "$PY" scripts/gpu_check.py --rehearse "${WHEEL_ARGS[@]}" --out "$OUT_JSON" \
        --budget "${GPU_CHECK_BUDGET_S:-3600}" --timeout-scale "${GPU_CHECK_TIMEOUT_SCALE:-6}"
fi

PY=${PYTHON:-python3}
if ! ls .whl/*.whl > /dev/null 2>&1; then
    echo "error: gpu_check.sh: no wheels in .whl/ (run scripts/device_wheels.sh where pip" \
         "can reach an index, then bring .whl/ along)" >&2
    exit 2
fi
CACHE=${GPU_CHECK_COMPILE_CACHE:-.cache/gpu_check/compile}
rc=0
"$PY" scripts/gpu_check.py "${WHEEL_ARGS[@]}" --out "$OUT_JSON" --compile-cache "$CACHE" \
    --budget "${GPU_CHECK_BUDGET_S:-465}" || rc=$?
# the inductor / Triton cache goes back with the results ($OUT on a lent machine), to be
# brought along next time (unpacked into .cache/gpu_check/compile)
if [[ -n ${OUT:-} && -d $CACHE ]]; then
    tar -czf "$OUT/compile-cache.tar.gz" -C "$CACHE" . || true
fi
exit $rc
