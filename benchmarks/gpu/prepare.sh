#!/usr/bin/env bash
# Everything the two GPU calls carry, prepared here and checked against the device tool's limit:
# the wheels (benchmarks/gpu_wheelhouse.sh -> wheelhouse/) and MNIST (benchmarks/gpu_data.sh ->
# datasets/), then the size of all that travels: tracked and untracked-not-ignored files plus the
# carried folders, at most 64 MiB. Exit status 1 if it is over.
#   FEDSIM_DATA=/path/to/datasets bash benchmarks/gpu/prepare.sh [PIP]
set -euo pipefail
cd "$(dirname "$0")/../.."
LIMIT=$((64 * 1024 * 1024))
CARRY=(wheelhouse datasets)
bash benchmarks/gpu_wheelhouse.sh "${1:-python3 -m pip}"
bash benchmarks/gpu_data.sh
for path in "${CARRY[@]}"; do
  git check-ignore -q "$path" || { echo "prepare.sh: $path is not ignored by git; it would travel twice" >&2; exit 1; }
done
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
carried=$(find "${CARRY[@]}" -type f -print0 | xargs -0 stat -c %s | awk '{s += $1} END {print s + 0}')
shared=0
[[ -d shared ]] && shared=$(find shared -type f -print0 | xargs -0 stat -c %s | awk '{s += $1} END {print s + 0}')
total=$((tree + carried + shared))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "travels: working tree $(mib "$tree") + carried ${CARRY[*]} $(mib "$carried") + shared/ $(mib "$shared") = $(mib "$total") of 64 MiB"
ls wheelhouse
if ((total > LIMIT)); then echo "prepare.sh: over the 64 MiB the device call may send" >&2; exit 1; fi
