#!/usr/bin/env bash
# The issue-24 recipe sweep on `none` alone: cpu20m model and batch, the 40M-byte schedule
# (decay at 9800 steps), the first 2450 steps (10M bytes, two FAVOR+ redraws), one thread each.
set -u
cd /work/wt24
export PYTHONPATH=$PWD
common="--preset cpu20m --variants none --seeds 0 --steps 2450 --decay-steps 9800 --eval-every 245 --threads 1 --data /work/shared/data/enwiki-sample.xml.bz2 --data-dir /work/runs24/data --on-nonfinite skip"
run() { name=$1; shift; /work/venv/bin/python train_enwik8.py $common --out /work/runs24/sweep/$name --resume "$@" > /work/runs24/sweep-$name.log 2>&1; }
run old --lr 2e-3
run qk --lr 2e-3 --qk-norm
run qk-lr4e-3 --lr 4e-3 --qk-norm
run qk-noredraw --lr 2e-3 --qk-norm --feature-redraw-interval 0
