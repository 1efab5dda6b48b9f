#!/bin/bash
# After run_v2.sh: the long run with the v2 grace window (2026-11-28).
G=benchmarks/results/async_candidates/parity/grace
while pgrep -f run_v2.sh > /dev/null; do sleep 5; done
.venv/bin/python benchmarks/long_run.py --rounds 100 --inner-steps 50 --timing noise --timing-seeds 0,2,4 --methods async-grace-0.5,async-diloco-step-grace-0.5 --candidates $G/long_v2.json --out $G/v2_long_run > $G/v2_long_run.log 2>&1
