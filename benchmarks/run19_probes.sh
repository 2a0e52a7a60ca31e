#!/usr/bin/env bash
# Run 19's follow-up probes (2x H200), one device call; everything goes to $OUT/probes.log:
#   A  decode capacity: the JPEG pipeline with 15 and with 30 workers (do 32 vCPUs decode twice
#      what 16 do, or are they hyperthreads of 16 cores?)
#   B  the exit of `multigpu train --compile auto` (run 19's time-to-train: 82 s after its time:
#      line): the job's lines stamped; 10 s after the time: line a process tree and every Python
#      process's stacks (faulthandler on SIGUSR2, through a sitecustomize on PYTHONPATH)
#   C  post 002's LSTM on 2 GPUs: hand-written DDP, multigpu, multigpu with OMP_NUM_THREADS=1, in turns
#   D  whole 3-epoch ResNet-50 jobs on the JPEG folder: the default, --decode gpu, --workers 8
#      (auto's hybrid), in one invocation; D_VARIANTS (also decode-cpu, lightning: the peer script)
#      in D_TURNS turns (default 1)
#   OUT=/tmp/p bash benchmarks/run19_probes.sh [A B C D]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src MPLBACKEND=Agg PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}; PY=${PY:-python3}; LOG=$OUT/probes.log
FOLDER=${FOLDER:-/tmp/multigpu-jpeg25k}; RUNS=$(mktemp -d /tmp/probe-runs.XXXXXX)
PARTS=${*:-A B C D}
mkdir -p "$OUT"
say() { echo "$*" | tee -a "$LOG"; }
stamp() {  # prefix each line with seconds since $1
  "$PY" -c 'import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin:
    sys.stdout.write(f"[{time.time() - t0:7.2f}] {line}"); sys.stdout.flush()' "$1"
}
now() { "$PY" -c "import time; print(time.time())"; }
[[ -d $FOLDER ]] || { "$PY" benchmarks/decode_pipeline.py --make "$FOLDER.part" --train 25600 \
    >> "$LOG" 2>&1 && mv "$FOLDER.part" "$FOLDER"; }
TTT=(-m multigpu train --model resnet50 --data "folder:$FOLDER" --batch-size 128 --optimizer sgd
     --lr 0.1 --precision bf16 --devices 2 --workers 15 --logger none)

if [[ " $PARTS " == *" A "* ]]; then
  say "== A: decode pipeline alone, cpu mode, 15 and 30 workers"
  for w in 15 30; do
    timeout 90 "$PY" benchmarks/decode_pipeline.py --folder "$FOLDER" --modes cpu --workers "$w" \
        --rounds 2 --out "$RUNS/decode-$w.json" 2>&1 | tail -1 | sed "s/^/workers $w: /" | tee -a "$LOG"
  done
fi

if [[ " $PARTS " == *" B "* ]]; then
  SITE=$(mktemp -d)
  printf 'import faulthandler, signal\nfaulthandler.register(signal.SIGUSR2, all_threads=True)\n' \
      > "$SITE/sitecustomize.py"
  for variant in plain compile-auto; do
    extra=(); [[ $variant == compile-auto ]] && extra=(--compile auto)
    say "== B: $variant, 1 epoch"
    job_log=$RUNS/b-$variant.log; t0=$(now)
    ( PYTHONPATH=$SITE:$PYTHONPATH timeout 200 "$PY" "${TTT[@]}" --epochs 1 "${extra[@]}" \
        --out "$RUNS/b-$variant" 2>&1 | stamp "$t0" > "$job_log" ) &
    job=$!
    dumped=0; seen=""
    while kill -0 "$job" 2>/dev/null; do
      sleep 1
      [[ -z $seen ]] && grep -q "time: " "$job_log" && seen=$SECONDS
      if [[ -n $seen && $dumped == 0 && $(( SECONDS - seen )) -ge 10 ]]; then
        dumped=1
        say "-- still running 10 s after its time: line; processes:"
        ps -eo pid,ppid,etimes,stat,wchan:24,cmd --forest | grep -E "multigpu|torch" | grep -v grep \
            | cut -c1-220 >> "$LOG"
        pkill -USR2 -f "multigpu (--debug )?train" ; sleep 3
      fi
    done
    wait "$job"
    say "-- exit after $("$PY" -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 1))" "$t0") s"
    cat "$job_log" >> "$LOG"
    for f in "$RUNS/b-$variant"/logs/*/*/*/std*.log "$RUNS/b-$variant"/logs/*/*/std*.log; do
      [[ -s $f ]] && { echo "-- $f" >> "$LOG"; tail -n 120 "$f" >> "$LOG"; }
    done 2>/dev/null
  done
fi

if [[ " $PARTS " == *" C "* ]]; then
  say "== C: post 002, 2 GPUs, 3 epochs: hand, multigpu, multigpu OMP_NUM_THREADS=1, in turns"
  CSV=$RUNS/series.csv
  "$PY" benchmarks/post002_series.py "$CSV"
  for turn in 1 2; do
    for v in hand multigpu multigpu-omp1; do
      t0=$(now); name=c-$v-$turn
      if [[ $v == hand ]]; then
        "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/post002_ddp.py \
            --csv "$CSV" --seq-length 40 --epochs 3 --batch-size 64 --out "$RUNS/$name.json" > "$RUNS/$name.log" 2>&1
        epochs=$("$PY" -c "import json,sys; print([round(e['train_s'],3) for e in json.load(open(sys.argv[1]))['epochs']])" "$RUNS/$name.json")
      else
        env $([[ $v == multigpu-omp1 ]] && echo OMP_NUM_THREADS=1) "$PY" -m multigpu train --model lstm \
            --data "timeseries:$CSV" --seq-length 40 --epochs 3 --batch-size 64 --optimizer adam \
            --lr 1e-3 --devices 2 --logger none --checkpoint-every 0 --out "$RUNS/$name" > "$RUNS/$name.log" 2>&1
        epochs=$(grep -o "[0-9.]* s  [0-9,]* samples/s" "$RUNS/$name.log" | tr '\n' ';')
        grep "^time: " "$RUNS/$name.log" >> "$LOG"
      fi
      say "$name: whole $("$PY" -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 1))" "$t0") s, epochs $epochs"
    done
  done
fi

if [[ " $PARTS " == *" D "* ]]; then
  VARIANTS=${D_VARIANTS:-default decode-gpu workers8}
  say "== D: whole 3-epoch jobs: $VARIANTS; ${D_TURNS:-1} turn(s)"
  for turn in $(seq "${D_TURNS:-1}"); do
    for v in $VARIANTS; do
      job=(timeout 150 "$PY" "${TTT[@]}" --epochs 3 --out "$RUNS/d-$turn-$v")
      case $v in
        decode-gpu) job+=(--decode gpu) ;;
        decode-cpu) job+=(--decode cpu) ;;
        workers8) job+=(--workers 8) ;;
        lightning) job=(timeout 150 "$PY" benchmarks/peers/lightning_imagefolder.py "$FOLDER" --epochs 3
                        --batch-size 128 --workers 15 --gpus 2) ;;
      esac
      t0=$(now)
      "${job[@]}" > "$RUNS/d-$turn-$v.log" 2>&1
      say "d-$turn-$v: rc $? whole $("$PY" -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 1))" "$t0") s"
      grep -E "^(epoch|time:|multigpu train:|.*decode|RESULT)" "$RUNS/d-$turn-$v.log" | cut -c1-400 >> "$LOG"
    done
  done
fi
say "== probes done"
