"""`p2p-diloco plot LOG...`: draw a run's JSON logs (`join --json-log`) as PNGs (drawn by view/plot.py).

Matplotlib is imported only when the command runs: every `p2p-diloco ...` invocation builds all sub-parsers.
"""

from __future__ import annotations

import argparse
import sys


def add_plot_command(sub: argparse._SubParsersAction) -> None:
    """Register `plot` on the CLI's sub-parsers."""
    text = "draw a run's JSON logs (join --json-log) as PNGs: loss vs time and tokens, bytes, utilization"
    p = sub.add_parser("plot", help=text, description=text + ". Each LOG is a file or a folder (every *.jsonl and "
                       "*.json log under it); one peer's events may be spread over several files, and a restart "
                       "that appended to the same file is drawn as a gap. Writes loss_time.png, loss_tokens.png, "
                       "bytes.png, utilization.png and summary.png (the four in one) into --out-dir.")
    p.add_argument("logs", nargs="+", metavar="LOG", help="a --json-log file, or a folder of them")
    p.add_argument("--out-dir", default="plots", help="where the PNGs go (created if missing; default: plots)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    from p2p_diloco.view.plot import plot_logs

    def note(line: str) -> None:
        print(f"p2p-diloco plot: {line}", file=sys.stderr)

    try:
        written = plot_logs(args.logs, args.out_dir, say=note)
    except ValueError as err:
        print(f"p2p-diloco plot: error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0
