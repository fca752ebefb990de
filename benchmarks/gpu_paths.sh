#!/usr/bin/env bash
# The GPU paths measured and tested on one CUDA host, in parts that each fit one bounded call
# (a lent GPU machine runs at most 10 minutes a command):
#
#   bash benchmarks/gpu_paths.sh PART [OUT]
#
# PART, in the order to run them:
#   tests       pytest -m gpu (every GPU test), its log kept
#   resnet18    benchmarks.paired --setups gpu, ResNet-18 b32, 3 paired rounds
#   mnist       the same for mnist_cnn b64
#   cross-host  TensorPipe limited to cuda_basic,basic (what crosses hosts without GPUDirect),
#               local against one pushpull trainer, ResNet-18 b32; and benchmarks.state_copy
#   resnet50    the gpu setups for ResNet-50 b32 (23.5M parameters)
#
# Results go to benchmarks/results/gpu-h100/ (the paired JSON and Markdown, the test log), and
# are copied to OUT as well when it is given (a remote machine's outbox). Each part stops itself
# at PSSERVER_GPU_PART_S seconds (default 540), leaving what it measured so far; no part has
# been timed on a GPU yet.
set -uo pipefail
cd "$(dirname "$0")/.."

part="${1:-}"
out="${2:-}"
limit="${PSSERVER_GPU_PART_S:-540}"
results=benchmarks/results/gpu-h100
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_paths.sh: no CUDA device here (torch.cuda.is_available() is False)" >&2
  exit 2
fi
mkdir -p "$results"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$results/machine-$part.txt" 2>&1
nproc >> "$results/machine-$part.txt"

paired() {  # paired MODEL BATCH [more flags]
  local model="$1" batch="$2"
  shift 2
  timeout -k 20 "$limit" python3 -m benchmarks.paired --netns off --devices cuda:0 --trainer-device cuda:0 \
    --model "$model" --batch-size "$batch" --results-dir "$results" "$@"
}

case "$part" in
  tests)
    timeout -k 20 "$limit" python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$results/gpu-tests.log"
    status=${PIPESTATUS[0]}
    ;;
  resnet18) paired resnet18 32 --setups gpu --rounds 3; status=$? ;;
  mnist) paired mnist_cnn 64 --setups gpu --rounds 3; status=$? ;;
  cross-host)
    PSSERVER_TP_CHANNELS=cuda_basic,basic paired resnet18 32 --setups local,ps-pushpull-async-1 --rounds 3 \
      --results-dir "$results/cuda-basic"
    status=$?
    timeout -k 20 "$limit" python3 -m benchmarks.state_copy --model resnet18 --batch-size 32 --device cuda:0 \
      --results-dir "$results" || status=$?
    ;;
  resnet50) paired resnet50 32 --setups gpu --rounds 3; status=$? ;;
  *)
    echo "usage: bash benchmarks/gpu_paths.sh tests|resnet18|mnist|cross-host|resnet50 [OUT]" >&2
    exit 2
    ;;
esac

if [ -n "$out" ]; then
  mkdir -p "$out" && cp -r "$results" "$out/"
fi
exit "$status"
