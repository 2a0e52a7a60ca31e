#!/usr/bin/env bash
# Issue 30's ImageNet shortfall, its causes side by side in one device command: pytorch/examples'
# ImageNet main.py (unmodified, in .public/: carry it) on 1, 2 and 4 GPUs under --auto, in its own
# DDP mode, with --auto-batch per-gpu, and its data loading alone, in turns
# (benchmarks/auto_public_scripts.py --compare; auto_public_report.py says how to read it).
# Work folder $WORK (default /tmp/apub: its ImageFolder is reused by a later call on the same
# machine); results.txt, results.json and the logs (no checkpoints) go to $OUT.
#   bash benchmarks/auto_public_compare.sh                         (resnet18, -j 10: about 6-7 min)
#   ARCH=resnet50 WORKERS=14 bash benchmarks/auto_public_compare.sh (about 7 min)
# Further arguments go to auto_public_scripts.py (e.g. --devices-kind cpu --gpus 2: a CPU smoke).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:?set OUT}; PY=${PY:-python3}; WORK=${WORK:-/tmp/apub}
ARCH=${ARCH:-resnet18}; WORKERS=${WORKERS:-10}; GPUS=${GPUS:-2,4}
"$PY" benchmarks/auto_public_scripts.py --compare --gpus "$GPUS" --imagenet-arch "$ARCH" \
  --imagenet-workers "$WORKERS" --out "$WORK" "$@"
rc=$?
[ "$rc" -eq 0 ] || exit "$rc"  # then $WORK/results.* are an earlier call's, if any
call=$(cd "$WORK" && ls -d call-* | sort -t- -k2 -n | tail -1)
mkdir -p "$OUT" && cp "$WORK/results.txt" "$WORK/results.json" "$OUT/"
tar czf "$OUT/logs-$call.tgz" --exclude='*.pth.tar' -C "$WORK" "$call"
