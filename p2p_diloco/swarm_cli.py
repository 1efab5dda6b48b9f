"""`p2p-diloco bootstrap | join | status`: the commands that use the real network (being built)."""

from __future__ import annotations

import argparse


def add_swarm_commands(sub: argparse._SubParsersAction) -> None:
    """Register the network sub-commands on the CLI's sub-parser (imports stay light: --help must be fast)."""
