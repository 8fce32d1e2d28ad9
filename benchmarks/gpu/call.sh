#!/usr/bin/env bash
# One prepared GPU call (issue 29), from the repository root of the copy on the device machine:
#   bash benchmarks/gpu/call.sh 1      # at most 300 s: environment, gate, CUDA tests, W1/W2 vs the sequential loop
#   bash benchmarks/gpu/call.sh 2      # at most 360 s: W3 vs pfl-research, W2 with fedavg_cnn, LM memory rows
#   bash benchmarks/gpu/call.sh 3      # at most 540 s: ByzFL's benchmark, ByzFL beside fedsim, then the grid
#   OUT=/tmp/gpu-dry bash benchmarks/gpu/call.sh 1 --tiny    # the dry run on a CPU
# Installs the carried wheels (wheelhouse/, from gpu_wheelhouse.sh) beside the image's packages,
# points fedsim at the carried MNIST (datasets/, from gpu_data.sh) and runs benchmarks/gpu/calls.py
# under a hard limit 10 s inside the device call's timeout_s. Results: $OUT/call<N>.json and .log.
set -u
cd "$(dirname "$0")/../.."
call=${1:?say which call: 1, 2 or 3}
shift
: "${OUT:?set OUT to the output folder}"
case "$call" in
  1) budget=280 limit=288 ;;
  2) budget=340 limit=348 ;;
  3) budget=520 limit=528 ;;
  *) echo "call: 1, 2 or 3" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
if ls wheelhouse/*.whl >/dev/null 2>&1; then
  if $PYTHON -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fedsim-site \
      wheelhouse/*.whl || { echo "fedsim: the carried wheels did not install" >&2; exit 4; }
    export PYTHONPATH=/tmp/fedsim-site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "SKIP wheel install: the wheels are for CPython 3.12, $PYTHON is $($PYTHON -V 2>&1)"
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} FEDSIM_DATA=${FEDSIM_DATA:-$PWD/datasets} PYTHONUNBUFFERED=1
[[ -f "$FEDSIM_DATA/MNIST/raw/train-images-idx3-ubyte.gz" ]] || echo "WARNING: no MNIST under $FEDSIM_DATA (carry datasets)"
exec timeout -k 5 "$limit" $PYTHON benchmarks/gpu/calls.py "$call" --out "$OUT" --budget-s "$budget" "$@"
