#!/usr/bin/env bash
# Issue 28's target 2: --decode auto against the best fixed mode. In turns, ROUNDS times: the same
# `multigpu train` with --decode cpu, gpu and auto (ResNet-50 bf16, batch 128 per GPU, 3 epochs);
# each run's images/s of the epochs after the first (metrics.jsonl) and auto's pick and rates (decode.json) go to
# $OUT/decode-auto.json, with auto's median over the best fixed mode's and the runs' spread.
#   OUT=/tmp/da DEVICES=0,1,2,3 bash benchmarks/decode_auto.sh            (makes the folder once)
#   OUT=/tmp/da DEVICES=0 FOLDER=/data/jpegs ROUNDS=3 bash benchmarks/decode_auto.sh
# auto times the ways in the first epoch with room for its trial (decode_choice.Plan: 778 steps
# with 15 workers a GPU), so on 4 GPUs at batch 128 an epoch needs about 400 000 images:
#   OUT=/tmp/da DEVICES=0,1,2,3 KIND=detailed COUNT=409600 EPOCHS=2 bash benchmarks/decode_auto.sh
# (a generated folder of KIND: 8 192 distinct images, the rest links; made in seconds)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:?set OUT}; PY=${PY:-python3}; DEVICES=${DEVICES:-0}; ROUNDS=${ROUNDS:-3}
KIND=${KIND:-smooth}; COUNT=${COUNT:-25600}; EPOCHS=${EPOCHS:-3}
FOLDER=${FOLDER:-$OUT/jpegs}
mkdir -p "$OUT"
[ -d "$FOLDER/train" ] || "$PY" benchmarks/decode_pipeline.py --make "$FOLDER" --kind "$KIND" --train "$COUNT"
for r in $(seq 1 "$ROUNDS"); do
  for mode in cpu gpu auto; do
    "$PY" -m multigpu train --model resnet50 --data "folder:$FOLDER" --batch-size 128 --epochs "$EPOCHS" \
      --precision bf16 --devices "$DEVICES" --logger none --checkpoint-every 0 --decode "$mode" \
      --out "$OUT/$mode-$r" > "$OUT/$mode-$r.log" 2>&1
    echo "$mode $r $?" >> "$OUT/runs.txt"
  done
done
"$PY" - "$OUT" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
runs = {}
for line in (out / "runs.txt").read_text().splitlines():
    mode, r, rc = line.split()
    folder = out / f"{mode}-{r}"
    rates = [json.loads(l)["samples_per_second"] for l in (folder / "metrics.jsonl").read_text().splitlines()[1:]] if rc == "0" else []
    pick = json.loads((folder / "decode.json").read_text()) if (folder / "decode.json").exists() else None
    runs.setdefault(mode, []).append({"round": int(r), "rc": int(rc), "epochs_2_3": rates, "pick": pick})
median = {m: statistics.median(x for run in v for x in run["epochs_2_3"]) for m, v in runs.items()
          if any(run["epochs_2_3"] for run in v)}
spread = {m: (max(x) - min(x)) / statistics.median(x) for m, v in runs.items()
          if (x := [y for run in v for y in run["epochs_2_3"]])}
best = max((m for m in median if m != "auto"), key=median.get, default=None)
result = {"runs": runs, "median": median, "spread": spread, "best_fixed": best,
          "auto_over_best": median.get("auto", 0) / median[best] if best else None}
(out / "decode-auto.json").write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
PY
