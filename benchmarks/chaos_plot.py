"""The chaos harness's outputs: OUT.json (the report as is), OUT.png (goodput, utilization, time to recover,
replica divergence and update lag over time, loss) and OUT.md (the tables, with the command and date)."""

from __future__ import annotations

import json
from pathlib import Path

FAULT_COLORS = {"kill": "tab:red", "restart": "tab:green", "pause": "tab:orange", "resume": "tab:olive",
                "partition": "tab:gray", "heal": "tab:cyan"}


def write_outputs(report: dict, out: Path) -> dict[str, Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = {"json": out.with_suffix(".json"), "png": out.with_suffix(".png"), "md": out.with_suffix(".md")}
    paths["json"].write_text(json.dumps(report, indent=1, default=str))
    plot(report, paths["png"])
    paths["md"].write_text(markdown(report, paths["png"].name))
    return paths


def methods(report: dict) -> list[dict]:
    measured = {"method": "p2p-diloco (measured)", **{k: report["p2p"][k] for k in
                                                        ("goodput", "goodput_with_down", "useful_peer_s",
                                                         "allocated_peer_s")}}
    return [measured, *report["replays"]]


def update_lag(rounds: dict[str, list[dict]]) -> tuple[list[float], dict[str, list[float]]]:
    """At each round event: per peer, updates published so far (by anyone) that its replica lacks."""
    events = sorted((r["t"], name, r) for name, rs in rounds.items() for r in rs)
    published: dict[str, int] = {}
    latest: dict[str, int] = {}
    times, lag = [], {name: [] for name in rounds}
    for t, name, r in events:
        published[r["peer_id"]] = max(published.get(r["peer_id"], 0), r["seq"])
        latest[name] = r["vv_total"]
        times.append(t)
        total = sum(published.values())
        for peer in rounds:
            lag[peer].append(total - latest[peer] if peer in latest else float("nan"))
    return times, lag


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 3, figsize=(17, 9))
    rows = methods(report)
    names = [m["method"].replace(" (", "\n(") for m in rows]
    ax[0, 0].bar(names, [m["goodput"] for m in rows], color=["tab:blue", "tab:cyan", "tab:orange", "tab:red"])
    ax[0, 0].bar(names, [m["goodput_with_down"] for m in rows], color="none", edgecolor="black", hatch="//",
                 label="down time counted as allocated")
    ax[0, 0].axhline(0.95, color="black", ls=":", lw=1)
    ax[0, 0].set(ylim=(0, 1.05), title="goodput (same fault schedule)")
    ax[0, 0].legend(fontsize=8, loc="lower left")
    ax[0, 0].tick_params(axis="x", labelsize=8)
    for i, m in enumerate(rows):
        ax[0, 0].text(i, m["goodput"] + 0.01, f"{m['goodput']:.1%}", ha="center", fontsize=9)

    peers = report["p2p"]["peers"]
    xs = range(len(peers))
    ax[0, 1].bar([x - 0.2 for x in xs], [p["utilization"] for p in peers], 0.4, label="utilization (rounds/allocated)")
    ax[0, 1].bar([x + 0.2 for x in xs], [p["goodput"] for p in peers], 0.4, label="goodput")
    ax[0, 1].set(xticks=list(xs), xticklabels=[f"peer{p['peer']}" for p in peers], ylim=(0, 1.05),
                 title="per peer (p2p-diloco, measured)")
    ax[0, 1].legend(fontsize=8, loc="lower left")

    restarts = [(p["peer"], r) for p in peers for r in p["restarts"] if r["overhead_s"] is not None]
    labels = [f"p{peer}@{r['launched_t']:.0f}s" for peer, r in restarts]
    for key, label in (("to_first_update_s", "-> first update published"), ("overhead_s", "-> training (R)"),
                       ("to_caught_up_s", "-> caught up (checkpoint + pulls)"),
                       ("to_start_s", "-> process up (imports, corpus)")):
        ax[0, 2].bar(labels, [r.get(key) or 0 for _, r in restarts], label=f"restart {label}")
    ax[0, 2].set(title="time to recover after a restart", ylabel="s")
    ax[0, 2].legend(fontsize=8)
    ax[0, 2].tick_params(axis="x", labelsize=7, rotation=45)

    samples = report["series"]["divergence"]
    if samples:
        ax[1, 0].semilogy([s["t"] for s in samples], [max(s["divergence"], 1e-9) for s in samples], ".-")
    ax[1, 0].set(title="replica divergence (running peers' newest checkpoints;\nincludes up to a round of skew)",
                 xlabel="s",
                 ylabel="max ||theta_i - mean|| / ||mean||")
    rounds = report["series"]["rounds"]
    times, lag = update_lag(rounds)
    for name, values in lag.items():
        ax[1, 1].plot(times, values, lw=0.8, label=name)
    ax[1, 1].set(title="updates published but missing from the replica\n(as of each peer's last round)", xlabel="s",
                 ylabel="updates")
    ax[1, 1].legend(fontsize=8)
    for name, rs in rounds.items():
        (line,) = ax[1, 2].plot([r["t"] for r in rs], [r["loss"] for r in rs], lw=0.8, label=f"{name} train")
        evals = [r for r in rs if r.get("eval_loss") is not None]
        ax[1, 2].plot([r["t"] for r in evals], [r["eval_loss"] for r in evals], "x", ms=4, color=line.get_color())
    ax[1, 2].set(title="loss (lines: inner-phase train loss; x: eval)", xlabel="s")
    ax[1, 2].legend(fontsize=8)
    for a in (ax[1, 0], ax[1, 1], ax[1, 2]):
        for f in report["executed"]:
            a.axvline(f["t"], color=FAULT_COLORS.get(f["action"], "k"), lw=0.7, alpha=0.6)
    cfg = report["config"]
    fig.suptitle(f"chaos: {cfg['peers']} peers, preset {cfg['preset']}, H={cfg['inner_steps']}, "
                 f"{report['date']} (red: kill, green: restart, orange: pause, gray: partition)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(report: dict, png: str) -> str:
    cfg, p2p, final = report["config"], report["p2p"], report["final"]
    kinds = [f["action"] for f in report["executed"]]
    load = report["machine"]
    lines = [
        f"# Chaos harness: p2p-diloco under faults ({report['date']})", "",
        f"`{report['command']}`", "",
        f"{cfg['peers']} peers, preset `{cfg['preset']}`, H={cfg['inner_steps']}, {report['t_stop']:.0f} s under "
        f"faults: {kinds.count('kill')} kills (each restarted), {kinds.count('pause')} pauses, "
        f"{kinds.count('partition')} partitions. Round time P = {report['phase_s']:.1f} s (median), restart "
        f"overhead R = {report['restart_overhead_s']:.1f} s (median, restart launch to training). Machine: "
        f"{load['cpus']} CPUs, load average {load['loadavg_start'][0]:.1f} at start, {load['loadavg_end'][0]:.1f} "
        "at the end. Definitions: `benchmarks/chaos_metrics.py`.", "",
        "| method | goodput | goodput, down time counted | useful peer-s | allocated peer-s |",
        "|---|---|---|---|---|"]
    for m in methods(report):
        lines.append(f"| {m['method']} | {m['goodput']:.1%} | {m['goodput_with_down']:.1%} | "
                     f"{m['useful_peer_s']:.0f} | {m['allocated_peer_s']:.0f} |")
    lines += ["", "| peer | allocated s | useful s | goodput | utilization | down s | rounds | rounds lost |",
              "|---|---|---|---|---|---|---|---|"]
    for p in p2p["peers"]:
        lines.append(f"| peer{p['peer']} | {p['allocated_s']:.0f} | {p['useful_s']:.0f} | {p['goodput']:.1%} | "
                     f"{p['utilization']:.1%} | {p['down_s']:.0f} | {p['rounds']} | {p['rounds_lost']} |")
    lines += ["", "Seconds from a restart's launch to: the process up (imports, corpus), caught up (checkpoint "
              "loaded, node started, missed updates pulled), training (R), its first update published.", "",
              "| restart | process up | caught up (how, pull s) | training (R) | first update |",
              "|---|---|---|---|---|"]
    for p in p2p["peers"]:
        for r in p["restarts"]:
            catch = r.get("catch_up") or {}
            how = f" ({catch.get('how')}, {fmt(catch.get('seconds'))})" if catch else ""
            lines.append(f"| peer{p['peer']} at {r['launched_t']:.0f} s | {fmt(r.get('to_start_s'))} | "
                         f"{fmt(r.get('to_caught_up_s'))}{how} | {fmt(r['overhead_s'])} | "
                         f"{fmt(r['to_first_update_s'])} |")
    if report.get("sensitivity"):
        names = [m["method"] for m in report["replays"]]
        lines += ["", "The same schedule replayed with other restart overheads R (the model rows; restart start-up "
                  "time depends on the machine and its load):", "",
                  "| R | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for row in report["sensitivity"]:
            lines.append(f"| {row['restart_overhead_s']:.0f} s | " + " | ".join(f"{row[n]:.1%}" for n in names) + " |")
    ck = report.get("checkpoint_s_mean")
    lines += ["", f"After the stop every peer lingered until the swarm was quiet: final replica divergence "
              f"{final['divergence']:.1e}, version vectors {'equal' if final['digests_equal'] else 'NOT equal'} "
              f"(V totals {final['vv_totals']}), published updates missing from a final replica: "
              f"{final['lost'] or 'none'}." + (f" A checkpoint took {ck * 1000:.0f} ms on average." if ck else ""),
              "", f"![chaos]({png})", ""]
    return "\n".join(lines)
