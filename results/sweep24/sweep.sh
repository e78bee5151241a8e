#!/usr/bin/env bash
# Issue 24's recipe sweep on `none` alone: the cpu20m model and batch, the 40M-byte schedule
# (decay at 9800 steps), its first 2450 steps (10M bytes, two FAVOR+ redraws), one thread each,
# one candidate after another. Re-running it resumes a candidate a session end stopped.
#   nohup nice -n 19 bash results/sweep24/sweep.sh > sweep.log 2>&1 &      (from the repo root)
set -u
cd "$(dirname "$0")/../.."
runs=${RUNS:-/work/runs24}  # outside the checkout
common="--preset cpu20m --variants none --seeds 0 --steps 2450 --decay-steps 9800 --eval-every 245 --threads 1
        --data ../shared/data/enwiki-sample.xml.bz2 --data-dir $runs/data --on-nonfinite skip"
run() { name=$1; shift; python train_enwik8.py $common --out "$runs/sweep/$name" --resume "$@" > "$runs/sweep-$name.log" 2>&1; }
run old --lr 2e-3
run qk --lr 2e-3 --qk-norm
run qk-lr4e-3 --lr 4e-3 --qk-norm
run qk-noredraw --lr 2e-3 --qk-norm --feature-redraw-interval 0
