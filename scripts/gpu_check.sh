#!/usr/bin/env bash
# One-shot GPU check (one H200, no internet): build the kernels, run the GPU tests, the
# WKV and training benchmarks and the memory planner's measurements; every step has its
# own timeout and the whole run stays under 8 minutes. Failures are recorded per step,
# never abort the run. Everything lands in ONE JSON file (also printed):
#
#     bash scripts/gpu_check.sh [out.json]        # default: gpu_check.json
#
# Environment: PYTHON (default .venv/bin/python; bootstrapped with scripts/bootstrap.sh
# when missing), GPU_CHECK_BUDGET_S (total seconds, default 465).
set -u
OUT_JSON=$(realpath -m "${1:-gpu_check.json}")   # relative to the caller's directory
cd "$(dirname "$0")/.."
BUDGET=${GPU_CHECK_BUDGET_S:-465}
START=$(date +%s)
WORK=$(mktemp -d -t gpu_check.XXXXXX)
export PYTHONUNBUFFERED=1
STEPS=()

remaining() { echo $(( BUDGET - ($(date +%s) - START) )); }

# run_step NAME TIMEOUT_S CMD...: run with min(TIMEOUT_S, time left - 15 s) as its limit
run_step() {
    local name=$1 limit=$2; shift 2
    local left; left=$(( $(remaining) - 15 ))
    (( limit > left )) && limit=$left
    STEPS+=("$name")
    printf '%s\n' "$*" > "$WORK/$name.cmd"
    if (( limit < 5 )); then
        echo "skipped: no time left in the ${BUDGET}s budget" > "$WORK/$name.err"
        : > "$WORK/$name.out"
        echo "-1 0 skipped" > "$WORK/$name.status"
        echo "== $name: skipped (budget spent)" >&2
        return
    fi
    echo "== $name (limit ${limit}s): $*" >&2
    local t0 t1 rc
    t0=$(date +%s%N)
    timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$WORK/$name.out" 2> "$WORK/$name.err"
    rc=$?
    t1=$(date +%s%N)
    echo "$rc $(( (t1 - t0) / 1000000 )) $limit" > "$WORK/$name.status"
    echo "   rc=$rc" >&2
}

# --- environment -----------------------------------------------------------------------
if [[ -z "${PYTHON:-}" ]]; then
    if [[ ! -x .venv/bin/python ]]; then
        run_step bootstrap 120 bash scripts/bootstrap.sh
    fi
    PYTHON=.venv/bin/python
fi
run_step environment 20 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; \
$PYTHON -c 'import torch, json; print(json.dumps(dict(torch=torch.__version__, cuda=torch.version.cuda, available=torch.cuda.is_available(), device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)))'"

# --- kernels, tests, benchmarks ------------------------------------------------------------
run_step build_kernels 150 "$PYTHON" -m rwkv_clip.ops build
run_step gpu_tests 90 "$PYTHON" -m pytest -m gpu --slow -q -p no:cacheprovider
run_step bench_wkv 75 "$PYTHON" scripts/bench_wkv.py
run_step bench_train_b32_bf16 55 "$PYTHON" scripts/bench_train.py \
    --config model_config/RWKV_CLIP_B32.json --batch-size 256 --precision bf16
run_step bench_train_b32_bf16_ckpt 55 "$PYTHON" scripts/bench_train.py \
    --config model_config/RWKV_CLIP_B32.json --batch-size 256 --precision bf16 --checkpointing
run_step memory_inference_b1_bf16 35 "$PYTHON" -m rwkv_clip.memory \
    --config model_config/RWKV_CLIP_B32.json --batch-size 1 --precision bf16 \
    --mode inference --measure --device cuda --json
run_step memory_train_b256_bf16 50 "$PYTHON" -m rwkv_clip.memory \
    --config model_config/RWKV_CLIP_B32.json --batch-size 256 --precision bf16 \
    --measure --device cuda --json

# --- one JSON ---------------------------------------------------------------------------
ASSEMBLER=$PYTHON
"$ASSEMBLER" -c 'import json' 2>/dev/null || ASSEMBLER=python3
"$ASSEMBLER" - "$WORK" "$OUT_JSON" "$START" "$BUDGET" "${STEPS[@]}" <<'EOF'
import json, sys, time
work, out, start, budget, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]

def read(path, limit=None):
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return ""
    return text[-limit:] if limit else text

def last_json(text):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None

steps = {}
for name in names:
    status = read(f"{work}/{name}.status").split()
    rc = int(status[0]) if status else None
    stdout = read(f"{work}/{name}.out")
    steps[name] = {
        "command": read(f"{work}/{name}.cmd").strip(),
        "rc": rc,
        "ok": rc == 0,
        "seconds": int(status[1]) / 1000 if len(status) > 1 else None,
        "limit_s": status[2] if len(status) > 2 else None,
        "timed_out": rc in (124, 137),
        "skipped": rc == -1,
        "result": last_json(stdout),
        "stdout_tail": stdout[-4000:],
        "stderr_tail": read(f"{work}/{name}.err", 4000),
    }
summary = {
    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "budget_s": budget,
    "total_s": round(time.time() - start, 1),
    "all_ok": all(s["ok"] for s in steps.values()),
    "failed": [n for n, s in steps.items() if not s["ok"]],
    "steps": steps,
}
text = json.dumps(summary, indent=1)
open(out, "w").write(text + "\n")
print(text)
EOF
rm -rf "$WORK"
