"""What the 10-round async gap with IID streams is made of: the noise scenario with one timing component changed at a
time, and a sweep of fixed latencies, 8 timing seeds each, against sync with the same outer step (1.9692, from
iid_noise.json). An ad-hoc script kept with its log (iid_latency_attribution.log); 2026-11-28.

    python benchmarks/results/async_candidates/parity/iid_latency_attribution.py
"""

import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from async_timing import METHODS, NOISE, run_one  # noqa: E402

SYNC_NEW = 1.9692
VARIANTS = {
    "noise": dict(NOISE),
    "no start spread": {**NOISE, "start_spread_s": 0.0},
    "no phase jitter": {**NOISE, "phase_jitter": 0.0},
    **{f"latency {lat} s fixed": {**NOISE, "latency_s": lat, "latency_jitter_s": 0.0}
       for lat in (0.016, 0.05, 0.1, 0.2, 0.3)},
}

if __name__ == "__main__":
    jobs = [("async-new", METHODS["async-new"], "noise", {**over, "iid": True}, seed)
            for over in VARIANTS.values() for seed in range(8)]
    with ProcessPoolExecutor(2) as pool:
        results = list(pool.map(run_one, jobs))
    for i, name in enumerate(VARIANTS):
        losses = [r["loss"] for r in results[i * 8:(i + 1) * 8]]
        median, worst = statistics.median(losses), max(losses)
        print(f"{name:22s} median {median:.4f} worst {worst:.4f} vs sync-new {SYNC_NEW}: "
              f"{(median / SYNC_NEW - 1) * 100:+.2f}% / {(worst / SYNC_NEW - 1) * 100:+.2f}%", flush=True)
