#!/usr/bin/env bash
# The GPU table's training, decode and end-to-end parts for a lent GPU machine, sized to its limits (10 minutes a
# command, 15 minutes of device time in all), every output under $OUT.
#
#   bash tools/gpu_check.sh train decode     # call 1: ~9 minutes at most (train 300 s, decode 240 s)
#   bash tools/gpu_check.sh peer             # call 2: ~5.5 minutes at most (TRL against sync and async)
#   bash tools/gpu_check.sh train-fit        # the train part at the micro-batch a run fits to the memory
#                                            # (launch/memory.py), over 64 prompts so that the fit, not the
#                                            # iteration, bounds it: it must train without running out of memory
#
# The train part times the training phases eager and with --compile-train on's compiled layers, side by side, the
# compilation apart (benchmarks/train_step.py). Each part runs `python bench.py gpu --parts PART` under its own
# `timeout`, so a part that hangs or compiles for too long costs its limit, not the lease; its log ($OUT/PART.log),
# figures ($OUT/PART.json) and exit status ($OUT/PART.status) come back either way. Nothing is downloaded: TRL and
# datasets come as wheels carried in .whl/, the GSM8K questions in .gpu-data/gsm8k/ (docs/benchmarks.md, "How a
# session with a lent GPU runs it", builds both). GPU_CHECK_CPU=1 runs the same parts on CPU at a tiny size (1
# layer, vocabulary 512): the dry run tests/cli/test_bench.py makes, so that a lease's minutes go to measuring.
set -u
OUT=${OUT:?OUT: the folder the results go to}
DATA=${DATA:-.gpu-data/gsm8k}
MODEL=${MODEL:-}  # pipeline and peer parts: a model folder (default: tools/qwen_shaped_random.py's, built each call)
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
if [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-check-site .whl/*.whl \
        > "$OUT/pip.log" 2>&1 && export PYTHONPATH=/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
if [ "${GPU_CHECK_CPU:-0}" = 1 ]; then
    FIT_PROMPTS=2
    SIZE=(--device cpu --layers 1 --vocab 512 --prompts 2 --group-size 2 --decode-tokens 6 --rounds 1
          --train-tokens 4 --iterations 1 --peer-rounds 1 --trainer-args "--sizes rule"
          --trl-python "${TRL_PYTHON:-/nonexistent}")  # peer: skipped, with the reason, unless TRL_PYTHON has trl
else
    SIZE=(--train-tokens 128 --iterations 3 --peer-rounds 1)
    nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
fi
declare -A LIMIT=([train]=300 [train-fit]=180 [decode]=240 [peer]=330 [pipeline]=300 [kernels]=200)
declare -A EXTRA=([train-fit]="--train-micro-groups 0 --prompts ${FIT_PROMPTS:-64} --train-compile off")  # before -fit
status=0
for part in "$@"; do
    [ -n "${LIMIT[$part]:-}" ] || { echo "error: unknown part $part (train, train-fit, decode, peer, pipeline, kernels)"
                                    exit 2; }
    start=$(date +%s)
    # shellcheck disable=SC2086  # EXTRA holds several words
    timeout --kill-after=10 "${LIMIT[$part]}" "$PYTHON" bench.py gpu --parts "${part%-fit}" --data "$DATA" \
        ${MODEL:+--model "$MODEL"} "${SIZE[@]}" ${EXTRA[$part]:-} \
        --json "$OUT/$part.json" > "$OUT/$part.log" 2>&1
    code=$?
    echo "$code $(( $(date +%s) - start ))s" > "$OUT/$part.status"
    echo "gpu_check: $part exit $code in $(( $(date +%s) - start )) s (limit ${LIMIT[$part]} s): $OUT/$part.log"
    [ "$code" = 0 ] || status=1
done
exit $status
