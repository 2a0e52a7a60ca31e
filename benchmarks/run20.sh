#!/usr/bin/env bash
# Run 20 (2x H200), one device call; logs in $OUT (at most 8 files come back):
#   P  post 002 on 2 GPUs, step by step (post002_steps.sh): hand-written DDP, multigpu (auto: fp32
#      for lstm and tst since run 20), multigpu --precision bf16, and the small transformer (tst)
#      both ways, in turns                                                               -> steps.log
#   R  ResNet-50 batch 128 on 2 GPUs, synthetic against the JPEG folder in one invocation, eager
#      and with CUDA graphs (--compile reduce-overhead)                                 -> bench-*.log
#   F  one GPU's step at batch 128 and 256, kernel by kernel (profile_step.py)          -> profile.log
#   C  post 002 whole jobs, 1 and 2 GPUs, hand-written DDP against multigpu's defaults
#      (post002_compare.sh)                                                              -> post002.log
#   B  the README's batch sweep on 2 GPUs (multigpu and every peer, batch 32-256), 3 trials,
#      against earlier runs' figures: no regression                                     -> bench-batch.log
#   G  one GPU, batch 128 and 256, CUDA graphs (--compile reduce-overhead): the best batch -> bench-one.log
# JSON, PNG and profile summaries go into $OUT/kept.tgz.
#   OUT=/tmp/r bash benchmarks/run20.sh [P R F C B G]   (default P R F)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src MPLBACKEND=Agg PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}; PY=${PY:-python3}; FOLDER=${FOLDER:-/tmp/multigpu-jpeg25k}
PARTS=${*:-P R F}
KEEP=$(mktemp -d /tmp/run20.XXXXXX)  # JSON, PNG, profiles: one tarball in $OUT at the end
mkdir -p "$OUT"
if [[ " $PARTS " == *" P "* ]]; then
  OUT=$OUT TURNS=${P_TURNS:-2} PROFILE=0 WATCH=0 \
      VARIANTS="bf16=--precision bf16;tst=--model tst;tst-bf16=--model tst --precision bf16" \
      timeout 240 bash benchmarks/post002_steps.sh > /dev/null 2>&1
  echo "P rc $?" >> "$OUT/summary.txt"
fi
if [[ " $PARTS " == *" R "* ]]; then
  [[ -d $FOLDER ]] || { "$PY" benchmarks/decode_pipeline.py --make "$FOLDER.part" --train 25600 \
      > /dev/null 2>&1 && mv "$FOLDER.part" "$FOLDER"; }
  BENCH=("$PY" -m multigpu bench --model resnet50 --batch-size 128 --precision bf16 --devices 0,1
         --gpus 2 --min-free-memory 0 --methods multigpu-ddp --data "synthetic,folder:$FOLDER"
         --steps 30 --warmup 10 --trials 3)
  timeout -s TERM -k 15 120 "${BENCH[@]}" --out "$KEEP/bench-real-eager.json" > "$OUT/bench-eager.log" 2>&1
  echo "R eager rc $?" >> "$OUT/summary.txt"
  timeout -s TERM -k 15 200 "${BENCH[@]}" --compile reduce-overhead --out "$KEEP/bench-real-graphs.json" \
      > "$OUT/bench-graphs.log" 2>&1
  echo "R graphs rc $?" >> "$OUT/summary.txt"
fi
if [[ " $PARTS " == *" F "* ]]; then
  for b in 128 256; do
    timeout 90 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 benchmarks/profile_step.py \
        --batch "$b" --steps 6 --out "$KEEP/profile-b$b" >> "$OUT/profile.log" 2>&1
    echo "F b$b rc $?" >> "$OUT/summary.txt"
  done
fi
if [[ " $PARTS " == *" C "* ]]; then
  OUT=$KEEP/post002 timeout 200 bash benchmarks/post002_compare.sh > "$OUT/post002.log" 2>&1
  echo "C rc $?" >> "$OUT/summary.txt"
fi
ONE=("$PY" -m multigpu bench --model resnet50 --precision bf16 --min-free-memory 0)
if [[ " $PARTS " == *" B "* ]]; then
  timeout -s TERM -k 15 240 "${ONE[@]}" --devices 0,1 --gpus 2 --batch-size 32,64,128,256 \
      --methods multigpu-single,multigpu-ddp,ddp,accelerate,fabric --steps 20 --warmup 8 --trials 3 \
      --out "$KEEP/bench-batch.json" > "$OUT/bench-batch.log" 2>&1
  echo "B rc $?" >> "$OUT/summary.txt"
fi
if [[ " $PARTS " == *" G "* ]]; then
  timeout -s TERM -k 15 200 "${ONE[@]}" --devices 0, --gpus 1 --batch-size 128,256 --compile reduce-overhead \
      --methods multigpu-single --steps 25 --warmup 8 --trials 3 --out "$KEEP/bench-one.json" \
      > "$OUT/bench-one.log" 2>&1
  echo "G rc $?" >> "$OUT/summary.txt"
fi
tar -czf "$OUT/kept.tgz" -C "$KEEP" .
