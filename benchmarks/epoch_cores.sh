#!/usr/bin/env bash
# Whole `multigpu train` epochs on real JPEGs against the bench's synthetic step, on one GPU, with
# the rank's main process and its loader workers on shared or separate cores. One invocation, the
# train runs in turns (A B C D A B C D ...), so the machine's drift hits every setting alike.
#   OUT=/tmp/ec bash benchmarks/epoch_cores.sh
# Settings (NAME:WORKERS:MAIN_CPUS:WORKER_CPUS; '-' = no pinning):
#   default   the product's default: its own worker count, nothing pinned
#   w14-split 14 workers on cores 2-15, the rank's process (main thread, pin-memory thread) on 0-1
#   w15-split 15 workers on cores 1-15, the rank's process on 0
#   w14       14 workers, nothing pinned (the worker count alone)
# MULTIGPU_WORKER_CPUS is read by the loader workers (core/loader_workers.py) for this experiment.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}; PY=${PY:-python3}; ROUNDS=${ROUNDS:-2}; EPOCHS=${EPOCHS:-2}
SETTINGS=${SETTINGS:-"default:-:-:- w14-split:14:0-1:2-15 w15-split:15:0-0:1-15 w14:14:-:-"}
mkdir -p "$OUT"
timeout 200 "$PY" -m multigpu bench --model resnet50 --gpus 1 --devices 1 --methods multigpu-single \
  --data synthetic,real-cpu --images detailed --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/runs.txt"
FOLDER=$(ls -d "${XDG_CACHE_HOME:-$HOME/.cache}"/multigpu/bench-images/jpeg-detailed-* | tail -1)
pin() {  # pin CPUS CMD...: CMD with its process (and all it starts) on CPUS
  local cpus=$1; shift
  if [ "$cpus" = - ]; then "$@"; return; fi
  "$PY" -c 'import os, sys; lo, hi = map(int, sys.argv[1].split("-")); os.sched_setaffinity(0, range(lo, hi + 1)); os.execvp(sys.argv[2], sys.argv[2:])' "$cpus" "$@"
}
for r in $(seq 1 "$ROUNDS"); do
  for s in $SETTINGS; do
    IFS=: read -r name workers main wcpus <<<"$s"
    flag=(); [ "$workers" != - ] && flag=(--workers "$workers")
    wenv=(); [ "$wcpus" != - ] && wenv=(MULTIGPU_WORKER_CPUS="$wcpus")
    start=$SECONDS
    env "${wenv[@]}" timeout 150 bash -c "$(declare -f pin); PY=$PY; pin $main $PY -m multigpu train --model resnet50 \
      --data folder:$FOLDER --batch-size 128 --epochs $EPOCHS --precision bf16 --devices 1 --logger none \
      --checkpoint-every 0 --log-every 20 ${flag[*]} --out $OUT/train-$name-$r" > "$OUT/train-$name-$r.log" 2>&1
    echo "$name $r $? $((SECONDS - start))" >> "$OUT/runs.txt"
    rm -rf "$OUT/train-$name-$r"/checkpoints
  done
done
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
try:
    rows = {r["data"]: round(r["img_per_s"]) for r in json.loads((out / "bench.json").read_text())["rows"]}
except (OSError, KeyError, ValueError) as e:
    rows = {"error": str(e)}
print("bench img/s:", rows)
synthetic = rows.get("synthetic")
for line in (out / "runs.txt").read_text().splitlines():
    parts = line.split()
    if parts[0] == "bench":
        continue
    name, r, rc, wall = parts
    metrics = out / f"train-{name}-{r}" / "metrics.jsonl"
    epochs = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.exists() else []
    said = ", ".join(f"epoch {e['epoch']} {e['samples_per_second']:.0f} img/s"
                     + (f" ({e['samples_per_second'] / synthetic:.0%} of synthetic)" if synthetic else "")
                     + f" {e.get('input_wait', 0):.0%} waiting" for e in epochs)
    print(f"{name} round {r} (exit {rc}, {wall} s): {said}")
PY
