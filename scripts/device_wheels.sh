#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels the GPU check installs on a lent device, which
# is offline: Python 3.12 with torch 2.11 and a small preinstalled set (see
# scripts/device_wheels.txt for the list and why each wheel is there). Run it here, where
# pip can reach an index; the folder then travels with the working tree (64 MiB at most
# in all, so the wheels must stay under 40 MiB). Prints each wheel and the total size.
#
#     bash scripts/device_wheels.sh                     # for the device: cp312, torch 2.11.0
#     bash scripts/device_wheels.sh --dest DIR --python-version 3.11 --torch 2.14.1 \
#         --only torchvision                            # what the rehearsal adds for its Python
#
# Every wheel is fetched with --no-deps --only-binary=:all: for the target interpreter,
# so the same command gives the same files on any machine; a second run downloads nothing.
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then   # the comment block above is the help
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
    exit 0
fi
cd "$(dirname "$0")/.."
DEST=.whl
PYVER=3.12
TORCH=2.11.0
ONLY=""
MAX_MIB=${DEVICE_WHEELS_MAX_MIB:-40}
while (( $# )); do
    case $1 in
        --dest) DEST=$2; shift 2 ;;
        --python-version) PYVER=$2; shift 2 ;;
        --torch) TORCH=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "error: device_wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
PYTHON=${PYTHON:-python3}

# torchvision is binary and tied to one torch release: torch 2.M.P pairs with 0.(M+15).P
if [[ ! $TORCH =~ ^2\.([0-9]+)\.([0-9]+)$ ]]; then
    echo "error: device_wheels.sh: --torch wants 2.MINOR.PATCH (e.g. 2.11.0), got '$TORCH'" >&2
    exit 2
fi
TORCHVISION="torchvision==0.$(( BASH_REMATCH[1] + 15 )).${BASH_REMATCH[2]}"

mapfile -t REQS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' scripts/device_wheels.txt | grep -v '^$')
REQS+=("$TORCHVISION")
if [[ -n $ONLY ]]; then
    keep=()
    for req in "${REQS[@]}"; do
        [[ ",$ONLY," == *",${req%%==*},"* ]] && keep+=("$req")
    done
    REQS=("${keep[@]}")
fi

mkdir -p "$DEST"
for req in "${REQS[@]}"; do
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEST" "$req" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
done

total=0
for f in "$DEST"/*.whl; do
    size=$(stat -c %s "$f")
    total=$(( total + size ))
    printf '%8.2f MiB  %s\n' "$(echo "$size / 1048576" | bc -l)" "$(basename "$f")"
done
printf '%8.2f MiB  total in %s (%d wheels)\n' "$(echo "$total / 1048576" | bc -l)" "$DEST" \
    "$(ls "$DEST"/*.whl | wc -l)"
if (( total > MAX_MIB * 1048576 )); then
    echo "error: device_wheels.sh: the wheels in $DEST total more than ${MAX_MIB} MiB" >&2
    exit 1
fi
