#!/usr/bin/env bash
# The GPU paths measured and tested on one CUDA host, in parts that each fit one bounded call
# (a lent GPU machine runs at most 10 minutes a command):
#
#   bash benchmarks/gpu_paths.sh PART [OUT]
#
# PART, in the order to run them:
#   tests       pytest -m gpu (every GPU test)
#   resnet18    benchmarks.paired --setups gpu, ResNet-18 b32, 3 paired rounds
#   mnist       the same for mnist_cnn b64
#   cross-host  TensorPipe limited to cuda_basic,basic (what crosses hosts without GPUDirect),
#               local against one pushpull trainer, ResNet-18 b32; then python -m benchmarks state_copy
#   resnet50    the gpu setups for ResNet-50 b32 (23.5M parameters)
#
# Results go to benchmarks/results/gpu-h100/: the paired JSON and Markdown, and every part's
# output in PART.log; they are copied to OUT as well when it is given (a remote machine's
# outbox). A part is stopped at PSSERVER_GPU_PART_S seconds in all (default 540): a paired run
# writes its JSON only at its end, so a stopped one leaves its log alone. No part has been timed
# on a GPU yet.
set -uo pipefail

part="${1:-}"
out="${2:-}"
case "$part" in
  tests|resnet18|mnist|cross-host|resnet50) ;;
  *)
    echo "usage: bash benchmarks/gpu_paths.sh tests|resnet18|mnist|cross-host|resnet50 [OUT]" >&2
    exit 2
    ;;
esac
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_paths.sh: no CUDA device here (torch.cuda.is_available() is False)" >&2
  exit 2
fi
if [ -n "$out" ]; then  # OUT as the caller named it, before the cd
  mkdir -p "$out" && out="$(cd "$out" && pwd)" || exit 2
fi
cd "$(dirname "$0")/.." || exit 2
limit="${PSSERVER_GPU_PART_S:-540}"
results=benchmarks/results/gpu-h100
mkdir -p "$results"
log="$results/$part.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; echo "cores: $(nproc)"; } \
  > "$results/machine.txt" 2>&1

left() {  # seconds of the part's time still left (at least 1)
  local n=$((limit - SECONDS))
  echo $((n > 0 ? n : 1))
}

paired() {  # paired MODEL BATCH [more flags]: SIGINT at the limit, SIGKILL 20 s later
  local model="$1" batch="$2"
  shift 2
  timeout -s INT -k 20 "$(left)" python3 -m benchmarks.paired --netns off --devices cuda:0 \
    --trainer-device cuda:0 --model "$model" --batch-size "$batch" --results-dir "$results" "$@"
}

{
  case "$part" in
    tests)  # SIGINT: pytest tears its fixtures down, which stop the servers and trainers it started
      timeout -s INT -k 30 "$(left)" python3 -m pytest -m gpu -q -p no:cacheprovider
      ;;
    resnet18) paired resnet18 32 --setups gpu --rounds 3 ;;
    mnist) paired mnist_cnn 64 --setups gpu --rounds 3 ;;
    cross-host)
      PSSERVER_TP_CHANNELS=cuda_basic,basic paired resnet18 32 --setups local,ps-pushpull-async-1 --rounds 3 \
        --results-dir "$results/cuda-basic"
      first=$?
      timeout -s INT -k 20 "$(left)" python3 -m benchmarks state_copy --model resnet18 --batch-size 32 \
        --device cuda:0 --results-dir "$results"
      second=$?
      [ "$first" -ne 0 ] && exit "$first"
      exit "$second"
      ;;
    resnet50) paired resnet50 32 --setups gpu --rounds 3 ;;
  esac
} 2>&1 | tee "$log"
status=${PIPESTATUS[0]}

if [ -n "$out" ]; then
  cp -r "$results" "$out/"
fi
exit "$status"
