#!/usr/bin/env bash
# The GPU test tier as two pytest sessions side by side on one 4-GPU machine, GPUs 0,1 and 2,3
# (tests/gpu/conftest.py: MULTIGPU_TEST_GPUS gives a session its GPUs), so that the 2-GPU tier
# takes about half the wall time. Each session is time-boxed; the rest of a session's tests after
# its box show as not run in its log.
#
#     OUT=dir BOX=560 bash benchmarks/gpu_tests_two_pairs.sh "SELECTION FOR 0,1" "SELECTION FOR 2,3"
#
# A SELECTION is pytest arguments: files, `-k` expressions (quoted inside). Logs: $OUT/pair01.log,
# $OUT/pair23.log, and junit XML beside them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT to a folder for the logs}"
BOX="${BOX:-560}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg PYTHONUNBUFFERED=1
mkdir -p "$OUT"

session() {  # session GPUS NAME SELECTION
    local gpus=$1 name=$2 selection=$3
    eval "set -- $selection"
    MULTIGPU_TEST_GPUS=$gpus CUDA_VISIBLE_DEVICES=$gpus \
        timeout -k 10 "$BOX" python3 -m pytest -m gpu -p no:cacheprovider -v -rA --durations=0 \
        --junitxml "$OUT/$name.xml" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: exit $? after $SECONDS s" >>"$OUT/$name.log"
}

session 0,1 pair01 "$1" &
session 2,3 pair23 "$2" &
wait
tail -n 3 "$OUT"/pair*.log
