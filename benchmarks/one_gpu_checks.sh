#!/usr/bin/env bash
# One-GPU checks of issue 44 (whole epochs against the bench, start-up, the input pipeline), stages
# in one device call (first used for round 3, 2026-12-02, as benchmarks/issue44_round3.sh):
#   OUT=/tmp/o bash benchmarks/one_gpu_checks.sh facts bench epochs imports startup cudnn
# facts: CPU topology and the GPU; bench: synthetic and real-cpu rows (it makes the JPEG folder;
# BENCH_ARGS for others);
# bigfolder: a folder of BIG_IMAGES for the epochs after it; epochs: whole epochs (on the bench's
# folder where no bigfolder ran, after the bench where that is missing) in settings that take turns (SETTINGS, epoch_threads.py; WINDOW= for no profile window); bench_ro: the
# bench's synthetic row with --compile reduce-overhead; pipeline: the folder's input pipeline alone
# in MODES (decode_pipeline.py; after a stage that ran the bench, which makes the folder); finish:
# finish_under_load.py's VARIANTS (PROFILE: some of them, commas, under torch.profiler); gpu_decode_tests:
# tests/gpu/test_decode_gpu.py; imports: -X importtime of a one-GPU
# `multigpu train` and of a bare one-process script; startup: startup_phases.py against the bare
# scripts; pyspy: both start-ups under py-spy (PYSPY), in time order (startup_timeline.py); cudnn: cudnn_autotune.py. Everything lands in $OUT/checks.tar.gz and $OUT/summary.txt.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src:$PWD${SITE:+:$SITE} PYTHONUNBUFFERED=1  # SITE: wheels installed with pip --target
OUT=${OUT:?set OUT}; PY=${PY:-python3}; W=/tmp/one_gpu_checks; mkdir -p "$W" "$OUT"
S="$OUT/summary.txt"
say() { echo "$@" | tee -a "$S"; }
facts() {
  { lscpu; echo; for c in /sys/devices/system/cpu/cpu[0-9]*; do echo "$(basename $c) siblings $(cat $c/topology/thread_siblings_list 2>/dev/null) core $(cat $c/topology/core_id 2>/dev/null)"; done
    nvidia-smi; nvidia-smi topo -m; "$PY" -c 'import torch, sys; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), sys.version)'
    date -u; } > "$W/machine.txt" 2>&1
  say "== facts"; grep -E "^(Model name|Thread|Core|Socket|NUMA|CPU\(s\))" "$W/machine.txt" | tee -a "$S"; grep siblings "$W/machine.txt" | head -16 | tr '\n' ';' | tee -a "$S"; echo | tee -a "$S"
}
run_bench() {  # NAME ARGS...: one-GPU ResNet-50 `multigpu bench` into $W/NAME.json, its rows to the summary
  local name=$1; shift
  timeout ${BENCH_TIMEOUT:-200} "$PY" -m multigpu bench --model resnet50 --gpus 1 --devices 1 --methods multigpu-single \
    "$@" --out "$W/$name.json" > "$W/$name.log" 2>&1; say "$name exit $?"
  grep -E "^bench:" "$W/$name.log" | tee -a "$S"
}
bench() {
  say "== bench"; run_bench bench ${BENCH_ARGS:---data synthetic,real-cpu --images detailed}
}
bigfolder() {  # BIG_IMAGES detailed training JPEGs (8 192 distinct, the rest links): epochs with room for auto's trial
  "$PY" -c "import sys; from multigpu.bench import imagegen; imagegen.write_folder(sys.argv[1], 'detailed', int(sys.argv[2]), 256)" \
    "$W/big" ${BIG_IMAGES:-102400}; say "bigfolder exit $? ($(ls "$W"/big/train/*/ | wc -l) entries)"; EPOCH_FOLDER=$W/big
}
epochs() {  # on EPOCH_FOLDER (bigfolder) or the bench's folder, the bench first where it has not made it yet
  [ -n "${EPOCH_FOLDER:-}" ] || ls -d "${XDG_CACHE_HOME:-$HOME/.cache}"/multigpu/bench-images/jpeg-detailed-* > /dev/null 2>&1 || bench
  FOLDER=${EPOCH_FOLDER:-$(ls -d "${XDG_CACHE_HOME:-$HOME/.cache}"/multigpu/bench-images/jpeg-detailed-* | tail -1)}
  say "== epochs ($FOLDER)"
  local args=(); IFS=';' read -ra sets <<< "${SETTINGS:-default:;place:--cpu-placement=auto}"
  for s in "${sets[@]}"; do args+=(--setting "$s"); done
  timeout ${TURNS_TIMEOUT:-200} "$PY" benchmarks/epoch_threads.py --folder "$FOLDER" --out "$W/turns" --rounds ${ROUNDS:-2} \
    --window "${WINDOW-300-319}" --timeout ${RUN_TIMEOUT:-150} \
    "${args[@]}" > "$W/turns.txt" 2>&1; say "epochs exit $?"; cat "$W/turns.txt" >> "$S"
  grep -h "kept" "$W"/turns/*.log >> "$S"
}
pipeline() {  # the folder's input pipeline alone, no model (decode_pipeline.py), in MODES that take turns
  FOLDER=$(ls -d "${XDG_CACHE_HOME:-$HOME/.cache}"/multigpu/bench-images/jpeg-detailed-* | tail -1)
  say "== pipeline ($FOLDER)"
  timeout ${PIPELINE_TIMEOUT:-200} "$PY" benchmarks/decode_pipeline.py --folder "$FOLDER" --out "$W/pipeline.json" \
    --workers ${PIPELINE_WORKERS:-15} --batches ${PIPELINE_BATCHES:-40} --rounds 3 \
    --modes "${MODES:-cpu,gpu:nvimgcodec@1,gpu:nvimgcodec@2,gpu:nvimgcodec@3}" > "$W/pipeline.txt" 2>&1
  say "pipeline exit $?"; tail -20 "$W/pipeline.txt" | tee -a "$S"
}
finish() {  # the GPU decode's finishing path under a training step's load (finish_under_load.py)
  say "== finish under load"
  timeout ${FINISH_TIMEOUT:-240} "$PY" benchmarks/finish_under_load.py --out "$W/finish.json" --rounds ${FINISH_ROUNDS:-3} \
    --variants "${VARIANTS:-synthetic,1/0,2/0,2/0/f}" ${PROFILE:+--profile "$PROFILE"} > "$W/finish.txt" 2>&1
  say "finish exit $?"; grep -v "^eager [0-9]\|^graph [0-9]" "$W/finish.txt" | tail -40 | tee -a "$S"
}
gpu_decode_tests() {  # tests/gpu/test_decode_gpu.py (nvImageCodec from SITE)
  timeout ${TESTS_TIMEOUT:-200} "$PY" -m pytest -q -m gpu tests/gpu/test_decode_gpu.py -p no:cacheprovider > "$W/gpu-decode-tests.txt" 2>&1
  say "gpu_decode_tests exit $?"; tail -3 "$W/gpu-decode-tests.txt" | tee -a "$S"
}
bench_ro() {
  say "== bench --compile reduce-overhead"; run_bench bench-ro --data synthetic --compile reduce-overhead
}
imports() {
  say "== imports"
  for what in train bare; do for i in 1; do
    if [ $what = train ]; then
      timeout 60 "$PY" -X importtime -m multigpu train --model resnet50 --data synthetic:2048 --epochs 1 --devices 1 \
        --precision bf16 --batch-size 128 --logger none --checkpoint-every 0 --out "$W/it-train-$i" > "$W/it-train-$i.log" 2> "$W/it-train-$i.importtime"
      grep ^time: "$W/it-train-$i.log" | tee -a "$S"
    else
      BARE_STARTED_AT=$(date +%s.%N) timeout 60 "$PY" -X importtime benchmarks/startup_bare.py --plain --model resnet50 \
        --batch-size 128 > "$W/it-bare-$i.log" 2> "$W/it-bare-$i.importtime"; cat "$W/it-bare-$i.log" | tee -a "$S"
    fi
    sort -t'|' -k2 -n -r "$W/it-$what-$i.importtime" | head -12 >> "$S"
  done; done
}
startup() {
  say "== startup"
  timeout ${STARTUP_TIMEOUT:-150} "$PY" benchmarks/startup_phases.py --gpus 1 --bare --trials ${STARTUP_TRIALS:-2} --head-start on \
    --cases ${STARTUP_CASES:-1gpu-synthetic-headon,1gpu-synthetic-headon-cudnnoff,1gpu-bare-plain,1gpu-bare-tuned} --out "$W/startup" > "$W/startup.txt" 2>&1
  say "startup exit $?"; tail -5 "$W/startup.txt" | tee -a "$S"
}
pyspy() {  # start-up in time order (py-spy from PYSPY, e.g. carried as a wheel): train's (PYSPY_ARGS) and the bare script's
  say "== pyspy"; local spy=${PYSPY:-py-spy}
  timeout 120 "$spy" record -r 100 --nonblocking -f speedscope --threads -o "$W/spy-train.json" -- "$PY" -m multigpu train --model resnet50 \
    --data synthetic:4096 --epochs 1 --devices 1 --batch-size 128 ${PYSPY_ARGS:-} --out "$W/spy-train" > "$W/spy-train.log" 2>&1
  say "pyspy train exit $?"; grep ^time: "$W/spy-train.log" | tee -a "$S"
  BARE_STARTED_AT=$(date +%s.%N) timeout 60 "$spy" record -r 100 --nonblocking -f speedscope --threads -o "$W/spy-bare.json" -- "$PY" \
    benchmarks/startup_bare.py --plain --model resnet50 --batch-size 128 > "$W/spy-bare.log" 2>&1
  say "pyspy bare exit $?"; grep ^bare: "$W/spy-bare.log" | tee -a "$S"
  for what in train bare; do "$PY" benchmarks/startup_timeline.py "$W/spy-$what.json" --until ${SPY_UNTIL:-16} --step 0.5 \
    | cut -c1-400 | tee -a "$S"; done
}
cudnn() {
  say "== cudnn"
  for model in ${CUDNN_MODELS:-resnet50}; do
    timeout ${CUDNN_TIMEOUT:-120} "$PY" benchmarks/cudnn_autotune.py --model $model --rounds ${CUDNN_ROUNDS:-2} \
      --settings ${CUDNN_SETTINGS:-off,on,on1} --out "$W/cudnn-$model.jsonl" > "$W/cudnn-$model.txt" 2>&1
    say "cudnn $model exit $?"; grep -v '^{' "$W/cudnn-$model.txt" | tail -4 | tee -a "$S"; done
}
for stage in "$@"; do "$stage"; tar --exclude='*/checkpoints/*' --exclude='trace-*' --exclude=one_gpu_checks/big -czf "$OUT/checks.tar.gz" -C /tmp one_gpu_checks; done
