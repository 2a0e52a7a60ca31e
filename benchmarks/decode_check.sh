#!/usr/bin/env bash
# GPU JPEG decoding on one GPU (issue 15, item 1): its GPU tests, the input pipeline alone per
# decode mode, and ResNet-50 steps on synthetic data, on the folder decoded on the GPU and by the
# CPU workers, in one `multigpu bench` invocation. Logs and JSON under $OUT.
#   OUT=/tmp/dc bash benchmarks/decode_check.sh [eager|graphs|few-cores|gil|all]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:?set OUT}
WHAT=${1:-all}
PY=${PY:-python3}
FOLDER=${FOLDER:-/tmp/jpeg500}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
"$PY" -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)" > "$OUT/versions.txt" 2>&1
[ -d "$FOLDER" ] || "$PY" benchmarks/decode_pipeline.py --make "$FOLDER" --train 12800 > "$OUT/make.log" 2>&1
if [ "$WHAT" = all ] || [ "$WHAT" = eager ]; then
  "$PY" -m pytest -m gpu -o addopts="" -q -p no:cacheprovider tests/gpu/test_decode_gpu.py -s \
      > "$OUT/test_decode_gpu.log" 2>&1; echo "tests: $?" >> "$OUT/status.txt"
  "$PY" benchmarks/decode_pipeline.py --folder "$FOLDER" --out "$OUT/pipeline.json" \
      > "$OUT/pipeline.log" 2>&1; echo "pipeline: $?" >> "$OUT/status.txt"
  "$PY" -m multigpu bench --model resnet50 --batch-size 128 --gpus 1 --methods multigpu-single \
      --data "synthetic,folder:$FOLDER,real-cpu,real-gpu" --steps 40 --trials 3 --out "$OUT/bench-eager" \
      > "$OUT/bench-eager.log" 2>&1; echo "bench eager: $?" >> "$OUT/status.txt"
fi
if [ "$WHAT" = all ] || [ "$WHAT" = graphs ]; then
  "$PY" -m multigpu bench --model resnet50 --batch-size 128 --gpus 1 --methods multigpu-single \
      --data "synthetic,folder:$FOLDER,real-cpu,real-gpu" --steps 40 --trials 3 --compile reduce-overhead \
      --out "$OUT/bench-graphs" > "$OUT/bench-graphs.log" 2>&1; echo "bench graphs: $?" >> "$OUT/status.txt"
fi
if [ "$WHAT" = all ] || [ "$WHAT" = few-cores ]; then  # 4 cores for one GPU: 3 workers
  for mode in "" "--compile reduce-overhead"; do
    name=bench-4cores${mode:+-graphs}
    taskset -c 0-3 "$PY" -m multigpu bench --model resnet50 --batch-size 128 --gpus 1 \
        --methods multigpu-single --data "synthetic,folder:$FOLDER,real-cpu,real-gpu" --steps 30 \
        --trials 3 $mode --out "$OUT/$name" > "$OUT/$name.log" 2>&1; echo "$name: $?" >> "$OUT/status.txt"
  done
fi
if [ "$WHAT" = all ] || [ "$WHAT" = gil ]; then  # CUDA graphs, 16 cores: the GIL's share
  for interval in "" 0.0005; do
    name=bench-graphs-switch${interval:-default}
    BENCH_SWITCH_INTERVAL=$interval BENCH_SWITCH_MARK=$OUT/$name.mark PYTHONPATH=$PWD/benchmarks/gil:$PYTHONPATH \
      "$PY" -m multigpu bench --model resnet50 --batch-size 128 --gpus 1 --methods multigpu-single \
        --data "synthetic,folder:$FOLDER,real-gpu" --steps 30 \
        --trials 3 --compile reduce-overhead --out "$OUT/$name" > "$OUT/$name.log" 2>&1
    echo "$name: $?" >> "$OUT/status.txt"
  done
fi
cat "$OUT/status.txt"
