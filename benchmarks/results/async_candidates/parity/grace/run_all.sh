#!/bin/bash
# The grace window's runs, 2026-11-28 (see BENCHMARKS "Async at parity": the grace window).
G=benchmarks/results/async_candidates/parity/grace
.venv/bin/python benchmarks/async_timing.py --seeds 8 --scenarios noise,orderly,slow --methods sync-diloco,sync-new,async-new --candidates $G/grace035.json --out $G/matrix_shards.json > $G/matrix_shards.log 2>&1
.venv/bin/python benchmarks/long_run.py --rounds 100 --inner-steps 50 --timing noise --timing-seeds 0,2,4 --methods async-grace-0.35 --candidates $G/grace035.json --out $G/long_run_grace > $G/long_run_grace.log 2>&1
.venv/bin/python benchmarks/async_timing.py --iid --seeds 8 --scenarios noise --methods sync-new,async-new --candidates $G/grace035.json --out $G/noise_iid.json > $G/noise_iid.log 2>&1
