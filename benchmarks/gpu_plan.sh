#!/usr/bin/env bash
# The GPU plan: everything a lent GPU window measures, as three commands (docs/gpu.md), in this
# order of value, each under 9 minutes by the budgets below (about 23 minutes in all):
#
#   bash benchmarks/gpu_plan.sh check      # 1. correctness on the device, 2. op speed, bf16,
#                                          #    N = 1k..16k, against flash SDPA and fla   (450 s)
#   bash benchmarks/gpu_plan.sh train      # 3. the paper preset's training tokens/s and MFU,
#                                          #    and batched decoding                         (420 s)
#   bash benchmarks/gpu_plan.sh ablation   # 4. the paper-width ablation, five variants    (5 x 85 s + exports)
#
# Each device call carries [".whl", "data/enwiki-sample.xml.bz2"] (bash benchmarks/gpu_wheels.sh
# makes both here) and writes into $OUT as it goes: the JSON after every part, the ablation's
# tarball after every variant, so a command stopped at its limit still returns what finished.
# The script installs the carried wheels itself (WHEELS, default .whl) into SITE (/tmp/site).
# QUICK=1 runs the same commands on the CPU at toy sizes (CI's dry run).
set -uo pipefail
cd "$(dirname "$0")/.."
step=${1:-}
out=${OUT:-/tmp/gpu-plan}
wheels=${WHEELS:-.whl}
site=${SITE:-/tmp/site}
py=${PYTHON:-python3}
case "$step" in
  check|train|ablation) ;;
  *) echo "usage: bash benchmarks/gpu_plan.sh check|train|ablation (see docs/gpu.md)" >&2; exit 2 ;;
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
  check)
    "$py" -m benchmarks.gpu --parts correctness,op_speed --budget-s "${BUDGET_S:-450}" "${quick[@]}" \
      --out "$out/gpu_check_speed.json" 2>&1 | tee "$out/check.log" ;;
  train)
    "$py" -m benchmarks.gpu --parts training,generation --budget-s "${BUDGET_S:-420}" "${quick[@]}" \
      --out "$out/gpu_train.json" 2>&1 | tee "$out/train.log" ;;
  ablation)
    [ -n "${QUICK:-}" ] && export PRESET=${PRESET:-tiny} DEVICE=${DEVICE:-cpu} STEPS=${STEPS:-2}
    OUT="$out" PYTHON="$py" bash results/gpu_paper_width/run.sh 2>&1 | tee "$out/ablation.log" ;;
esac
