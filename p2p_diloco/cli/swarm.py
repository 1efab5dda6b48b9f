"""`p2p-diloco bootstrap | join | status`: the commands that use the real network.

Everything heavy (torch, hivemind) is imported inside the command functions: building the parser must stay
fast, since every `p2p-diloco ...` invocation builds all sub-commands. The options come from the light config
package (config/), through the one generator (cli/args.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from p2p_diloco.cli.args import add_config_args, add_run_args, load_config
from p2p_diloco.cli.options import bootstrap_options, join_options, status_options
from p2p_diloco.cli.status import cmd_status
from p2p_diloco.config import BootstrapConfig, JoinConfig, preset


def _fail(command: str, error: BaseException | str) -> int:
    """One clear line on stderr and exit code 2, as `cli.main` does for its own errors. (Returned rather than
    raised as CliError: under `python -m p2p_diloco.cli.main` the module running `main` is `__main__`, whose
    CliError is another class than the one importable here.)"""
    print(f"p2p-diloco {command}: error: {error}", file=sys.stderr)
    return 2


def add_swarm_commands(sub: argparse._SubParsersAction) -> None:
    """Register the network sub-commands on the CLI's sub-parser (imports stay light: --help must be fast)."""
    text = "run a bootstrap node: the swarm's entry point (a DHT node that trains nothing)"
    p = sub.add_parser("bootstrap", help=text, description=text + ". Prints 'bootstrap ready' and the multiaddrs "
                       "to hand out, one per line, then runs until Ctrl-C or SIGTERM.")
    add_config_args(p, bootstrap_options())
    p.set_defaults(func=cmd_bootstrap)

    text = "train with the swarm: join a run (the first peer of a run publishes its spec)"
    p = sub.add_parser("join", help=text, description=text + ". Every peer of a run must hold the same RunSpec "
                       "(--preset, and the [spec] tables of --config and --spec.* options); the defaults join the "
                       "run 'default' with the 'test' preset. Ctrl-C (or SIGTERM) leaves within seconds; SIGUSR1 "
                       "ends the current round as the last one, then lingers like --rounds. Run the same command "
                       "again (same --identity and --out-dir or --checkpoint-dir) to resume from the newest "
                       "checkpoint and catch up with the swarm. Only the options a volunteer needs are listed "
                       "here: every other setting is reachable as --SECTION.FIELD (e.g. --gossip.fanout 3) or in "
                       "the --config file, and listed by --help-all.")
    add_run_args(p, join_options, default_preset="test")
    p.set_defaults(func=cmd_join)

    text = "show a run's live peers: versions, throughput, loss, staleness"
    p = sub.add_parser("status", help=text, description=text + ". Starts a client-mode node with a throwaway "
                       "identity, reads the peer records from the DHT, prints a table and exits; with --watch, "
                       "keeps a live view on the terminal until Ctrl-C.")
    add_config_args(p, status_options())
    p.set_defaults(func=cmd_status)


# ---------------------------------------------------------------------------------------------- join


def join_config(args: argparse.Namespace) -> JoinConfig:
    """The preset, the --config file over it, the command line over both; the allow list into the spec;
    validated, and the run secret read (an unreadable or empty secret file fails here, before the node starts)."""
    import dataclasses

    config = load_config(JoinConfig(spec=preset(args.preset)), args, "join")
    config = dataclasses.replace(config, spec=with_allow_list(config.spec, config.admission.access.allow_peers))
    config = dataclasses.replace(config, spec=with_operators(config.spec, config.admission.access))
    config.validate()
    config.admission.access.secret()
    return config


def cmd_join(args: argparse.Namespace) -> int:
    import threading

    try:
        config = join_config(args)
    except ValueError as err:  # every config's validate() raises a ValueError (ConfigError is one)
        return _fail("join", err)
    # torch and hivemind only now: a mistake in the options or the --config file answers in half a second, not 5.
    from p2p_diloco.config import ConfigError
    from p2p_diloco.train.hardware.memory_fit import check_join_memory
    from p2p_diloco.train.hardware.unit import is_follower

    try:
        config = check_join_memory(config)  # spec resolved; a unit that will not fit is refused before it starts
    except ConfigError as err:
        return _fail("join", err)
    helpers = []
    if config.training.gpus > 1 and "WORLD_SIZE" not in os.environ:
        try:
            helpers = _launch_unit(config, args.argv)
        except ConfigError as err:
            return _fail("join", err)
    if is_follower():  # a training-only rank of a torchrun unit: no network, rank 0 speaks for the unit
        try:
            return _follow(config)
        except ConfigError as err:
            return _fail("join", err)
    from p2p_diloco.net.statesync.client import StateSyncError
    from p2p_diloco.net.transport.node import NodeError
    from p2p_diloco.peer.process import Peer
    from p2p_diloco.peer.signals import install_stop_handlers
    from p2p_diloco.wire.identity import IdentityError

    stop, finish = threading.Event(), threading.Event()
    install_stop_handlers(stop, finish)
    try:
        return Peer(config, stop=stop, finish=finish).run()
    except (ConfigError, IdentityError, NodeError, StateSyncError) as err:  # spec mismatch, corpus, key, network,
        return _fail("join", err)  # and a refusal (AccessDenied: not allowed in this run, and why)
    finally:
        for helper in helpers:  # ranks > 0 end on rank 0's stop, or when its sockets close
            try:
                helper.wait(timeout=30)
            except Exception:
                helper.kill()


