#!/usr/bin/env bash
# The data for the GPU machine, which has no network: MNIST's four raw .gz files (12 MB) from
# $FEDSIM_DATA into datasets/MNIST/raw (ignored by git; the device call carries datasets), in
# torchvision's layout, which fedsim reads directly. --fashion adds Fashion-MNIST (30 MB more),
# which neither prepared call needs. CIFAR-10 (W3) stays behind: 170 MB does not travel, and W3
# generates CIFAR-shaped tensors where its files are absent.
#   FEDSIM_DATA=/path/to/datasets bash benchmarks/gpu_data.sh [--fashion]
set -euo pipefail
cd "$(dirname "$0")/.."
: "${FEDSIM_DATA:?set FEDSIM_DATA to the folder holding MNIST/raw}"
names=(MNIST)
[[ "${1:-}" == "--fashion" ]] && names+=(FashionMNIST)
files=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)
for name in "${names[@]}"; do
  mkdir -p "datasets/$name/raw"
  for file in "${files[@]}"; do
    [[ -f "$FEDSIM_DATA/$name/raw/$file" ]] || { echo "gpu_data.sh: $FEDSIM_DATA/$name/raw/$file is missing" >&2; exit 1; }
    cp "$FEDSIM_DATA/$name/raw/$file" "datasets/$name/raw/"
  done
done
du -sh datasets/*/
