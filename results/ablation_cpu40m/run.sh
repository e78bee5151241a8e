#!/usr/bin/env bash
# Issue 24's ablation: every variant x 3 seeds on the cpu40m preset (40M training bytes each),
# and rope / rope_pre at m = 4d = 128 (20M bytes each), one thread per run, run directories
# outside the checkout. Start two workers (the box has 2 cores); each takes the next run of the
# queue that no live worker holds, so re-running the same two commands in a later session
# resumes the unfinished runs (--resume) and skips the finished ones:
#   RUNS=/work/runs24 nohup nice -n 19 bash results/ablation_cpu40m/run.sh > /work/runs24/worker-1.log 2>&1 &
#   sleep 5; RUNS=/work/runs24 nohup nice -n 19 bash results/ablation_cpu40m/run.sh > /work/runs24/worker-2.log 2>&1 &
# Logs: $RUNS/<group>-<variant>-seed<s>.log; runs: $RUNS/main/<variant>-seed<s>, $RUNS/m128/...
# `python` must be the project's venv (activate it first).
set -u
python -c "import torch, linear_rope" || { echo "python cannot import torch and linear_rope: activate the venv" >&2; exit 2; }
cd "$(dirname "$0")/../.."
runs=${RUNS:-/work/runs24}
common=(--preset cpu40m --threads 1 --data ../shared/data/enwiki-sample.xml.bz2 --data-dir "$runs/data"
        --on-nonfinite skip --resume)
queue=()  # every variant's seed 0 first, then seed 1, then seed 2
for s in 0 1 2; do
  for v in none rope rope_pre rope_norm softmax; do queue+=("main $v $s"); done
  for v in rope rope_pre; do queue+=("m128 $v $s"); done
done
claim() {  # a run is held by a live worker's pid in $runs/claims/<name>/pid
  local d="$runs/claims/$1" p
  mkdir -p "$runs/claims"
  if mkdir "$d" 2>/dev/null; then echo $$ > "$d/pid"; return 0; fi
  p=$(cat "$d/pid" 2>/dev/null)
  if [ -n "$p" ] && [ "$p" != $$ ] && kill -0 "$p" 2>/dev/null; then return 1; fi
  echo $$ > "$d/pid"
}
for item in "${queue[@]}"; do
  read -r group v s <<< "$item"
  name="$group-$v-seed$s"
  claim "$name" || continue
  extra=()
  [ "$group" = m128 ] && extra=(--nb-features 128 --steps 4900 --decay-steps 4900)
  echo "$(date -u +%FT%TZ) $name: start"
  python train_enwik8.py "${common[@]}" "${extra[@]}" --variants "$v" --seeds "$s" --out "$runs/$group" \
    >> "$runs/$name.log" 2>&1
  rc=$?
  echo "$(date -u +%FT%TZ) $name: exit $rc"
done
