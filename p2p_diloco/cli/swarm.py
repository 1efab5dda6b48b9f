"""`p2p-diloco bootstrap | join | status`: the commands that use the real network.

Everything heavy (torch, hivemind) is imported inside the command functions: building the parser must stay
fast, since every `p2p-diloco ...` invocation builds all sub-commands. For the same reason the gossip and
state-sync options are read from their modules' source (`_static_dataclass_args`) rather than imported.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import operator
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2p_diloco.cli.args import add_dataclass_args, apply_args

DEFAULT_BOOTSTRAP_PORT = 31337


def _fail(command: str, error: BaseException) -> int:
    """One clear line on stderr and exit code 2, as `cli.main` does for its own errors. (Returned rather than
    raised as CliError: under `python -m p2p_diloco.cli.main` the module running `main` is `__main__`, whose
    CliError is another class than the one importable here.)"""
    print(f"p2p-diloco {command}: error: {error}", file=sys.stderr)
    return 2


@dataclass(frozen=True)
class BootstrapConfig:
    """A bootstrap node: a DHT node with a persistent identity that trains nothing."""

    identity: str = "~/.config/p2p-diloco/bootstrap.key"
    """Ed25519 identity file, created if missing (mode 0600): keep it, and the printed addresses stay valid."""
    host: str = "0.0.0.0"
    """Address to listen on: an IP (0.0.0.0 for every interface) or a full multiaddr."""
    port: int = DEFAULT_BOOTSTRAP_PORT
    """TCP port to listen on (0: any free port; the printed addresses carry it)."""
    announce: tuple[str, ...] = ()
    """Addresses peers should dial, comma-separated: public IPs or DNS names (with --port) or multiaddrs."""
    run_id: tuple[str, ...] = ()
    """Run ids whose peer records this node checks, comma-separated (the run 'default' always is)."""
    reachability: str = "public"
    """NAT reachability to assume: public (relays for peers behind NAT), private, or empty (detect)."""
    report_s: float = 60.0
    """Print the number of live peers per run every this many seconds (0: never)."""
    dht_timeout_s: float = 10.0
    """Timeout of one DHT read, in seconds (for the reports)."""


def add_swarm_commands(sub: argparse._SubParsersAction) -> None:
    """Register the network sub-commands on the CLI's sub-parser (imports stay light: --help must be fast)."""
    from p2p_diloco.cli.main import add_spec_args
    from p2p_diloco.peer.process import PeerConfig

    text = "run a bootstrap node: the swarm's entry point (a DHT node that trains nothing)"
    p = sub.add_parser("bootstrap", help=text, description=text + ". Prints 'bootstrap ready' and the multiaddrs "
                       "to hand out, one per line, then runs until Ctrl-C or SIGTERM.")
    add_dataclass_args(p, BootstrapConfig, BootstrapConfig(), title="bootstrap node", dest="boot")
    p.set_defaults(func=cmd_bootstrap)

    text = "train with the swarm: join a run (the first peer of a run publishes its spec)"
    p = sub.add_parser("join", help=text, description=text + ". Every peer of a run must hold the same RunSpec "
                       "(preset, --config and the run-spec options below); the defaults join the run 'default' "
                       "with the 'test' preset. Ctrl-C (or SIGTERM) leaves within seconds; SIGUSR1 ends the "
                       "current round as the last one, then lingers like --rounds. Run the same command again "
                       "(same --identity and --out-dir or --checkpoint-dir) to resume from the newest checkpoint "
                       "and catch up with the swarm.")
    add_spec_args(p, default_preset="test")
    add_dataclass_args(p, PeerConfig, PeerConfig(), title="this peer", dest="peer")
    _static_dataclass_args(p, "p2p_diloco.net.gossip.messages", "GossipConfig", title="gossip", dest="gossip",
                           prefix="gossip")
    _static_dataclass_args(p, "p2p_diloco.net.statesync.client", "StateSyncConfig", title="state sync (joining)",
                           dest="statesync", prefix="sync")
    _static_dataclass_args(p, "p2p_diloco.net.admission.policy", "AccessConfig",
                           title="closed runs (allow list, run secret)", dest="access", prefix="")
    _static_dataclass_args(p, "p2p_diloco.net.admission.policy", "RateLimitConfig",
                           title="rate limits (per remote peer)", dest="rate", prefix="rate")
    p.set_defaults(func=cmd_join)

    text = "show a run's live peers: versions, throughput, loss, staleness"
    p = sub.add_parser("status", help=text, description=text + ". Starts a client-mode node with a throwaway "
                       "identity, reads the peer records from the DHT, prints a table and exits.")
    p.add_argument("--bootstrap", required=True, metavar="MADDR",
                   help="bootstrap multiaddr(s), comma-separated, each ending in /p2p/<peer id>")
    p.add_argument("--run-id", default="default", help="the run to show (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=30.0,
                   help="bound on starting the node and on each DHT read, in seconds (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the raw peer records as JSON instead of a table")
    p.set_defaults(func=cmd_status)


