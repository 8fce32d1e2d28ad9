#!/usr/bin/env bash
# Wheels for the GPU machine, which has no network, for CPython 3.12 on manylinux x86_64, into
# wheelhouse/ (ignored by git; the device call carries it): pfl 0.6.0 (the peer of W3) and what it
# needs that the machine's image lacks, and byzfl 0.0.11 (call 3's peer) alone: its dependencies are
# in the image, and resolving them here would pick another torch with its CUDA 12 libraries (2.8 GB).
# Resolves pfl's whole closure for that platform, then keeps only the projects missing from the
# image (PRESENT: KINDS.md's "Python packages already there"), one version each. fedsim itself and
# tests/test_cuda.py need nothing beyond the image (peft and transformers are there), and the calls
# run no other tests, so no test extras travel.
#   bash benchmarks/gpu_wheelhouse.sh [PIP]          # PIP: a pip command, default "python3 -m pip"
# benchmarks/gpu/call.sh installs them on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fedsim-site wheelhouse/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${1:-python3 -m pip}
WANT=(pfl==0.6.0)
ALONE=(byzfl==0.0.11)  # without its dependencies
PRESENT="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux1_x86_64)
all=$(mktemp -d)
trap 'rm -rf "$all"' EXIT
$PIP download -q "${PLATFORM[@]}" -d "$all" "${WANT[@]}"
$PIP download -q "${PLATFORM[@]}" --no-deps -d "$all" "${ALONE[@]}"
rm -rf wheelhouse && mkdir wheelhouse
for wheel in "$all"/*.whl; do
  name=$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]_.' '[:lower:]--')  # the normalized project name
  if [[ " $(echo $PRESENT) " != *" $name "* ]]; then cp "$wheel" wheelhouse/; fi
done
ls wheelhouse | sed 's/-py.*//; s/-cp.*//'
du -sh wheelhouse
