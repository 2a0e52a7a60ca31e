#!/usr/bin/env bash
# What the sweep's shared compile cache saves: 3 runs of one compiled model, one after another on
# one GPU, with the cache (a fresh DIR/compile-cache: the first run compiles, the others read it)
# and with every inductor cache off (each run compiles from scratch). Then the same in the other
# order, so that a machine warming up favours neither. Durations come from each summary.csv.
#   OUT=/tmp/cc bash benchmarks/sweep_compile_cache.sh
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:?set OUT}
PY=${PY:-python3}
mkdir -p "$OUT"
CMD=(multigpu train --model resnet18 --data synthetic:2048 --image-size 64 --epochs 1
     --batch-size 128 --compile --precision bf16 --logger none)
run() {  # run NAME [ENV=VALUE ...]
  local name=$1; shift
  env "$@" "$PY" -m multigpu sweep \
      --grid seed=1,2,3 --devices-per-run 1 --max-parallel 1 --out "$OUT/$name" -- "${CMD[@]}" \
      > "$OUT/$name.log" 2>&1
  echo "$name: $(python3 - "$OUT/$name/summary.csv" <<'PY'
import csv, sys
rows = sorted(csv.DictReader(open(sys.argv[1])), key=lambda r: r["seed"])
print(", ".join(f"seed {r['seed']} {float(r['duration_s']):.1f} s ({r['status']})" for r in rows))
PY
)"
}
run cache-1
run nocache-1 TORCHINDUCTOR_FORCE_DISABLE_CACHES=1
run nocache-2 TORCHINDUCTOR_FORCE_DISABLE_CACHES=1
run cache-2
