"""`p2p-diloco`: the command line. Options are generated from the config dataclasses (see cli/args.py)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from p2p_diloco.cli.args import ArgumentParser, CommandParser, add_run_args, load_config
from p2p_diloco.cli.options import simulate_options
from p2p_diloco.config import ConfigError, SimConfig, SimulateConfig, preset

DESCRIPTION = """\
p2p-diloco: train one model together across machines you don't control.

Learner units train alone for many steps and exchange rare, compressed, signed outer updates by gossip;
there is no central server. Start with `p2p-diloco simulate` (an in-process swarm, no network needed).
"""


class CliError(Exception):
    """A mistake on the command line, reported in one line without a traceback."""


class Progress:
    """A status line on long work: rewritten in place on a terminal, a line every ~10% otherwise."""

    def __init__(self, label: str, stream=sys.stderr):
        self.label, self.stream = label, stream
        self.tty = stream.isatty()
        self.t0 = time.monotonic()
        self.last_decile = -1

    def __call__(self, done: int, total: int, loss: float | None) -> None:
        frac = done / max(1, total)
        loss_txt = f" train_loss={loss:.3f}" if loss is not None else ""
        line = f"[{self.label}] {done}/{total} steps ({frac:.0%}) {time.monotonic() - self.t0:.0f}s{loss_txt}"
        if self.tty:
            self.stream.write("\r" + line.ljust(78))
            if done >= total:
                self.stream.write("\n")
        elif int(frac * 10) > self.last_decile:
            self.last_decile = int(frac * 10)
            self.stream.write(line + "\n")
        self.stream.flush()


def cmd_simulate(args: argparse.Namespace) -> int:
    config = load_config(SimulateConfig(spec=preset(args.preset)), args, "simulate").validate()
    spec, sim = config.spec, config.sim
    for path in (args.json_out, args.plot):  # fail now, not after the whole simulation
        if path and not Path(path).resolve().parent.is_dir():
            raise CliError(f"cannot write {path}: folder {Path(path).resolve().parent} does not exist")
    from p2p_diloco.sim.plot import plot_curves  # torch only once the options are known to be good
    from p2p_diloco.sim.runner import simulate
    from p2p_diloco.train.data.resolve import load_training_data, resolve_spec

    spec = resolve_spec(spec)  # --model PATH, a token dataset's vocabulary and fingerprints
    corpus = load_training_data(spec.data, block_size=spec.model.block_size)
    print(f"corpus: {corpus.describe()}")
    methods = ["async", "sync", "dp"] if args.compare else [sim.method]
    results = []
    for method in methods:
        run_sim = SimConfig(**{**sim.__dict__, "method": method})
        print(f"\n== {method}: {sim.peers} peers, preset={args.preset}, H={spec.inner.inner_steps}, "
              f"codec={spec.outer.codec}, total_steps={sim.total_steps}")
        result = simulate(spec, run_sim, corpus, progress=Progress(method))
        for point in result.curve:
            print(f"  t={point.time_s:>8.0f}s tokens={point.tokens:>10} eval_loss={point.loss:.4f}")
        print(result.table())
        results.append(result)
    if len(results) > 1:
        print("\nsummary (equal tokens): " + "  ".join(f"{r.method}={r.eval_loss:.4f}" for r in results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([r.to_dict() for r in results], indent=1))
        print(f"wrote {args.json_out}")
    if args.plot:
        plot_curves({r.method: r.curve for r in results}, args.plot, title=f"{sim.peers} peers, preset {args.preset}")
        print(f"wrote {args.plot}")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from p2p_diloco.wire.identity import Identity

    path = Path(args.identity).expanduser()
    if path.exists() and not args.force:
        raise CliError(f"{path} already exists (PeerID {Identity.load(path).peer_id}); use --force to replace it")
    identity = Identity.generate()
    identity.save(path)
    print(f"wrote {path}\n{identity.peer_id}")
    return 0


def cmd_id(args: argparse.Namespace) -> int:
    from p2p_diloco.wire.identity import Identity

    path = Path(args.identity).expanduser()
    if not path.exists():
        raise CliError(f"no identity at {path}; create one with `p2p-diloco keygen --identity {path}`")
    print(Identity.load(path).peer_id)
    return 0


def default_identity_path() -> str:
    return str(Path("~/.config/p2p-diloco/identity.key"))


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="p2p-diloco", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    sub.required = True

    p = sub.add_parser("simulate", help="run N learner units in one process on a simulated network",
                       description="Run N learner units in one process over the in-memory exchange, on a simulated "
                                   "clock, and print per-peer loss, staleness and bytes. --compare also runs the "
                                   "data-parallel and synchronous-DiLoCo baselines on the same token budget.")
    add_run_args(p, simulate_options, default_preset="test")
    p.add_argument("--compare", action="store_true", help="run async, sync DiLoCo and data-parallel side by side")
    p.add_argument("--json-out", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="PNG", help="write the eval-loss curves as a PNG")
    p.set_defaults(func=cmd_simulate)

    for name, func, text in (("keygen", cmd_keygen, "create an Ed25519 identity (the PeerID is its public key)"),
                             ("id", cmd_id, "print the PeerID of an identity")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--identity", default=default_identity_path(),
                       help="identity file, mode 0600 (default: %(default)s)")
        if name == "keygen":
            p.add_argument("--force", action="store_true", help="replace an existing identity")
        p.set_defaults(func=func)

    from p2p_diloco.cli.swarm import add_swarm_commands  # bootstrap | join | status: the real network

    add_swarm_commands(sub)
    from p2p_diloco.cli.doctor import add_doctor_command  # doctor: would a join from here work, and the fixes

    add_doctor_command(sub)
    from p2p_diloco.cli.plot import add_plot_command  # plot: draw peers' JSON logs as PNGs

    add_plot_command(sub)
    from p2p_diloco.cli.data import add_data_command  # data prepare: token shards and a tokenizer

    add_data_command(sub)
    from p2p_diloco.cli.export import add_export_commands  # export, generate: a folder transformers loads

    add_export_commands(sub)
    from p2p_diloco.cli.invite import add_invite_commands  # invite, revoke: runs that admit by invitation

    add_invite_commands(sub)
    from p2p_diloco.cli.plan import add_plan_command  # plan: the memory a unit needs, and whether it fits

    add_plan_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `join --gpus N` runs the same command under torchrun
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (CliError, ConfigError) as err:
        print(f"p2p-diloco {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError, TimeoutError) as err:
        # Bad input that reached a lower layer (a corrupt key file, a config value of the wrong type, an
        # unwritable path, a DHT that did not answer): one line, the traceback only with --verbose.
        if args.verbose:
            raise
        print(f"p2p-diloco {args.command}: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"p2p-diloco {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Re-import by package name: run as `python -m p2p_diloco.cli.main` this file is `__main__`, and its CliError
    # would be a different class from the one the other modules raise.
    from p2p_diloco.cli.main import main as package_main

    sys.exit(package_main())
