#!/usr/bin/env bash
# The datasets for the GPU machine, which has no network: MNIST and Fashion-MNIST's raw .gz files
# (12 + 30 MB) from $FEDSIM_DATA into datasets/ (ignored by git; carry datasets/MNIST and
# datasets/FashionMNIST). fedsim's default data root there is datasets/. CIFAR-10 (W3) is left
# out: 170 MB does not travel, and W3 generates CIFAR-shaped tensors where its files are absent.
#   FEDSIM_DATA=/path/to/data bash benchmarks/gpu_data.sh [--no-fashion]
set -euo pipefail
cd "$(dirname "$0")/.."
: "${FEDSIM_DATA:?set FEDSIM_DATA to the folder holding MNIST/raw}"
names=(MNIST)
[[ "${1:-}" == "--no-fashion" ]] || names+=(FashionMNIST)
for name in "${names[@]}"; do
  mkdir -p "datasets/$name/raw"
  cp "$FEDSIM_DATA/$name/raw/"*.gz "datasets/$name/raw/"
done
du -sh datasets/*/
