#!/usr/bin/env bash
# The whole GPU check in one command, for a machine with N GPUs (written for the 4x H200 machines;
# GPUS=N uses the first N, default all that nvidia-smi lists):
#
#     OUT=/some/empty/dir bash benchmarks/run_gpu_check.sh
#
# Stages, in order of importance; each is time-boxed with `timeout`, and all of them share one
# budget (BUDGET seconds, default 530 s), so a hang costs at most its own box and a slow stage
# only shortens the ones after it. The whole list takes more than one 10-minute device call: name
# the stages to run as arguments, e.g. `bash run_gpu_check.sh facts pytest-gpu bench-main`.
#   0 facts       nvidia-smi, topology, versions                          (box  30 s)
#   1 pytest-gpu  python -m pytest -m gpu tests/gpu                       (box 240 s)
#   2 bench-main  resnet50 bf16 batch 128, 1/2/4../N GPUs, every method   (box 210 s)
#   3 bench-batch resnet50 batch 32/64/128/256, N GPUs, multigpu-ddp vs every peer (box 400 s)
#   4 bench-real  resnet50 batch 128, 1 and N GPUs, synthetic and a JPEG folder, one invocation (box 120 s)
#   5 knobs       DDP knobs on N GPUs, interleaved with the default and the peers (box 300 s)
#   6 profile     kernel timelines of 1 and N GPUs (benchmarks/profile_step.py) (box 90 s)
#   7 bench-compile resnet50 batch 32/128, --compile reduce-overhead vs ddp, 1 and N GPUs (box 300 s)
#   8 dp-profile  one profiled DataParallel step on N GPUs                 (box  60 s)
#   9 bench-models swin_t and vgg16, multigpu-ddp on 1 and N GPUs         (box  90 s)
#  10 image-transforms JPEG decode + crops per CPU thread, PIL vs torchvision (box 150 s)
#  11 cli-startup `multigpu --help` and friends, cold and warm (benchmarks/cli_startup.py) (box 90 s)
#  12 decode-alone the JPEG pipeline without a model, workers / GPU / hybrid (decode_pipeline.py) (box 120 s)
#  13 time-to-train whole 3-epoch ResNet-50 jobs on N GPUs: multigpu against Lightning, Accelerate,
#                 pytorch/examples (benchmarks/time_to_train.sh)                    (box 420 s)
#  14 post002     post 002's LSTM, multigpu against hand-written DDP, 1 and N GPUs  (box 240 s)
#  15 bench-fsdp  resnet50 and swin_t, multigpu-ddp against multigpu-fsdp on N GPUs (box 150 s)
#  16 startup     command -> first step of multigpu train beside a bare torchrun script, N GPUs,
#                 3 trials in turns (benchmarks/startup_phases.py)                  (box 240 s)
#  17 decode-auto --decode auto against cpu and gpu in turns, detailed JPEGs, an epoch long enough
#                 for auto's timing (benchmarks/decode_auto.sh)                      (box 580 s)
#  18 auto-public pytorch/examples' ImageNet main.py, unmodified, under --auto on 1, 2, N GPUs
#                 and its data loading alone (needs .public carried; auto_public_compare.sh) (box 500 s)
# Everything lands in $OUT: <stage>.log for each stage, summary.txt, pytest-gpu.xml, and
# bench-*.json / bench-*.png / bench-*-logs/ (per-rank logs of every launch).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-benchmarks/results/gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python3}"
BUDGET="${BUDGET:-530}"
IMAGES="${IMAGES:-/tmp/multigpu-bench-images}"  # generated JPEGs: big, kept out of $OUT

# Rules of these machines: NVLink SHARP / multicast off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # no install needed
export MPLBACKEND=Agg PYTHONUNBUFFERED=1
START=$SECONDS
ONLY=("$@")  # stage names to run (default: all), e.g. `bash run_gpu_check.sh facts pytest-gpu`
N="${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}"
if (( N < 1 )); then
    echo "run_gpu_check.sh: no GPU found (nvidia-smi -L lists none); set GPUS=N to say how many" >&2
    exit 2
fi
DEVICES=$(seq -s, 0 $(( N - 1 )))  # 0,1,..,N-1
SCALE=1; for (( g = 2; g < N; g *= 2 )); do SCALE+=",$g"; done
(( N > 1 )) && SCALE+=",$N"  # 1,2,4,..,N: the GPU counts of the scaling stages

