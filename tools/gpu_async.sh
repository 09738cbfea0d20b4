#!/usr/bin/env bash
# The one-GPU asynchrony checks in one call (~10-14 minutes of an H100/H200): whether MPS can run here, then
# bench.py gpu's pipeline part (sync, async, auto; rows to the cap and with the tail) with MPS and without it.
#   bash tools/gpu_async.sh OUT [extra bench.py gpu options]     (OUT: where the JSON and logs go)
# Dry run on CPU (every step but MPS, which needs a GPU):
#   bash tools/gpu_async.sh /tmp/out --device cpu --model DIR --data DIR --train-tokens 4 --iterations 1 \
#       --trainer-args "--sizes rule"
# Each step is under `timeout`, so that one slow step leaves the others their time; the figures go to
# docs/benchmarks.md ("Asynchrony with a realistic tail").
set -u
out=${1:?usage: bash tools/gpu_async.sh OUT [bench.py gpu options]}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
common=(--parts pipeline --tail both --peer-rounds 1 --iterations 3 --train-tokens 256 "$@")

echo "== MPS: can it run here? =="
nvidia-smi --query-gpu=name,compute_mode,driver_version --format=csv 2>&1 | tee "$out/nvidia-smi.txt"
command -v nvidia-cuda-mps-control || echo "nvidia-cuda-mps-control: not installed"
echo "\$ nvidia-cuda-mps-control -d"
nvidia-cuda-mps-control -d; echo "exit status $?"
sleep 1
ls -l "${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}" 2>&1
echo get_server_list | timeout 10 nvidia-cuda-mps-control 2>&1; echo "exit status $?"

echo "== pipeline part with MPS (if it started) =="
timeout 400 python3 bench.py gpu "${common[@]}" --json "$out/pipeline-mps.json" 2>&1 | tee "$out/pipeline-mps.log"

echo "== MPS stopped: pipeline part without it (auto should pick sync) =="
echo quit | timeout 10 nvidia-cuda-mps-control 2>&1; sleep 2
ls -l "${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}" 2>&1
timeout 300 python3 bench.py gpu "${common[@]}" --tail on --json "$out/pipeline-no-mps.json" 2>&1 \
    | tee "$out/pipeline-no-mps.log"