# ---------------------------------------------------------------------------------------------- join


def cmd_join(args: argparse.Namespace) -> int:
    import threading

    from p2p_diloco.cli.main import CliError, load_spec
    from p2p_diloco.config import ConfigError
    from p2p_diloco.net.admission.policy import AccessConfig, NetPolicy, RateLimitConfig
    from p2p_diloco.net.gossip.service import GossipConfig
    from p2p_diloco.net.statesync.client import StateSyncConfig, StateSyncError
    from p2p_diloco.net.transport.node import NodeError
    from p2p_diloco.peer.process import Peer, PeerConfig, install_stop_handlers
    from p2p_diloco.wire.identity import IdentityError

    try:
        config = apply_args(PeerConfig(), args, "peer").validate()
        gossip_config = apply_args(GossipConfig(), args, "gossip").validate()
        sync_config = apply_args(StateSyncConfig(), args, "statesync").validate()
        policy = NetPolicy(apply_args(AccessConfig(), args, "access").validate(),
                           apply_args(RateLimitConfig(), args, "rate").validate())
        spec = with_allow_list(load_spec(args), policy.access.allow_peers)
        policy.access.secret()  # an unreadable or empty secret file fails here, before the node starts
    except (CliError, ValueError) as err:  # every config's validate() raises a ValueError (ConfigError is one)
        return _fail("join", err)
    stop, finish = threading.Event(), threading.Event()
    install_stop_handlers(stop, finish)
    try:
        return Peer(spec, config, gossip_config=gossip_config, sync_config=sync_config, stop=stop,
                    finish=finish, policy=policy).run()
    except (ConfigError, IdentityError, NodeError, StateSyncError) as err:  # spec mismatch, corpus, key, network,
        return _fail("join", err)  # and a refusal (AccessDenied: not allowed in this run, and why)


def with_allow_list(spec: Any, path: str) -> Any:
    """The spec with the allow list of `path` (`--allow-peers FILE`) as its defence.allowed_senders. The list is
    part of the RunSpec, and of its hash, so every peer of the run merges updates of exactly the same senders."""
    import dataclasses

    from p2p_diloco.config import ConfigError
    from p2p_diloco.net.admission.policy import load_allow_list

    if not path:
        return spec
    peers = load_allow_list(path)
    given = tuple(sorted(spec.defence.allowed_senders))
    if given and given != peers:
        raise ConfigError(f"--allow-peers {path} and --allowed-senders name different peers; give one of them")
    return dataclasses.replace(spec, defence=dataclasses.replace(spec.defence, allowed_senders=peers)).validate()


# ---------------------------------------------------------------------------------------------- bootstrap


def cmd_bootstrap(args: argparse.Namespace) -> int:
    import asyncio
    import threading

    from p2p_diloco.config import ConfigError
    from p2p_diloco.net.transport.node import NodeError
    from p2p_diloco.peer.process import install_stop_handlers
    from p2p_diloco.wire.identity import IdentityError

    config = apply_args(BootstrapConfig(), args, "boot")
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        asyncio.run(_bootstrap(config, stop))
    except (ConfigError, IdentityError, NodeError) as err:
        return _fail("bootstrap", err)
    return 0


async def _bootstrap(config: BootstrapConfig, stop: Any) -> None:
    import asyncio
    import time

    from p2p_diloco.config import ConfigError
    from p2p_diloco.net.discovery.records import PeerRecordValidator, list_peers
    from p2p_diloco.net.discovery.status import live
    from p2p_diloco.net.transport.netloop import exit_with_parent
    from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
    from p2p_diloco.peer.process import announce_maddr, listen_maddr
    from p2p_diloco.wire.identity import Identity

    if config.reachability not in ("", "public", "private"):
        raise ConfigError(f"reachability must be public, private or empty, got {config.reachability!r}")
    identity_path = str(Path(config.identity).expanduser())
    identity = Identity.load_or_create(identity_path)
    run_ids = sorted({"default", *config.run_id})
    node_config = NodeConfig(host_maddrs=(listen_maddr(config.host, config.port),),
                             announce_maddrs=tuple(announce_maddr(a, config.port) for a in config.announce),
                             force_reachability=config.reachability or None)
    node = await SwarmNode.start(identity_path, node_config, record_validators=[PeerRecordValidator(run_ids)])
    exit_with_parent(node)
    try:
        print(f"bootstrap ready (peer id {identity.peer_id}; checks records of runs: {', '.join(run_ids)})")
        for maddr in node.visible_maddrs():
            print(maddr)
        print("peers join with: p2p-diloco join --bootstrap <one of the addresses above>", flush=True)
        next_report = time.monotonic() + config.report_s
        while not stop.is_set():
            await asyncio.sleep(0.2)
            if config.report_s > 0 and time.monotonic() >= next_report:
                next_report = time.monotonic() + config.report_s
                counts = []
                for run_id in run_ids:
                    try:
                        counts.append(f"{run_id}={len(live(await list_peers(node, run_id, config.dht_timeout_s)))}")
                    except Exception as e:  # a report is best effort
                        counts.append(f"{run_id}=? ({type(e).__name__})")
                print(f"live peers: {' '.join(counts)}", flush=True)
        print("bootstrap stopping", flush=True)
    finally:
        await node.shutdown()


