#!/usr/bin/env bash
# Re-runs, one after another at their final settings, every benchmark whose method follows
# benchmarks/README.md since the like-for-like review, writing benchmarks/results/*.json.
# About 1.5 hours on a quiet 2-core machine (the estimate per step is beside it). Run it on a
# machine with nothing else running: each results file records the load it saw.
#
#   benchmarks/rerun.sh            # all of them
#   benchmarks/rerun.sh tokens     # only the named steps (tokens table images convert restart loader volume)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tokens table images convert restart loader volume)

settle() {  # waits (3 min at most) for the load of the step before to die down: each results file's load is its own
    for _ in $(seq 36); do
        awk -v cpus="$(nproc)" '{exit !($1 < 0.25 * cpus)}' /proc/loadavg && return
        sleep 5
    done
    echo "   the machine is still busy: $(cut -d' ' -f1-3 /proc/loadavg); the results file records it"
}

run() {  # run NAME COMMAND...: times each step, stops at the first failure
    local name=$1; shift
    settle
    echo "== $name: $*"
    local started=$SECONDS
    "$@"
    echo "== $name took $((SECONDS - started)) s"
}

for step in "${steps[@]}"; do
    case $step in
        tokens)  run tokens  "$PY" benchmarks/bench_tokens.py ;;                      # ~7 min
        table)   run table   "$PY" benchmarks/bench_table.py ;;                       # ~7 min
        images)  run images  "$PY" benchmarks/bench_images.py ;;                      # ~15 min
        convert) run convert "$PY" benchmarks/bench_convert.py ;;                     # ~20 min
        restart) run restart "$PY" benchmarks/bench_restart.py ;;                     # ~10 min
        loader)  run loader  "$PY" benchmarks/bench_loader.py ;;                      # ~5 min
        volume)                                                                       # ~12 min for the four
            run volume             "$PY" benchmarks/bench_volume.py
            run volume-s3-like     "$PY" benchmarks/bench_volume.py --profile s3-like
            run volume-table       "$PY" benchmarks/bench_volume.py --table
            run volume-table-s3    "$PY" benchmarks/bench_volume.py --table --profile s3-like ;;
        *) echo "unknown step $step (tokens table images convert restart loader volume)" >&2; exit 2 ;;
    esac
done
echo "done: rebuild the docs (make docs) to render the new figures"
