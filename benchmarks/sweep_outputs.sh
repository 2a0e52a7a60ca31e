#!/usr/bin/env bash
# The README's two sweep outputs, in one command: examples/sweep_post002.yaml run on this machine
# (a laptop: CPU), then the same command plus `--on slurm` against a real SLURM (munged, slurmctld,
# one slurmd) started on localhost by tests/slurm/localslurm.py, the helper tests/slurm uses.
# Needs root, Debian's slurm-wlm and munge, and submitit (pip install 'multigpu[slurm]').
#   OUT=/tmp/sweep-outputs bash benchmarks/sweep_outputs.sh
# The localhost node has CPUs only, so the SLURM sweep adds --devices-per-run cpu:1 (without it
# each task asks for a GPU and sbatch refuses: $OUT/slurm-default-devices.txt keeps that answer).
# Writes $OUT/laptop.txt, $OUT/laptop-status.txt, $OUT/slurm.txt, $OUT/slurm-status-queued.txt
# (right after the submission), $OUT/slurm-status.txt (once SLURM has none of its jobs left),
# $OUT/times.txt, and the sweep folders $OUT/laptop and $OUT/slurm. The SLURM daemons are
# stopped when the script ends, whether it succeeds, fails or is interrupted (Ctrl-C).
set -euo pipefail
OUT=${OUT:?set OUT to a folder for the outputs}
PY=${PY:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
for d in laptop slurm; do
    if [ -e "$OUT/$d" ]; then
        echo "sweep_outputs.sh: error: $OUT/$d exists; give an empty OUT so that no sweep is resumed" >&2
        exit 2
    fi
done
: > "$OUT/times.txt"
now() { date +%s.%N; }
took() { "$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f} s')" "$@"; }

# (a) the laptop
t0=$(now)
"$PY" -m multigpu sweep --out "$OUT/laptop" examples/sweep_post002.yaml 2>&1 | tee "$OUT/laptop.txt"
echo "laptop sweep (18 runs): $(took "$t0" "$(now)")" | tee -a "$OUT/times.txt"
"$PY" -m multigpu sweep --status "$OUT/laptop" > "$OUT/laptop-status.txt" 2>&1

# (b) SLURM on localhost: held by a process of its own (a session of its own too), stopped by the trap
CLUSTER=$(mktemp -d /tmp/sweep-outputs-slurm.XXXXXX)  # short: the munge socket's path has a limit
HOLDER=
stop_slurm() {
    if [ -n "$HOLDER" ] && kill -0 "$HOLDER" 2>/dev/null; then
        echo "stopping the localhost SLURM (pid $HOLDER; its files: $CLUSTER)"
        kill -TERM "$HOLDER"
        wait "$HOLDER" || true
    fi
}
trap stop_slurm EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
PYTHONPATH=$REPO:$PYTHONPATH "$PY" -m tests.slurm.localslurm "$CLUSTER" > "$CLUSTER/holder.log" 2>&1 &
HOLDER=$!
deadline=$((SECONDS + 150))
until [ -e "$CLUSTER/slurm.env" ]; do
    if ! kill -0 "$HOLDER" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
        echo "sweep_outputs.sh: error: the localhost SLURM did not start (see $CLUSTER/holder.log):" >&2
        tail -n 40 "$CLUSTER/holder.log" >&2
        exit 1
    fi
    sleep 0.5
done
source "$CLUSTER/slurm.env"
export SLURM_CONF
echo "SLURM on localhost: SLURM_CONF=$SLURM_CONF, partition $PARTITION"

# The laptop's command plus --on slurm asks for a GPU a run (--devices-per-run 1 is the default,
# whatever the submitting machine has); this node has none, so sbatch refuses it: kept as seen.
set +e
"$PY" -m multigpu sweep --on slurm --partition "$PARTITION" --time 10m --out "$OUT/slurm" \
    examples/sweep_post002.yaml > "$OUT/slurm-default-devices.txt" 2>&1
echo "exit status $?" >> "$OUT/slurm-default-devices.txt"
set -e
cat "$OUT/slurm-default-devices.txt"
t0=$(now)
"$PY" -m multigpu sweep --on slurm --partition "$PARTITION" --time 10m --devices-per-run cpu:1 \
    --out "$OUT/slurm" examples/sweep_post002.yaml 2>&1 | tee "$OUT/slurm.txt"
"$PY" -m multigpu sweep --status "$OUT/slurm" > "$OUT/slurm-status-queued.txt" 2>&1
deadline=$((SECONDS + 1800))
while [ -n "$(squeue -h -o %i --name sweep-slurm)" ]; do  # the array's job name: sweep-<folder>
    if [ $SECONDS -ge $deadline ]; then
        echo "sweep_outputs.sh: error: SLURM still has the sweep's jobs after 1800 s" >&2
        exit 1
    fi
    sleep 2
done
echo "slurm sweep (18 runs, submission to an empty queue): $(took "$t0" "$(now)")" | tee -a "$OUT/times.txt"
"$PY" -m multigpu sweep --status "$OUT/slurm" > "$OUT/slurm-status.txt" 2>&1
cat "$OUT/slurm-status.txt"
