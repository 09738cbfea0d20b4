#!/usr/bin/env bash
# The one-GPU asynchrony checks (an H100/H200; not yet run on one): whether MPS can run here (the command and its
# output), then bench.py gpu's pipeline part (sync, async, auto; rows to the cap and with the tail) with MPS, then
# without it. Two steps, each under 10 minutes (the device tool's limit per command), in this order:
#   bash tools/gpu_async.sh OUT mps     [extra bench.py gpu options]   (starts MPS, 6 runs: ~4-7 minutes)
#   bash tools/gpu_async.sh OUT no-mps  [extra bench.py gpu options]   (stops MPS, 3 runs with the tail: ~2-4)
# (OUT: where the JSON and logs go.) Dry run on CPU (every step but MPS itself, which needs a GPU):
#   bash tools/gpu_async.sh /tmp/out mps --device cpu --model DIR --data DIR --train-tokens 4 --iterations 1 \
#       --trainer-args "--sizes rule"
# The figures go to docs/benchmarks.md ("Asynchrony with a realistic tail, on one device").
set -u
out=${1:?usage: bash tools/gpu_async.sh OUT mps|no-mps [bench.py gpu options]}
step=${2:?usage: bash tools/gpu_async.sh OUT mps|no-mps [bench.py gpu options]}
shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
common=(--parts pipeline --peer-rounds 1 --iterations 3 --train-tokens 256 "$@")
pipes=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}

case $step in
mps)
    echo "== MPS: can it run here? =="
    nvidia-smi --query-gpu=name,compute_mode,driver_version --format=csv 2>&1 | tee "$out/nvidia-smi.txt"
    command -v nvidia-cuda-mps-control || echo "nvidia-cuda-mps-control: not installed"
    echo "\$ nvidia-cuda-mps-control -d"
    nvidia-cuda-mps-control -d; echo "exit status $?"
    sleep 1
    ls -l "$pipes" 2>&1
    echo get_server_list | timeout 10 nvidia-cuda-mps-control 2>&1; echo "exit status $?"
    echo "== pipeline part with MPS (if it started) =="
    timeout 540 python3 bench.py gpu "${common[@]}" --tail both --json "$out/pipeline-mps.json" 2>&1 \
        | tee "$out/pipeline-mps.log"
    ;;
no-mps)
    echo "== MPS stopped: pipeline part without it (auto should pick sync) =="
    echo quit | timeout 10 nvidia-cuda-mps-control 2>&1; sleep 2
    ls -l "$pipes" 2>&1
    timeout 540 python3 bench.py gpu "${common[@]}" --tail on --json "$out/pipeline-no-mps.json" 2>&1 \
        | tee "$out/pipeline-no-mps.log"
    ;;
*)
    echo "step: mps or no-mps, not $step" >&2; exit 2 ;;
esac
