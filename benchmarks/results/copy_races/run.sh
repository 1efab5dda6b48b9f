#!/usr/bin/env bash
# The runs behind BENCHMARKS.md "Copy races with a stream per unit" (2026-11-29), two at a time.
cd "$(dirname "$0")/../../.."
S=benchmarks/results/copy_races/iid_graduation.py
jobs=("shards instant fixed" "iid instant fixed" "shards causal fixed" "iid causal fixed"
      "iid instant 0" "iid instant 1" "iid instant 2" "iid causal 0" "iid causal 1" "iid causal 2")
printf '%s\n' "${jobs[@]}" | OMP_NUM_THREADS=1 xargs -P 2 -I{} sh -c ".venv/bin/python $S {} 2>/dev/null"
