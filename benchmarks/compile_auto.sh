#!/usr/bin/env bash
# What CUDA graphs cost and save in `multigpu train`, for --compile auto's rule (compiling.py):
# ResNet-50 bf16 batch 128, synthetic data, 2 epochs of 30 steps, on one GPU: eager; then
# --compile reduce-overhead with an empty per-user compile cache (cold), and again (warm).
# Each run's wall time and epoch seconds (metrics.jsonl) go to $OUT/compile-auto.json.
#   OUT=/tmp/ca bash benchmarks/compile_auto.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:?set OUT}
PY=${PY:-python3}
export XDG_CACHE_HOME=$OUT/cache   # the per-user cache of compiling.use_persistent_cache, empty
unset TORCHINDUCTOR_CACHE_DIR
mkdir -p "$OUT"
CMD=(-m multigpu train --model resnet50 --data synthetic:3840 --batch-size 128 --epochs 2
     --precision bf16 --devices 1 --logger none --checkpoint-every 0)
run() {  # run NAME [flags]
  local name=$1; shift
  local start=$(date +%s.%N)
  "$PY" "${CMD[@]}" --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name $rc $("$PY" -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 1))" "$start")" >> "$OUT/walls.txt"
}
run eager
run graphs-cold --compile reduce-overhead
run graphs-warm --compile reduce-overhead
run auto --compile auto
du -sh "$OUT/cache/multigpu/torch-compile" > "$OUT/cache-size.txt" 2>&1
"$PY" - "$OUT" <<'PY'
import json, sys, pathlib, torch
out = pathlib.Path(sys.argv[1])
result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "runs": {}}
for line in (out / "walls.txt").read_text().splitlines():
    name, rc, wall = line.split()
    epochs = [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines()] if rc == "0" else []
    result["runs"][name] = {"rc": int(rc), "wall_s": round(float(wall), 1),
                            "epoch_seconds": [round(e["epoch_seconds"], 2) for e in epochs],
                            "samples_per_second": [round(e["samples_per_second"]) for e in epochs]}
(out / "compile-auto.json").write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
PY
grep -h "compile auto" "$OUT/auto.log"
