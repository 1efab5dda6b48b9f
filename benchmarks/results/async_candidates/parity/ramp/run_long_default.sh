#!/bin/bash
# The final code (2026-11-28): outer.schedule ramp (opt-in) with the norm bound of the early step (honest senders
# clip under mu 0.9). 100 rounds under timing noise, H = 50 and 20: async with the ramp, without and with a grace
# window of 0.5, over 3 timing seeds, and sync with it. The methods ran under the names async-new, async-grace and
# sync-new, the ramp being the default then (1e2b34f); the logs say so. sync-diloco, the constant sync-new
# (sync-new-constant then) and data-parallel are long_sync.* (a constant schedule's bound never changed).
cd "$(dirname "$0")/../../../../.."
D=benchmarks/results/async_candidates/parity/ramp
.venv/bin/python benchmarks/long_run.py --timing noise --inner-steps 50,20 --methods async-ramp,async-ramp-grace --timing-seeds 0,2,4 --out $D/long_final > $D/long_final.log 2>&1
.venv/bin/python benchmarks/long_run.py --timing noise --inner-steps 50,20 --methods sync-ramp --out $D/long_final_sync > $D/long_final_sync.log 2>&1
# The constant step's async (the default) at H = 20, for the table (its H = 50 rows are in BENCHMARKS already).
.venv/bin/python benchmarks/long_run.py --timing noise --inner-steps 20 --methods async-new --timing-seeds 0,2,4 --out $D/long_constant_h20 > $D/long_constant_h20.log 2>&1