# stage NAME BOX_SECONDS COMMAND...: run COMMAND for at most min(BOX, budget left) seconds.
stage() {
    local name=$1 box=$2
    shift 2
    if (( ${#ONLY[@]} )) && [[ " ${ONLY[*]} " != *" $name "* ]]; then
        return
    fi
    local left=$(( BUDGET - (SECONDS - START) ))
    local limit=$(( box < left ? box : left ))
    if (( limit < 20 )); then
        echo "== $name: skipped, only $left s of the $BUDGET s budget left" | tee -a "$OUT/summary.txt"
        return
    fi
    echo "== $name (at most $limit s): $*" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS
    # SIGTERM first: multigpu bench then stops its workers and still writes its JSON. SIG=INT for
    # pytest: its fixtures then stop what the test started (a SIGTERM leaves a run on a GPU).
    timeout -s "${SIG:-TERM}" -k 15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local note=""
    (( rc == 124 || rc == 137 )) && note=" (time limit)"
    echo "== $name: exit $rc$note after $(( SECONDS - t0 )) s" | tee -a "$OUT/summary.txt"
}

facts() {
    nvidia-smi
    nvidia-smi topo -m
    # NUMA: which CPUs sit near which GPU (a rank far from its GPU pays on every launch and copy)
    lscpu | grep -iE "^(model name|socket|numa|cpu\(s\)|thread)" || true
    for d in /sys/bus/pci/drivers/nvidia/0000:*; do
        [[ -e $d/numa_node ]] && echo "GPU $(basename "$d"): numa_node $(cat "$d/numa_node")"
    done
    command -v numactl >/dev/null && numactl -H || echo "numactl: not installed"
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
    "$PY" -m pip list 2>/dev/null | grep -iE "^(torch|accelerate|lightning|matplotlib|rich|numpy|pillow) " || true
}

export PY
export -f facts
# GPUs named, not "auto": a process left over from an earlier stage must not shrink the plan
# (nvidia-smi in facts.log and memory_before_gib in the JSON show what else was there).
BENCH=("$PY" -m multigpu bench --precision bf16 --devices "$DEVICES" --min-free-memory 0)

stage facts 30 bash -c facts
# GPU_TESTS: which tests (pytest node ids or files, space-separated; default the whole tier, which
# takes about 15 minutes on 2 GPUs: more than one device call).
read -r -a GPU_TESTS <<< "${GPU_TESTS:-tests/gpu}"
SIG=INT stage pytest-gpu "${PYTEST_BOX:-240}" "$PY" -m pytest -m gpu -o addopts="" "${GPU_TESTS[@]}" -v \
    -p no:cacheprovider -k "not exceeds_the_gpu" --durations 0 --junitxml="$OUT/pytest-gpu.xml"
# DataParallel: 5 warm-up steps (cuDNN tunes on the first) + 3 trials x 5 steps.
stage bench-main 210 "${BENCH[@]}" --model resnet50 --batch-size 128 --gpus "$SCALE" \
    --steps 30 --warmup 10 --trials 3 --dp-steps 5 --out "$OUT/bench-main.json"
# The README's command: every peer and torch's buffer default (bcast), 6 interleaved trials.
stage bench-batch 400 "${BENCH[@]}" --model resnet50 --batch-size 32,64,128,256 --gpus "$N" \
    --methods multigpu-single,multigpu-ddp,multigpu-ddp:bcast,ddp,accelerate,fabric --steps 25 --warmup 8 --trials 6 \
    --out "$OUT/bench-batch.json"
stage bench-real 120 "${BENCH[@]}" --model resnet50 --batch-size 128 --gpus "1,$N" \
    --data synthetic,real --methods multigpu-single,multigpu-ddp --steps 15 --warmup 5 --trials 3 \
    --data-dir "$IMAGES" --out "$OUT/bench-real.json"
# A/B of DDP knobs on N GPUs: each knob is a method of its own (multigpu-ddp:VARIANT, see
# bench/spec.py), timed in turns with the default and the peers in one launch, so the machine's
# drift hits all alike; per-trial GPU clocks are in the JSON (trial_gpu).
stage knobs 300 "${BENCH[@]}" --model resnet50 --batch-size 128 --gpus "$N" \
    --methods multigpu-single,multigpu-ddp,multigpu-ddp:static,multigpu-ddp:bf16hook,\
multigpu-ddp:bucket25,multigpu-ddp:bucket200,multigpu-ddp:ctas8,multigpu-ddp:bucket25-ctas8,\
ddp,accelerate,fabric --steps 30 --warmup 10 --trials 8 --out "$OUT/bench-knobs.json"
# Where a DDP step loses time: kernel timelines of 1 GPU and of N (benchmarks/profile_step.py).
stage profile 90 bash -c "'$PY' -m torch.distributed.run --standalone --nproc_per_node 1 \
    benchmarks/profile_step.py --out '$OUT/profile' && '$PY' -m torch.distributed.run \
    --standalone --nproc_per_node $N benchmarks/profile_step.py --out '$OUT/profile'"
# Small batches are host-bound: CUDA graphs (--compile reduce-overhead) against hand-written DDP
# (eager) in the same sets; compiling and recording takes 30-40 s per batch size and GPU count.
stage bench-compile 300 "${BENCH[@]}" --model resnet50 --batch-size 32,128 --gpus "1,$N" \
    --compile reduce-overhead --methods multigpu-single,multigpu-ddp,ddp --steps 25 --warmup 8 \
    --trials 4 --out "$OUT/bench-compile.json"
# Why DataParallel is slow: one profiled step over N GPUs.
stage dp-profile 60 "$PY" benchmarks/profile_step.py --dp "$N" --out "$OUT/dp-profile"
stage bench-models 90 "${BENCH[@]}" --model swin_t,vgg16 --batch-size 128 --gpus "1,$N" \
    --methods multigpu-single,multigpu-ddp --steps 15 --warmup 5 --trials 3 \
    --out "$OUT/bench-models.json"
# CPU-side stages: what a DataLoader worker does per JPEG, and how fast the CLI answers.
stage image-transforms 150 "$PY" benchmarks/image_transforms.py --out "$OUT/image-transforms"
stage cli-startup 90 "$PY" benchmarks/cli_startup.py --runs 9 --json "$OUT/cli-startup.json"
# Real data and whole jobs (issue 15). One folder of 25 600 generated JPEGs for all of them; run
# folders (checkpoints: many files) under /tmp, logs and summaries in $OUT.
FOLDER="${FOLDER:-/tmp/multigpu-jpeg25k}"
RUNS_ROOT=$(mktemp -d /tmp/multigpu-runs.XXXXXX)  # new each invocation: --out must not exist
COUNTS=1; (( N > 1 )) && COUNTS+=" $N"
make_folder() {
    [[ -d $FOLDER ]] || { "$PY" benchmarks/decode_pipeline.py --make "$FOLDER.part" --train 25600 \
        && mv "$FOLDER.part" "$FOLDER"; }
}
export FOLDER
export -f make_folder
stage decode-alone 120 bash -c "make_folder && '$PY' benchmarks/decode_pipeline.py --folder '$FOLDER' \
    --modes cpu,gpu,hybrid-0.47 --out '$OUT/decode-alone.json'"
stage time-to-train 420 bash -c "make_folder && OUT='$OUT/time-to-train' RUNS='$RUNS_ROOT/ttt' \
    GPUS=$N bash benchmarks/time_to_train.sh"
stage post002 240 env OUT="$OUT/post002" RUNS="$RUNS_ROOT/post002" COUNTS="$COUNTS" \
    bash benchmarks/post002_compare.sh
stage bench-fsdp 150 "${BENCH[@]}" --model resnet50,swin_t --batch-size 128 --gpus "$N" \
    --methods multigpu-ddp,multigpu-fsdp --steps 20 --warmup 5 --trials 3 --out "$OUT/bench-fsdp.json"
stage startup 240 "$PY" benchmarks/startup_phases.py --gpus "$N" --trials 3 --head-start on --bare \
    --out "$OUT/startup"
# auto times each way in its first epoch: 409 600 images give 4 GPUs at batch 128 the steps it needs
stage decode-auto 580 env OUT="$OUT/decode-auto" FOLDER="/tmp/multigpu-detailed" DEVICES="$DEVICES" \
    KIND=detailed COUNT="${DECODE_AUTO_COUNT:-409600}" EPOCHS=2 ROUNDS=1 bash benchmarks/decode_auto.sh
stage auto-public 500 env OUT="$OUT/auto-public" GPUS="${SCALE#1,}" bash benchmarks/auto_public_compare.sh

# Clocks after the runs (BASELINE.md saw 1980 MHz, the maximum, on every GPU).
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv 2>&1 | tee "$OUT/clocks-after.csv"
echo "== total $(( SECONDS - START )) s; results in $OUT" | tee -a "$OUT/summary.txt"
