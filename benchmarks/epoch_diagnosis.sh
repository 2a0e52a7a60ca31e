#!/usr/bin/env bash
# One device call: why whole real-JPEG epochs on one GPU run below the bench's synthetic step.
#   OUT=/tmp/ed bash benchmarks/epoch_diagnosis.sh
# 1. the machine's CPUs (lscpu: threads per core, which logical CPUs share a core);
# 2. `multigpu bench` synthetic and real-cpu rows (detailed JPEGs; makes the folder);
# 3. cpu_pipeline.py on detailed files: one worker's time per sample and batch, 15 workers' rate
#    with no model (the data's ceiling), and with ready-made samples (the loader's own ceiling);
# 4. epoch_threads.py: 2-epoch `multigpu train` runs in turns over SETTINGS, each with its step
#    profile and rank 0's threads' CPU and run-queue time in epoch 2.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}; PY=${PY:-python3}; ROUNDS=${ROUNDS:-2}
SETTINGS=${SETTINGS:-"default: omp1:OMP_NUM_THREADS=1 w10:--workers=10"}
mkdir -p "$OUT"
{ lscpu; lscpu -e; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv; "$PY" -c 'import torch, torchvision, PIL; print(torch.__version__, torchvision.__version__, PIL.__version__)'; } > "$OUT/machine.txt" 2>&1
timeout ${BENCH_TIMEOUT:-200} "$PY" -m multigpu bench --model resnet50 --gpus 1 --devices 1 --methods multigpu-single \
  --data synthetic,real-cpu --images detailed --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench exit $?"; grep -E "img/s|synthetic|real" "$OUT/bench.log" | tail -6
FOLDER=$(ls -d "${XDG_CACHE_HOME:-$HOME/.cache}"/multigpu/bench-images/jpeg-detailed-* | tail -1)
timeout ${PIPE_TIMEOUT:-100} "$PY" benchmarks/cpu_pipeline.py --kinds detailed --images 3840 --batch 128 \
  --workers 15 --rounds 1 --epochs 2 --out "$OUT/cpu_pipeline.json" > "$OUT/cpu_pipeline.log" 2>&1
echo "cpu_pipeline exit $?"
args=(); for s in $SETTINGS; do args+=(--setting "$s"); done
timeout ${TURNS_TIMEOUT:-290} "$PY" benchmarks/epoch_threads.py --folder "$FOLDER" --out "$OUT/turns" \
  --rounds "$ROUNDS" "${args[@]}" 2>&1 | tee "$OUT/turns.txt"
