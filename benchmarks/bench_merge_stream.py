"""What merging one remote update costs a receiver, in time and in memory: the replica of the default RunSpec
(standing, copy test, reference, norm bound) merges int8 updates of a large model from a few authors, as a peer's
network thread does. Run it against older code to compare (peak memory in a fresh process per size):

    python benchmarks/bench_merge_stream.py --sizes 16,64
    PYTHONPATH=/tmp/old python benchmarks/bench_merge_stream.py --sizes 16,64     # a worktree of older code

Prints, per size (millions of parameters): ms per merge (median of the merges after the first of each author),
and how far the process's peak resident memory rose during the first merge above what it held before it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

ONE = """
import hashlib, json, statistics, sys, time, torch
import p2p_diloco
from p2p_diloco.config import RunSpec
from p2p_diloco.sync.replica import Replica
from p2p_diloco.wire.codecs import get_codec
from dataclasses import dataclass
@dataclass(frozen=True)
class FakeUpdate:  # the fields a replica reads of a signed update
    sender: str
    seq: int
    update_id: bytes
    weight: float
    payload: bytes
    nbytes: int
n = int(sys.argv[1])
spec = RunSpec()
codec = get_codec(spec.outer.codec, spec.outer.codec_block)
bound = 0.5 * spec.inner.inner_steps * spec.inner.lr  # well inside the norm bound
g = torch.Generator().manual_seed(0)
payloads = {a: [codec.compress(torch.randn(n, generator=g).clamp_(-3, 3) * bound / 3) for _ in range(3)]
            for a in ("a", "b", "c")}
replica = Replica.from_spec(spec, torch.zeros(n), codec=codec, self_id="me")
def peak_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
import ctypes
ctypes.CDLL("libc.so.6").malloc_trim(0)  # the payloads' making freed memory that a merge would reuse unseen
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark from here
before = peak_kib()
times = []
for seq in (1, 2, 3):
    for author, mine in payloads.items():
        uid = hashlib.sha256(f"{author}{seq}".encode()).digest()
        update = FakeUpdate(author, seq, uid, 0.3, mine[seq - 1], nbytes=len(mine[seq - 1]))
        t = time.perf_counter()
        outcome = replica.offer(update)[0]
        times.append(time.perf_counter() - t)
        assert outcome.value == "merged", outcome
        if len(times) == 1:
            first_rise = peak_kib() - before
print(json.dumps({"code": p2p_diloco.__file__, "params_M": n / 1e6, "ms_per_merge": 1000 * statistics.median(times[3:]),
                  "peak_rise_mib": first_rise / 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16,64", help="millions of parameters, comma-separated")
    args = parser.parse_args()
    for size in args.sizes.split(","):
        n = int(float(size) * 1_000_000)
        # From a neutral folder: `-c` puts the working folder first on sys.path, ahead of PYTHONPATH.
        done = subprocess.run([sys.executable, "-c", ONE, str(n)], capture_output=True, text=True, timeout=1800,
                              cwd=tempfile.gettempdir())
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{row['code']}: {row['params_M']:7.1f}M parameters: {row['ms_per_merge']:8.1f} ms per merge, "
              f"peak memory +{row['peak_rise_mib']:.0f} MiB during a merge")


if __name__ == "__main__":
    main()
