#!/usr/bin/env bash
# Create .venv (if missing) and install rwkv-clip with its test and DALI extras.
# Idempotent: a second run only re-checks the install. Works without a GPU.
#
# The install runs through uv (from PyPI, into .venv) when it can: uv unpacks the ~6 GB
# of torch/CUDA/DALI wheels in parallel, about 45 s here against pip's 2.5 min. uv does
# not read pip's configuration, so the indexes, find-links folders, constraints (this
# machine's torch cap included) and certificate pip is configured with are handed to it;
# resolution follows pip's (the best version over all indexes). Without uv (no network
# for it, or --pip) pip does the same install.
#
# Flags: --pip (install with pip, not uv); --extras LIST (default dev,dali).
set -euo pipefail
INSTALLER=uv
EXTRAS=dev,dali
while [[ $# -gt 0 ]]; do
    case $1 in
        -h|--help)   # the comment block above is the help
            sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
            exit 0 ;;
        --pip) INSTALLER=pip; shift ;;
        --extras) EXTRAS=${2:?--extras needs a comma-separated list}; shift 2 ;;
        *) echo "bootstrap.sh: error: unknown argument $1 (flags: --pip, --extras LIST)" >&2
           exit 2 ;;
    esac
done
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)

# pip's settings as uv flags: `pip config list` prints key='value' lines (files and
# PIP_* environment variables); values holding several entries are space-separated.
uv_flags() {
    local line key val v
    UV_ARGS=(--index-strategy unsafe-best-match)
    while IFS= read -r line; do
        key=${line%%=*}; key=${key##*.}
        val=${line#*=}; val=${val#\'}; val=${val%\'}
        case "$key" in
            index-url) UV_ARGS+=(--index-url "$val") ;;
            extra-index-url) for v in $val; do UV_ARGS+=(--extra-index-url "$v"); done ;;
            find-links) for v in $val; do UV_ARGS+=(--find-links "$v"); done ;;
            constraint) for v in $val; do [[ -f $v ]] && UV_ARGS+=(-c "$v"); done ;;
            cert) export SSL_CERT_FILE=$val ;;
        esac
    done < <("${PIP[@]}" config list 2>/dev/null || true)
}

install_with_uv() {
    [[ $INSTALLER == uv ]] || return 1
    if [[ ! -x .venv/bin/uv ]]; then
        "${PIP[@]}" install --quiet uv >/dev/null 2>&1 || return 1
    fi
    uv_flags
    .venv/bin/uv pip install --quiet --python .venv/bin/python "${UV_ARGS[@]}" \
        -c scripts/constraints.txt -e ".[${EXTRAS}]"
}

if ! install_with_uv; then
    "${PIP[@]}" install --quiet -c scripts/constraints.txt -e ".[${EXTRAS}]"
fi
.venv/bin/python -c "import rwkv_clip, torch; print(f'rwkv_clip {rwkv_clip.__version__} ready (torch {torch.__version__}, CUDA available: {torch.cuda.is_available()})')"