# ---------------------------------------------------------------------------------------------- status


def cmd_status(args: argparse.Namespace) -> int:
    import asyncio

    from p2p_diloco.net.transport.node import NodeError

    try:
        return asyncio.run(_status(args))
    except NodeError as err:
        return _fail("status", err)
    except (TimeoutError, asyncio.TimeoutError):
        return _fail("status", TimeoutError(f"the DHT did not answer within {args.timeout_s:g}s"))


async def _status(args: argparse.Namespace) -> int:
    import json
    import tempfile

    from p2p_diloco.net.discovery.records import PeerRecordValidator, fetch_run_spec, list_peers
    from p2p_diloco.net.discovery.status import rejection_details, status_table
    from p2p_diloco.net.transport.node import NodeConfig, SwarmNode, parse_multiaddr
    from p2p_diloco.wire.identity import Identity

    bootstrap = tuple(parse_multiaddr(b, require_peer_id=True) for b in args.bootstrap.split(",") if b)
    with tempfile.TemporaryDirectory(prefix="p2p-diloco-status-") as tmp:
        path = str(Path(tmp) / "throwaway.key")
        Identity.generate().save(path)
        config = NodeConfig(initial_peers=bootstrap, client_mode=True, start_timeout_s=args.timeout_s,
                            start_retries=1)
        # With the validator, a DHT node's answer that holds a forged record is dropped whole, so a forged record
        # under another peer's subkey cannot hide that peer's real record from us.
        node = await SwarmNode.start(path, config, record_validators=[PeerRecordValidator([args.run_id])])
        try:
            spec = await fetch_run_spec(node, args.run_id, timeout_s=args.timeout_s)
            records = await list_peers(node, args.run_id, timeout_s=args.timeout_s)
        finally:
            await node.shutdown()
    if args.json:
        print(json.dumps({"run_id": args.run_id, "spec_hash": spec[1] if spec else None, "peers": records},
                         indent=1, default=str))
        return 0
    spec_text = f"spec {spec[1][:12]}" if spec else "no spec published"
    print(f"run '{args.run_id}': {spec_text}, {len(records)} peer record(s)")
    if records:
        print(status_table(records))
        details = rejection_details(records)
        if details:
            print("\nrejections by reason, and each peer's worst offenders:\n" + details)
    return 0


# ---------------------------------------------------------------------------------------------- helpers


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow, ast.LShift: operator.lshift}


def _const(node: ast.expr) -> Any:
    """Evaluate a literal default such as `4 << 20`, `30.0` or `"x"`; ValueError on anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_const(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_const(node.left), _const(node.right))
    raise ValueError("not a literal")


def _static_dataclass_args(parser: argparse.ArgumentParser, module: str, cls_name: str, *, title: str, dest: str,
                           prefix: str) -> None:
    """Like `add_dataclass_args` for a flat dataclass of scalars, read from the module's source without
    importing it (its module imports hivemind). Options are `--{prefix}-{field}` (`--{field}` with no prefix);
    `apply_args(cls(), args, dest)` applies them after the real import, which also catches any field this
    reader got wrong."""
    try:
        spec = importlib.util.find_spec(module)
        tree = ast.parse(Path(spec.origin).read_text()) if spec and spec.origin else None
    except (ImportError, OSError, SyntaxError, ValueError):
        tree = None
    cls = next((n for n in (tree.body if tree else []) if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
    if cls is None:
        return
    converters = {"int": int, "float": float, "str": str, "bool": _parse_bool}
    group = parser.add_argument_group(title)
    body = cls.body
    for node, nxt in zip(body, body[1:] + [None]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None):
            continue
        kind = ast.unparse(node.annotation).strip("'\"")
        try:
            default = _const(node.value)
        except (ValueError, TypeError, ArithmeticError):
            continue
        if kind not in converters:
            continue
        doc = ""
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            doc = " ".join(nxt.value.value.split()).replace("%", "%%")  # argparse formats help with %
        name = node.target.id
        flag = f"--{prefix}-{name}" if prefix else f"--{name}"
        group.add_argument(flag.replace("_", "-"), dest=f"{dest}__{name}", type=converters[kind],
                           default=None, metavar=name.split("_")[-1].upper(),
                           help=f"{doc} (default: {default})".strip())


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")

