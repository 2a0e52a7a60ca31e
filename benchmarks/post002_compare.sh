#!/usr/bin/env bash
# Post 002's small model: `multigpu train --model lstm` against the hand-written DDP script of
# the post's recipe (benchmarks/post002_ddp.py), same windows, model, batch and optimizer, on 1 and
# N devices, the two taking turns. Whole-job wall time and per-epoch training seconds go to
# $OUT/post002.json.   OUT=/tmp/p2 [RUNS=/tmp/p2-runs] [DEVICES=cpu] [COUNTS="1 2"] bash benchmarks/post002_compare.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:?set OUT}; PY=${PY:-python3}; DEVICES=${DEVICES:-gpu}; COUNTS=${COUNTS:-1 2}
EPOCHS=${EPOCHS:-5}; BATCH=${BATCH:-64}; ROWS=${ROWS:-40000}
RUNS=${RUNS:-$OUT}  # multigpu's run folders (checkpoints: many files); the logs stay in $OUT
mkdir -p "$OUT" "$RUNS"; : > "$OUT/walls.txt"
CSV=$OUT/series.csv
"$PY" benchmarks/post002_series.py "$CSV" "$ROWS"
timed() {  # timed NAME command...
  local name=$1; shift; local start; start=$("$PY" -c "import time; print(time.time())")
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name $rc $("$PY" -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 2))" "$start")" >> "$OUT/walls.txt"
}
for n in $COUNTS; do
  dev=$([ "$DEVICES" = cpu ] && echo "cpu:$n" || echo "$n")
  for turn in 1 2; do
    timed "hand-x$n-$turn" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$n" \
        benchmarks/post002_ddp.py --csv "$CSV" --seq-length 40 --epochs "$EPOCHS" --batch-size "$BATCH" \
        --out "$OUT/hand-x$n-$turn.json"
    timed "multigpu-x$n-$turn" "$PY" -m multigpu train --model lstm --data "timeseries:$CSV" \
        --seq-length 40 --epochs "$EPOCHS" --batch-size "$BATCH" --optimizer adam --lr 1e-3 \
        --devices "$dev" --logger none --checkpoint-every 0 --out "$RUNS/multigpu-x$n-$turn"
  done
done
"$PY" - "$OUT" "$RUNS" <<'PY'
import json, sys, pathlib, statistics, torch
out, runs_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
runs = {}
for line in (out / "walls.txt").read_text().splitlines():
    name, rc, wall = line.split()
    epochs = []
    if rc == "0" and name.startswith("hand"):
        epochs = [e["train_s"] for e in json.loads((out / f"{name}.json").read_text())["epochs"]]
    elif rc == "0":
        epochs = [json.loads(l)["epoch_seconds"] for l in (runs_dir / name / "metrics.jsonl").read_text().splitlines()]
    runs[name] = {"rc": int(rc), "wall_s": float(wall), "train_s_per_epoch": [round(e, 3) for e in epochs],
                  "median_epoch_after_first": round(statistics.median(epochs[1:]), 3) if len(epochs) > 1 else None}
result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
          "runs": runs}
(out / "post002.json").write_text(json.dumps(result, indent=1) + "\n")
for name, r in runs.items():
    print(f"{name:16s} rc {r['rc']} wall {r['wall_s']:7.1f} s  epoch (median after the first) {r['median_epoch_after_first']} s")
PY
