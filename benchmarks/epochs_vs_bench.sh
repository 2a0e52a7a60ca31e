#!/usr/bin/env bash
# Why whole `multigpu train` epochs on real JPEGs run slower than `multigpu bench`'s real-data
# trials on the same folder and GPUs (4x H100: 9 400 img/s against 12 665, while the runs waited
# for data only 7 % of the time). One invocation, in turns: the bench's synthetic and real-cpu
# rows, then 2-epoch `multigpu train` runs with the default loader workers and with fewer (a host
# CPU shared by 15 workers a GPU and the ranks' main processes is the first suspect), ROUNDS times.
#   OUT=/tmp/evb DEVICES=0,1,2,3 bash benchmarks/epochs_vs_bench.sh
# The folder is the bench's generated one (made on the first run, cached under ~/.cache/multigpu).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:?set OUT}; PY=${PY:-python3}; DEVICES=${DEVICES:-0,1,2,3}; ROUNDS=${ROUNDS:-2}
FEWER=${FEWER:-10}
GPUS=$(awk -F, '{print NF}' <<<"$DEVICES")
mkdir -p "$OUT"
"$PY" -m multigpu bench --model resnet50 --gpus "$GPUS" --devices "$DEVICES" --methods multigpu-ddp \
  --data synthetic,real-cpu --images detailed --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
FOLDER=$(ls -d "${XDG_CACHE_HOME:-$HOME/.cache}"/multigpu/bench-images/jpeg-detailed-* | tail -1)
for r in $(seq 1 "$ROUNDS"); do
  for workers in default "$FEWER"; do
    flag=(); [ "$workers" = default ] || flag=(--workers "$workers")
    "$PY" -m multigpu train --model resnet50 --data "folder:$FOLDER" --batch-size 128 --epochs 2 \
      --precision bf16 --devices "$DEVICES" --logger none --checkpoint-every 0 --decode cpu "${flag[@]}" \
      --out "$OUT/train-$workers-$r" > "$OUT/train-$workers-$r.log" 2>&1
    echo "$workers $r $?" >> "$OUT/runs.txt"
  done
done
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {r["data"]: round(r["img_per_s"]) for r in json.loads((out / "bench.json").read_text())["rows"]}
print("bench img/s:", rows)
for line in (out / "runs.txt").read_text().splitlines():
    workers, r, rc = line.split()
    metrics = out / f"train-{workers}-{r}" / "metrics.jsonl"
    epochs = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.exists() else []
    said = ", ".join(f"epoch {e['epoch']} {e['samples_per_second']:.0f} img/s ({e['input_wait']:.0%} waiting)"
                     for e in epochs)
    print(f"train, workers {workers}, round {r} (exit {rc}): {said}")
PY
