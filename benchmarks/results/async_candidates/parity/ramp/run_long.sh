#!/bin/bash
# The ramp with a norm bound that followed it (commit 909bee1, since reverted: bound_attack.py says why) + grace 0.5
# (async-new had grace 0.5 while this ran), against the synchronous steps and data-parallel, H = 50 and 20 (2026-11-28).
cd "$(dirname "$0")/../../../../.."
P=.venv/bin/python
D=benchmarks/results/async_candidates/parity/ramp
$P benchmarks/long_run.py --timing noise --inner-steps 50,20 --methods async-new --timing-seeds 0,2,4 --out $D/long_async > $D/long_async.log 2>&1
$P benchmarks/long_run.py --timing noise --inner-steps 50,20 --methods sync-diloco,sync-new,sync-new-constant,data-parallel --out $D/long_sync > $D/long_sync.log 2>&1
