"""Loss curves as a PNG (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from p2p_diloco.sim.result import EvalPoint


def plot_curves(curves: Mapping[str, Sequence[EvalPoint]], path: str, *, title: str = "",
                x: str = "tokens") -> None:
    """One line per run: eval loss against tokens (or simulated time with x='time_s')."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, points in curves.items():
        ax.plot([getattr(p, x) for p in points], [p.loss for p in points], marker=".", label=label)
    ax.set_xlabel("tokens (whole swarm)" if x == "tokens" else "simulated time (s)")
    ax.set_ylabel("eval loss (nats per token; a byte for the built-in GPT)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
