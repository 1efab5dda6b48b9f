"""The memory plan (`p2p-diloco plan`) next to what a CPU unit really holds: peak resident memory of a whole
`join` (one peer alone, 2 rounds of 2 inner steps) at two model sizes, and the slope in bytes per parameter.

    python benchmarks/bench_memory_plan.py                      # Llama 768 wide, 4 and 12 layers (34.6M, 91.2M)
    python benchmarks/bench_memory_plan.py --layers 2,4         # quicker

The estimate counts the gossip store at its bound (512 MiB by default), which a 2-round run never fills, so the
plan's total stands above the measurement by about that much; the slopes compare like with like.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from p2p_diloco.cli.args import load_config
from p2p_diloco.cli.main import build_parser
from p2p_diloco.config import JoinConfig, preset
from p2p_diloco.train.data.resolve import resolve_spec
from p2p_diloco.train.hardware.memory_fit import join_setup
from p2p_diloco.train.hardware.memory_plan import gib, plan_memory


def join_args(layers: int, out: Path) -> list[str]:
    return ["join", "--model", "llama", "--corpus", "stdlib-bpe", "--spec.model.n-layer", str(layers),
            "--spec.model.n-embd", "768", "--spec.model.n-head", "12", "--spec.model.block-size", "128",
            "--spec.data.batch-size", "2", "--spec.inner.inner-steps", "2", "--rounds", "2",
            "--training.linger-s", "0", "--training.torch-threads", "2", "--identity", str(out / "id.key"),
            "--out-dir", str(out / "out"), "--port", "0"]


def planned(argv: list[str]):
    args = build_parser().parse_args(argv)
    config = load_config(JoinConfig(spec=preset(args.preset)), args, "join").validate()
    config = dataclasses.replace(config, spec=resolve_spec(config.spec))
    return plan_memory(join_setup(config, device="cpu", ranks=1))


def measured_peak(argv: list[str]) -> tuple[int, float]:
    """Peak resident bytes of `p2p-diloco ARGV` run in a child (ru_maxrss of the largest child waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "p2p_diloco.cli", *argv], capture_output=True, text=True,
                         timeout=1800)
    if run.returncode != 0:
        raise SystemExit(f"join failed ({run.returncode}):\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:
        raise SystemExit("this run's peak is not above an earlier one's; run one size per process (--layers N)")
    return peak * 1024, time.monotonic() - started  # Linux: KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="4,12", help="comma-separated layer counts, smallest first")
    args = parser.parse_args()
    rows = []
    for layers in (int(n) for n in args.layers.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            argv = join_args(layers, Path(tmp))
            plan = planned(argv)
            peak, took = measured_peak(argv)
        rows.append((layers, plan, peak))
        print(f"{layers} layers: {plan.params / 1e6:.1f}M parameters, plan {gib(plan.host_need)} "
              f"(without the gossip store's bound {gib(plan.host_need - plan.setup.retained_bytes)}), "
              f"measured peak {gib(peak)} ({took:.0f} s)", flush=True)
    print("\n| layers | parameters | plan | plan without the store bound | measured peak RSS |")
    print("|---|---|---|---|---|")
    for layers, plan, peak in rows:
        print(f"| {layers} | {plan.params / 1e6:.1f}M | {gib(plan.host_need)} | "
              f"{gib(plan.host_need - plan.setup.retained_bytes)} | {gib(peak)} |")
    if len(rows) >= 2:
        (_, small, small_peak), (_, big, big_peak) = rows[0], rows[-1]
        d = big.params - small.params
        print(f"\nslope: plan {(big.host_need - small.host_need) / d:.1f} B/parameter, measured "
              f"{(big_peak - small_peak) / d:.1f} B/parameter")


if __name__ == "__main__":
    main()
