#!/usr/bin/env bash
# Why whole `multigpu train` epochs on real JPEGs run slower than `multigpu bench`'s real-data
# trials on the same folder and GPUs (4x H100: 9 400 img/s against 12 665, while the runs waited
# for data only 7 % of the time). One invocation: the bench's synthetic, real-cpu and real-gpu
# rows, then 2-epoch `multigpu train` runs in turns (the loader workers decoding with the default
# number of workers and with FEWER; the GPU decoding), each profiling 20 steps of its second epoch
# (MULTIGPU_PROFILE_STEPS: the step's time split into GPU busy, GPU idle and waiting for data).
#   OUT=/tmp/evb DEVICES=0,1,2,3 bash benchmarks/epochs_vs_bench.sh
# The folder is the bench's generated one (made on the first run, cached under ~/.cache/multigpu).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:?set OUT}; PY=${PY:-python3}; DEVICES=${DEVICES:-0,1,2,3}; ROUNDS=${ROUNDS:-1}
FEWER=${FEWER:-10}; DATA=${DATA:-synthetic,real-cpu,real-gpu}; WINDOW=${WINDOW:-300-319}
GPUS=$(tr , '\n' <<<"$DEVICES" | grep -c .)  # the ids named: "0," is GPU 0 alone
mkdir -p "$OUT"
"$PY" -m multigpu bench --model resnet50 --gpus "$GPUS" --devices "$DEVICES" --methods multigpu-ddp \
  --data "$DATA" --images detailed --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
FOLDER=$(ls -d "${XDG_CACHE_HOME:-$HOME/.cache}"/multigpu/bench-images/jpeg-detailed-* | tail -1)
for r in $(seq 1 "$ROUNDS"); do
  for run in cpu "cpu-$FEWER" gpu; do
    flag=(--decode "${run%%-*}"); [ "$run" = "cpu-$FEWER" ] && flag+=(--workers "$FEWER")
    MULTIGPU_PROFILE_STEPS=$WINDOW "$PY" -m multigpu train --model resnet50 --data "folder:$FOLDER" \
      --batch-size 128 --epochs 2 --precision bf16 --devices "$DEVICES" --logger none \
      --checkpoint-every 0 "${flag[@]}" --out "$OUT/train-$run-$r" > "$OUT/train-$run-$r.log" 2>&1
    echo "$run $r $?" >> "$OUT/runs.txt"
    rm -f "$OUT/train-$run-$r"/checkpoints/*/*.pt "$OUT/train-$run-$r"/profile/trace-*.json
  done
done
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {r["data"]: round(r["img_per_s"]) for r in json.loads((out / "bench.json").read_text())["rows"]}
print("bench img/s:", rows)
for line in (out / "runs.txt").read_text().splitlines():
    run, r, rc = line.split()
    folder = out / f"train-{run}-{r}"
    metrics = folder / "metrics.jsonl"
    epochs = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.exists() else []
    said = ", ".join(f"epoch {e['epoch']} {e['samples_per_second']:.0f} img/s ({e['input_wait']:.0%} waiting)"
                     for e in epochs)
    print(f"train {run}, round {r} (exit {rc}): {said}")
    for p in sorted((folder / "profile").glob("rank*.json")):
        n = json.loads(p.read_text())
        print(f"  rank {n['rank']}: step {n['step_ms']:.1f} ms, GPU busy {n['gpu_busy_ms']:.1f} (training "
              f"stream {n['training_stream_ms']:.1f}, others {n['other_streams_ms']:.1f}, nccl exposed "
              f"{n['nccl_exposed_ms']:.1f}), idle {n['gpu_idle_ms']:.1f}, waiting {n['waiting_for_data_ms']:.1f}")
PY
