#!/usr/bin/env bash
# The GPU plan: what a lent GPU window measures (docs/gpu.md). A window of 15 minutes of device
# time, starts included, holds one call: `window`, about 9.5 minutes by the budgets below:
#
#   bash benchmarks/gpu_plan.sh window     # the kernels' triage (each config in its own process:
#                                          # a fault poisons the process that meets it), op speed
#                                          # (B*H = 96 first), correctness, training and decoding
#
# A longer window (30 minutes) runs the three full commands instead, each under 9 minutes:
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
  window|check|train|ablation) ;;
  *) echo "usage: bash benchmarks/gpu_plan.sh window|check|train|ablation (see docs/gpu.md)" >&2; exit 2 ;;
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
  window)  # 8 files come back: triage.json, window.log and the three parts' JSON and Markdown
    { if [ -n "${QUICK:-}" ]; then
        echo "gpu_plan: triage skipped on the CPU (the interpreter shows no fault; tests/test_triton_bounds.py)"
      else
        timeout 90 "$py" -m benchmarks.gpu_triage --cases bf16,fp16,fp32,bf16_tc,bf16_tc_m32_n64 --timeout-s 85 \
          --out "$out/triage.json"
      fi
      "$py" -m benchmarks.gpu --parts op_speed --budget-s "${SPEED_S:-250}" "${quick[@]}" --out "$out/op_speed.json"
      "$py" -m benchmarks.gpu --parts correctness --budget-s "${CHECK_S:-80}" "${quick[@]}" --out "$out/correctness.json"
      "$py" -m benchmarks.gpu --parts training,generation --budget-s "${TRAIN_S:-110}" "${quick[@]}" \
        --out "$out/training.json"
    } 2>&1 | tee "$out/window.log" ;;
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
