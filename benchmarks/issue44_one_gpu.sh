#!/usr/bin/env bash
# The one-GPU runs of issue 44's second round (2026-12-02), two device calls:
#   OUT=/tmp/o bash benchmarks/issue44_one_gpu.sh checks   # doctor's GPU tests, `multigpu doctor`,
#        a lost device on the GPU (lost_device_gpu.py), start-up against bare scripts (3 trials in turns)
#   OUT=/tmp/o bash benchmarks/issue44_one_gpu.sh epochs   # the bench and whole epochs in turns, the
#        main thread sampled in both (main_thread_sampler/, main_thread_report.py)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}; PY=${PY:-python3}
mkdir -p "$OUT"
checks() {
  timeout 170 "$PY" -m pytest -m gpu tests/gpu/test_doctor_gpu.py -v -rs -p no:cacheprovider --durations=5 \
    > "$OUT/doctor-tier.txt" 2>&1; echo "doctor tier exit $?"; tail -2 "$OUT/doctor-tier.txt"
  timeout 90 "$PY" -m multigpu doctor --model resnet50 --data synthetic:4096 --devices 1 --precision bf16 \
    > "$OUT/doctor.txt" 2>&1; echo "doctor exit $?"; tail -15 "$OUT/doctor.txt"
  timeout 200 "$PY" benchmarks/lost_device_gpu.py --out /tmp/ld > "$OUT/lost-device.txt" 2>&1
  echo "lost device exit $?"; cat "$OUT/lost-device.txt"; cp /tmp/ld/lost_device_gpu.json "$OUT/"
  timeout 230 "$PY" benchmarks/startup_phases.py --gpus 1 --bare --trials 3 --head-start on --out /tmp/startup \
    > "$OUT/startup.txt" 2>&1; echo "startup exit $?"; tail -8 "$OUT/startup.txt"
  cp /tmp/startup/trials.jsonl /tmp/startup/summary.json "$OUT/"
}
epochs() {
  local S=/tmp/samples
  export PYTHONPATH=$PWD/benchmarks/main_thread_sampler:$PYTHONPATH
  MAIN_THREAD_SAMPLES=$S/bench timeout ${BENCH_TIMEOUT:-210} "$PY" -m multigpu bench --model resnet50 --gpus 1 \
    --devices 1 --methods multigpu-single --data synthetic,real-cpu --images detailed --out "$OUT/bench.json" \
    > "$OUT/bench.log" 2>&1; echo "bench exit $?"; grep -E "^bench:" "$OUT/bench.log"
  FOLDER=$(ls -d "${XDG_CACHE_HOME:-$HOME/.cache}"/multigpu/bench-images/jpeg-detailed-* | tail -1)
  timeout ${TURNS_TIMEOUT:-300} "$PY" benchmarks/epoch_threads.py --folder "$FOLDER" --out /tmp/turns --rounds 3 \
    --setting "plain:MAIN_THREAD_SAMPLES=$S/plain" \
    --setting "defaults:MAIN_THREAD_SAMPLES=$S/defaults,--logger=tensorboard,csv,--log-every=50" 2>&1 | tee "$OUT/turns.txt"
  cp /tmp/turns/runs.jsonl "$OUT/"
  { echo "== bench (measure.py:time_trial)"
    "$PY" benchmarks/main_thread_report.py $S/bench --within measure.py:time_trial --min-seconds 0.5 --json "$OUT/sampled-bench.json"
    for d in plain defaults; do echo "== $d (engine.py:train_epoch)"
      "$PY" benchmarks/main_thread_report.py $S/$d --within engine.py:train_epoch --json "$OUT/sampled-$d.json"; done
  } > "$OUT/sampled.txt" 2>&1
  grep -E "span|third" "$OUT/sampled.txt" | head -60
}
"$@"
