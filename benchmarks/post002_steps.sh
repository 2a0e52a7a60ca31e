#!/usr/bin/env bash
# Post 002's LSTM on N GPUs, step by step: the host's time between optimizer steps of the
# hand-written DDP script and of `multigpu train` (benchmarks/step_probe: torch's global step hook,
# no change to either), a torch.profiler table of each, then variants of multigpu in turns.
#   OUT=/tmp/s [GPUS=2] [TURNS=2] [DEVICES=2|cpu:2] [PROFILE=0] [WATCH=0] bash benchmarks/post002_steps.sh
# -> $OUT/steps.log. PROFILE=0: no profiled runs; WATCH=0: no turns of multigpu without its hang
# watchdog and NCCL flight recorder. VARIANTS="NAME=ARGS;NAME=ARGS": more multigpu runs in each turn,
# e.g. VARIANTS="bf16=--precision bf16;tst=--model tst" (a later --model overrides lstm).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/benchmarks/step_probe:$PWD/src MPLBACKEND=Agg
OUT=${OUT:?set OUT}; PY=${PY:-python3}; GPUS=${GPUS:-2}; TURNS=${TURNS:-2}; DEVICES=${DEVICES:-$GPUS}
LOG=$OUT/steps.log; WORK=$(mktemp -d /tmp/post002-steps.XXXXXX); CSV=$WORK/series.csv
mkdir -p "$OUT"
"$PY" benchmarks/post002_series.py "$CSV"
run() {  # run NAME [ENV=...] -- VARIANT ARGS: one job, its step times appended to the log
  local name=$1 variant=$2; shift 2
  local start=$SECONDS
  if [[ $variant == hand ]]; then
    env STEP_PROBE="$WORK/$name" "$@" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$GPUS" \
        benchmarks/post002_ddp.py --csv "$CSV" --seq-length 40 --epochs 3 --batch-size 64 \
        --out "$WORK/$name-hand.json" > "$WORK/$name.log" 2>&1
  else
    env STEP_PROBE="$WORK/$name" "$@" "$PY" -m multigpu train --model lstm --data "timeseries:$CSV" \
        --seq-length 40 --epochs 3 --batch-size 64 --optimizer adam --lr 1e-3 --devices "$DEVICES" \
        --logger none --checkpoint-every 0 --out "$WORK/$name" $EXTRA > "$WORK/$name.log" 2>&1
  fi
  echo "$name rc $? wall $(( SECONDS - start )) s rank0 $(cat "$WORK/$name-rank0.json" 2>/dev/null)" | tee -a "$LOG"
}
if [[ ${PROFILE:-1} != 0 ]]; then
  EXTRA="" run profile-hand hand STEP_PROBE_PROFILE=1
  EXTRA="" run profile-multigpu multigpu STEP_PROBE_PROFILE=1
  for f in "$WORK"/profile-*-rank0.txt; do echo "== $f" >> "$LOG"; cat "$f" >> "$LOG"; done
fi
for turn in $(seq "$TURNS"); do
  EXTRA="" run "hand-$turn" hand
  EXTRA="" run "multigpu-$turn" multigpu
  [[ ${WATCH:-1} != 0 ]] && EXTRA="--hang-timeout 0" run "multigpu-nowatch-nofr-$turn" multigpu TORCH_FR_BUFFER_SIZE=0
  IFS=';' read -r -a variants <<< "${VARIANTS:-}"
  for v in "${variants[@]}"; do
    EXTRA="${v#*=}" run "multigpu-${v%%=*}-$turn" multigpu
  done
done
grep -h "^time: " "$WORK"/multigpu-*.log >> "$LOG"
