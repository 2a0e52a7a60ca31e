#!/usr/bin/env bash
# Time to train (issue 15, item 2): whole jobs on one JPEG folder, `multigpu train` (eager and
# --compile auto) against the scripts users would write instead (benchmarks/peers/: a Lightning
# Trainer, an Accelerate loop, pytorch/examples' ImageNet recipe), each from its command to its
# exit, one after another. Same model (ResNet-50), batch per GPU, epochs and workers per GPU.
#   OUT=/tmp/ttt FOLDER=/data/jpegs GPUS=2 [EPOCHS=3] [RUNS=/tmp/ttt-runs] bash benchmarks/time_to_train.sh
# RUNS: where multigpu's run folders go (checkpoints, many files; default $OUT); logs stay in $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:?set OUT}; FOLDER=${FOLDER:?set FOLDER}; GPUS=${GPUS:-1}; EPOCHS=${EPOCHS:-3}
PY=${PY:-python3}; BATCH=${BATCH:-128}
WORKERS=${WORKERS:-$(( $(nproc) / GPUS - 1 ))}
RUNS=${RUNS:-$OUT}
mkdir -p "$OUT" "$RUNS"; : > "$OUT/walls.txt"
timed() {  # timed NAME command...
  local name=$1; shift; local start; start=$("$PY" -c "import time; print(time.time())")
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "$name $rc $("$PY" -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 1))" "$start")" >> "$OUT/walls.txt"
}
PEER=(--epochs "$EPOCHS" --batch-size "$BATCH" --workers "$WORKERS")
RUN=(-m torch.distributed.run --standalone --nproc_per_node "$GPUS")
OURS=(-m multigpu train --model resnet50 --data "folder:$FOLDER" --epochs "$EPOCHS" --batch-size "$BATCH"
      --optimizer sgd --lr 0.1 --precision bf16 --devices "$GPUS" --workers "$WORKERS" --logger none)
timed multigpu "$PY" "${OURS[@]}" --out "$RUNS/multigpu"
timed multigpu-compile-auto "$PY" "${OURS[@]}" --compile auto --out "$RUNS/multigpu-compile-auto"
timed lightning "$PY" benchmarks/peers/lightning_imagefolder.py "$FOLDER" "${PEER[@]}" --gpus "$GPUS"
timed accelerate "$PY" "${RUN[@]}" benchmarks/peers/accelerate_imagefolder.py "$FOLDER" "${PEER[@]}"
timed pytorch-examples "$PY" "${RUN[@]}" benchmarks/peers/examples_imagenet.py "$FOLDER" "${PEER[@]}"
"$PY" - "$OUT" "$RUNS" <<'PY'
import json, pathlib, sys
out, runs_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rows = {}
for line in (out / "walls.txt").read_text().splitlines():
    name, rc, wall = line.split()
    row = {"rc": int(rc), "wall_s": float(wall)}
    log = (out / f"{name}.log").read_text().splitlines()
    results = [l for l in log if l.startswith("RESULT ")]
    said = [l for l in log if l.startswith("time: ")]  # multigpu's own account of the job
    if said:
        row["timeline"] = said[-1]
    if results:
        row |= json.loads(results[-1][len("RESULT "):])
    elif row["rc"] == 0 and (runs_dir / name / "metrics.jsonl").exists():
        lines = (runs_dir / name / "metrics.jsonl").read_text().splitlines()
        epochs = [json.loads(l) for l in lines if l.strip().endswith("}")]  # not a cut-off last line
        row |= {"epoch_s": [round(e["epoch_seconds"], 2) for e in epochs],
                "val_accuracy": epochs[-1].get("val_accuracy") if epochs else None}
    rows[name] = row
(out / "time-to-train.json").write_text(json.dumps(rows, indent=1) + "\n")
for name, r in rows.items():
    print(f"{name:22s} rc {r['rc']} whole {r['wall_s']:7.1f} s  epochs {r.get('epoch_s')}  val_acc {r.get('val_accuracy')}")
    if "timeline" in r:
        print(f"{'':22s} {r['timeline']}")
PY
