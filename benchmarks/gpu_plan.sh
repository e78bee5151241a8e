#!/usr/bin/env bash
# The GPU benchmark plan (docs/gpu.md has what each part measures and its budget):
#
#   bash benchmarks/gpu_plan.sh window     # 10 minutes: training table, decoding, op speed, correctness, triage
#   bash benchmarks/gpu_plan.sh check      # correctness, then op speed (bf16, N = 1k..16k)       (450 s)
#   bash benchmarks/gpu_plan.sh train      # the paper preset's training phases, decoding          (420 s)
#   bash benchmarks/gpu_plan.sh ablation   # the paper-width ablation, five variants   (5 x 85 s + exports)
#
# WINDOW_S (default 550) caps the window: a part gets its budget or what is left less 20 s, and
# `timeout` stops it 25 s past that. Wheels from WHEELS (default .whl, made by
# benchmarks/gpu_wheels.sh) install into SITE (/tmp/site); QUICK=1 runs on the CPU at toy sizes (CI).
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
  window)  # back: window.log, and per part its JSON and Markdown (compare, generation, op_speed, correctness), triage.json
    start=$SECONDS
    window_s=${WINDOW_S:-550}
    budget() {  # the part's budget, or what the window has left (less 20 s), whichever is less
      local left=$((window_s - (SECONDS - start) - 20))
      (( left < $1 )) && echo $(( left > 0 ? left : 0 )) || echo "$1"
    }
    part() {  # part NAME DEFAULT_BUDGET: one process of benchmarks.gpu, stopped 25 s past its budget
      local b; b=$(budget "$2")
      if (( b < 5 )); then echo "gpu_plan: $1 skipped: the window's ${window_s} s are spent"; return; fi
      echo "gpu_plan: $1, budget ${b} s, $((SECONDS - start)) s into the window"
      timeout $((b + 25)) "$py" -m benchmarks.gpu --parts "$1" --budget-s "$b" "${quick[@]}" ${DATA:+--data "$DATA"} \
        --out "$out/$1.json"
    }
    { part compare "${COMPARE_S:-200}"
      part generation "${GEN_S:-45}"
      SPEED_IMPLS=${SPEED_IMPLS:-ours_triton,sdpa,fla_chunk,ours_torch} part op_speed "${SPEED_S:-120}"
      part correctness "${CHECK_S:-75}"
      if [ -n "${QUICK:-}" ]; then
        echo "gpu_plan: triage skipped on the CPU (the interpreter shows no fault; tests/test_triton_bounds.py)"
      else
        b=$(budget "${TRIAGE_S:-50}")
        (( b >= 20 )) && timeout $((b + 5)) "$py" -m benchmarks.gpu_triage --cases bf16,fp16,fp32,bf16_tc,bf16_tc_m32_n64 \
          --timeout-s $((b - 5)) --out "$out/triage.json"
      fi
      echo "gpu_plan: window done in $((SECONDS - start)) s"
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
