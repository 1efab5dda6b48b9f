"""What a peer process writes for people and tests: one line per round (`round_line`), a JSON log (`JsonLog`,
one object per event: start, sync, eval, round, isolation, linger, final) and its final state (`save_state`).

Light at import time (the CLI imports the peer package to build `join --help`): torch is imported where used.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from p2p_diloco.sync.version_vector import VersionVector


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def round_line(stats: Mapping[str, object]) -> str:
    """The one line a peer prints per round."""
    eval_loss = stats.get("eval_loss")
    shown_eval = "  -  " if eval_loss is None else format(eval_loss, ".3f")
    stretch = stats.get("stretch", 1)
    return (f"round {stats['round']:>4}  step {stats['step']:>6}  loss {stats['loss']:.3f}  "
            f"eval {shown_eval}  peers {stats['peers']}  tau {stats['tau']}  "
            f"V {stats['vv_total']}  sent {fmt_bytes(_number(stats['bytes_sent']))}  merged {stats['merged']}  "
            f"rejected {stats['rejected']}  util {stats['utilization']:.0%}"
            # a phase stretched over k rounds: our uplink had a backlog (train/loop.py)
            + (f"  stretch x{stretch}" if isinstance(stretch, (int, float)) and stretch > 1 else "")
            + ("  ALONE" if stats.get("alone") else ""))  # merged nothing while others publish: peer/isolation.py


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


class JsonLog:
    """One JSON object per line, flushed at once (tests and the local-swarm example tail it)."""

    def __init__(self, path: str) -> None:
        self._file = None
        if path:
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            self._file = open(Path(path).expanduser(), "a", encoding="utf-8")  # closed in close()

    def write(self, event: str, **fields: object) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def save_state(out_dir: str, theta: torch.Tensor, version_vector: VersionVector,
               extra: dict[str, object]) -> tuple[Path, Path]:
    """Write theta.pt and version_vector.json into `out_dir`, each atomically (temp file + rename)."""
    import torch

    folder = Path(out_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    theta_path, vv_path = folder / "theta.pt", folder / "version_vector.json"
    torch.save(theta, theta_path.with_suffix(".pt.tmp"))
    os.replace(theta_path.with_suffix(".pt.tmp"), theta_path)
    blob = {"version_vector": version_vector.to_dict(), "total": version_vector.total(),
            "digest": version_vector.digest().hex(), **extra}
    vv_path.with_suffix(".json.tmp").write_text(json.dumps(blob, indent=1))
    os.replace(vv_path.with_suffix(".json.tmp"), vv_path)
    return theta_path, vv_path
