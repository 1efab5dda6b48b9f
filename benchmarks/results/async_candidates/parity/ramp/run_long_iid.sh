#!/bin/bash
# The ramp with the data token datasets give units (--iid: every unit its own stream over the whole split), 100
# rounds under timing noise, H = 50 (2026-11-28): async without and with a grace window of 0.5, timing seeds 0 and
# 4, and sync with the ramp. The constant rows (sync DiLoCo 1.0582, sync 1.4/0.3 1.0921, async default 1.0771 /
# 1.0766) are BENCHMARKS "The end of a long run" (iid_async, iid_others), on code whose constant step is unchanged.
cd "$(dirname "$0")/../../../../.."
D=benchmarks/results/async_candidates/parity/ramp
.venv/bin/python benchmarks/long_run.py --timing noise --inner-steps 50 --iid --methods async-ramp,async-ramp-grace --timing-seeds 0,4 --out $D/long_iid > $D/long_iid.log 2>&1 &
.venv/bin/python benchmarks/long_run.py --timing noise --inner-steps 50 --iid --methods sync-ramp --workers 1 --out $D/long_iid_sync > $D/long_iid_sync.log 2>&1
wait