def _launch_unit(config: Any, argv: list[str]) -> list:
    """`join --gpus N`: this process becomes rank 0 of a unit of N (it keeps the terminal and every signal:
    Ctrl-C, SIGTERM, SIGUSR1 work as for one process) and starts ranks 1..N-1 as children that only train,
    wired like torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Children die with us."""
    import socket
    import subprocess
    import sys

    import torch

    from p2p_diloco.config import ConfigError
    from p2p_diloco.train.hardware.device import resolve_device

    gpus, batch = config.training.gpus, config.spec.data.batch_size
    if batch % gpus:  # checked before anything starts, not as N tracebacks
        raise ConfigError(f"--gpus {gpus}: data.batch_size {batch} does not split over {gpus} processes; use a "
                          f"batch size divisible by {gpus}")
    device = resolve_device(config.training.device)
    if device.startswith("cuda") and torch.cuda.device_count() < gpus:
        raise ConfigError(f"--gpus {gpus}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"WORLD_SIZE": str(gpus), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "LOCAL_WORLD_SIZE": str(gpus)}
    os.environ.update(env, RANK="0", LOCAL_RANK="0")
    rest = argv[argv.index("join"):] if "join" in argv else ["join", *argv]
    print(f"a unit of {gpus} processes: this one (rank 0) speaks to the swarm, ranks 1..{gpus - 1} train",
          flush=True)
    helpers = []
    for rank in range(1, gpus):
        child_env = {**os.environ, **env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        helpers.append(subprocess.Popen([sys.executable, "-m", "p2p_diloco", *rest], env=child_env,
                                        preexec_fn=_die_with_parent))
    return helpers


def _die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the parent dies (Linux), so no rank outlives rank 0."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _follow(config: Any) -> int:
    import signal

    import torch

    # Ctrl-C reaches the whole terminal's process group: rank 0 handles it (finishes or leaves, then says stop);
    # a training rank must not die mid-collective and leave rank 0 waiting.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from p2p_diloco.train.data.resolve import resolve_spec
    from p2p_diloco.train.hardware.compute import Compute
    from p2p_diloco.train.hardware.unit import follow, unit_device
    from p2p_diloco.train.hardware.units import rank_group

    cfg = config.training
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    spec = resolve_spec(config.spec)
    device = unit_device(cfg.device)
    compute = Compute.for_training(cfg, device)
    unit = rank_group(device, cfg.parallel)
    try:
        steps = follow(spec, unit, compute, device)
    finally:
        unit.close()
    print(f"rank {unit.rank} of {unit.world}: {steps} inner steps, then rank 0 said stop", flush=True)
    return 0


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


def with_operators(spec: Any, access: Any) -> Any:
    """The spec with the run's operator keys as its defence.operators: those of --operators, else the signer of
    this peer's --invite. In the spec, so a peer that trusts other keys is told so at start (a differing spec
    field), before it asks anyone for admission."""
    import dataclasses

    from p2p_diloco.config import ConfigError

    operators = access.operator_ids()
    if not operators and access.invite:
        from p2p_diloco.net.admission.invites import load_invitation  # torch (wire/): only for an invitation

        operators = (load_invitation(access.invite).operator,)
    given = tuple(sorted(spec.defence.operators))
    if not operators:
        return spec
    if given and given != operators:
        raise ConfigError("--operators (or your invitation's signer) and --spec.defence.operators name different "
                          "keys; give one of them")
    return dataclasses.replace(spec, defence=dataclasses.replace(spec.defence, operators=operators)).validate()


# ---------------------------------------------------------------------------------------------- bootstrap


def cmd_bootstrap(args: argparse.Namespace) -> int:
    import asyncio
    import threading

    try:
        config = load_config(BootstrapConfig(), args, "bootstrap").validate()
    except ValueError as err:
        return _fail("bootstrap", err)
    from p2p_diloco.bootstrap.node import run_bootstrap  # the heavy imports after the options are known to be good
    from p2p_diloco.config import ConfigError
    from p2p_diloco.net.transport.node import NodeError
    from p2p_diloco.peer.signals import install_stop_handlers
    from p2p_diloco.wire.identity import IdentityError

    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        asyncio.run(run_bootstrap(config, stop))
    except (ConfigError, IdentityError, NodeError) as err:
        return _fail("bootstrap", err)
    return 0
