#!/bin/bash
# The grace window that also awaits the units with no update yet after our first round (2026-11-28, v2).
G=benchmarks/results/async_candidates/parity/grace
.venv/bin/python benchmarks/async_timing.py --iid --seeds 8 --scenarios noise --methods sync-new,async-new --candidates $G/grace_v2.json --out $G/v2_noise_iid.json > $G/v2_noise_iid.log 2>&1
.venv/bin/python benchmarks/async_timing.py --seeds 8 --scenarios noise,orderly,slow --methods sync-diloco,sync-new,async-new --candidates $G/grace_v2.json --out $G/v2_matrix_shards.json > $G/v2_matrix_shards.log 2>&1
