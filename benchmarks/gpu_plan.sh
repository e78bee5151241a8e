#!/usr/bin/env bash
# The GPU benchmark plan (docs/gpu.md has what each row measures and its budget):
#
#   bash benchmarks/gpu_plan.sh window     # at most 570 s with this set-up: the rows of benchmarks/gpu.py, in order
#   bash benchmarks/gpu_plan.sh ablation   # the paper-width ablation, five variants   (5 x 85 s + exports)
#
# window: WINDOW_S (default 570) caps the whole call, set-up included: what is left after the
# wheels go to `python -m benchmarks.gpu --until <epoch>`, which skips a row whose budget no
# longer fits (recorded with the reason), and `timeout` stops it at that end. Each row's JSON is
# written in OUT as the row ends. Wheels from WHEELS (default .whl, made by
# benchmarks/gpu_wheels.sh) install into SITE (/tmp/site); QUICK=1 runs on the CPU at toy sizes (CI).
set -uo pipefail
start=$(date +%s)
cd "$(dirname "$0")/.."
step=${1:-}
out=${OUT:-/tmp/gpu-plan}
wheels=${WHEELS:-.whl}
site=${SITE:-/tmp/site}
py=${PYTHON:-python3}
case "$step" in
  window|ablation) ;;
  *) echo "usage: bash benchmarks/gpu_plan.sh window|ablation (see docs/gpu.md)" >&2; exit 2 ;;
esac
mkdir -p "$out" || { echo "gpu_plan: cannot create $out" >&2; exit 2; }
if compgen -G "$wheels/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl \
    || { echo "gpu_plan: the wheels in $wheels did not install" >&2; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_plan: installed $(ls "$wheels"/*.whl | wc -l) wheels from $wheels into $site"
else
  echo "gpu_plan: no wheels in $wheels (bash benchmarks/gpu_wheels.sh makes them): using what is installed" >&2
fi
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
export PYTHONUNBUFFERED=1
quick=()
[ -n "${QUICK:-}" ] && quick=(--device cpu --quick)
case "$step" in
  window)  # back in OUT: window.log, window.json / .md, and one JSON a row
    end=$((start + ${WINDOW_S:-570}))
    left=$((end - $(date +%s)))
    echo "gpu_plan: window, $((${WINDOW_S:-570} - left)) s of set-up, $left s for the rows"
    { timeout -k 5 "$left" "$py" -m benchmarks.gpu --until "$end" "${quick[@]}" ${DATA:+--data "$DATA"} --out "$out"
      rc=$?
      echo "gpu_plan: window done in $(($(date +%s) - start)) s (exit $rc)"
    } 2>&1 | tee "$out/window.log" ;;
  ablation)
    [ -n "${QUICK:-}" ] && export PRESET=${PRESET:-tiny} DEVICE=${DEVICE:-cpu} STEPS=${STEPS:-2}
    OUT="$out" PYTHON="$py" bash results/gpu_paper_width/run.sh 2>&1 | tee "$out/ablation.log" ;;
esac
