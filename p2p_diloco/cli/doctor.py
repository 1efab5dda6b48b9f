"""`p2p-diloco doctor --bootstrap ADDR[,ADDR...]`: would a `join` with these network options work from here?

Prints one line per step as it goes (addresses, TCP connects, the node, dial-backs, reachability, upload rate,
the run's spec), then one line per problem with its fix, then the verdict. Exit code 0 only when a `join` from
here would work (some bootstrap reachable, this host public or relayed), 1 when it would not, 2 for a mistake
in the options. The checks themselves live in net/discovery/ (doctor.py, bootstraps.py), where `join` can run them too.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from p2p_diloco.cli.args import Options, add_config_args, load_config
from p2p_diloco.cli.options import JOIN_SHOWN
from p2p_diloco.config.doctor import DoctorConfig

if TYPE_CHECKING:  # imported where used: `doctor --help` starts neither hivemind nor torch
    from p2p_diloco.net.discovery.bootstraps import Report
    from p2p_diloco.net.discovery.doctor import Diagnosis
    from p2p_diloco.wire.identity import Identity

DOCTOR_SHOWN = {
    **{field: flag for field, flag in JOIN_SHOWN.items() if field.startswith("network.")},  # the join's, as typed
    "run_id": "--run-id",
    "timeout_s": "--timeout-s",
    "relay_wait_s": "--relay-wait-s",
    "upload_mib": "--upload-mib",
    "json": "--json",
}
_MIN_START_TIMEOUT_S = 15.0  # hivemind's DHT start (fork, p2pd, bootstrap) takes seconds on a loaded machine


def doctor_options() -> Options:
    return Options(DoctorConfig, DoctorConfig(), "doctor", DOCTOR_SHOWN)


def add_doctor_command(sub: argparse._SubParsersAction) -> None:
    text = "check this host's connection to a swarm: bootstraps, reachability, upload rate, the run's spec"
    p = sub.add_parser("doctor", help=text, description=text + ". Takes join's network options and checks what a "
                       "join with them would meet: parses and dials each bootstrap, asks it to dial this host back, "
                       "lists the addresses, times an upload, reads the run's spec, and ends with one line per "
                       "problem naming its fix. Exit code 0 only when a join from here would work.")
    add_config_args(p, doctor_options())
    p.set_defaults(func=cmd_doctor)


def _fail(error: BaseException | str) -> int:
    print(f"p2p-diloco doctor: error: {error}", file=sys.stderr)
    return 2


def cmd_doctor(args: argparse.Namespace) -> int:
    import asyncio
    import json

    try:
        config = load_config(DoctorConfig(), args, "doctor").validate()
    except ValueError as err:
        return _fail(err)

    def report(line: str) -> None:
        if not config.json:
            print(line, flush=True)

    report(f"doctor: {len(config.network.bootstrap)} bootstrap(s), run '{config.run_id}'")
    try:
        diagnosis = asyncio.run(run_doctor(config, report))
    except Exception as err:  # a check that broke: one line (the traceback with --verbose), never a silent pass
        if getattr(args, "verbose", False):
            raise
        return _fail(f"{type(err).__name__}: {err} (run with -v for details)")
    if config.json:
        print(json.dumps(diagnosis.to_dict(), indent=1, default=str))
        return 0 if diagnosis.ok else 1
    for finding in diagnosis.findings:
        print(f"problem: {finding.problem} -> fix: {finding.fix}")
    print(verdict(diagnosis), flush=True)
    return 0 if diagnosis.ok else 1


def verdict(diagnosis: Diagnosis) -> str:
    if diagnosis.ok:
        return f"verdict: OK, a join from here would work (this host is {diagnosis.reachability})"
    if not any(b.reachable for b in diagnosis.bootstraps):
        why = "no bootstrap is reachable"
    else:
        why = f"this host is {diagnosis.reachability}"
    return f"verdict: NOT OK, a join from here would not work: {why} (fixes above)"


async def run_doctor(config: DoctorConfig, report: Report) -> Diagnosis:
    """Steps a-b (no node), then a node started as `join` would start it, steps d-g on it; the Diagnosis."""
    import asyncio
    import dataclasses
    import tempfile

    from p2p_diloco.net.discovery.bootstraps import Finding, check_bootstraps
    from p2p_diloco.net.discovery.doctor import Diagnosis, diagnose
    from p2p_diloco.net.discovery.records import PeerRecordValidator
    from p2p_diloco.net.transport.addresses import node_config
    from p2p_diloco.net.transport.node import NodeError, SwarmNode
    from p2p_diloco.wire.identity import Identity, IdentityError

    checks, findings = await check_bootstraps(config.network.bootstrap, config.timeout_s, report)
    reachable = tuple(c.address for c in checks if c.reachable)
    if not reachable:
        report("node      not started: no bootstrap to start it with")
        return Diagnosis(bootstraps=checks, findings=findings)
    network = dataclasses.replace(config.network, bootstrap=reachable,
                                  start_timeout_s=max(config.timeout_s, _MIN_START_TIMEOUT_S))
    with tempfile.TemporaryDirectory(prefix="p2p-diloco-doctor-") as tmp:
        try:
            # Client mode: the doctor leaves in seconds and should not enter the swarm's DHT routing tables.
            node_cfg = dataclasses.replace(node_config(network), client_mode=True)
            identity_path = _identity_path(config.network.identity, tmp, Identity)
            node = await SwarmNode.start(identity_path, node_cfg,
                                         record_validators=[PeerRecordValidator([config.run_id])])
        except (NodeError, IdentityError, OSError, RuntimeError, asyncio.TimeoutError) as err:
            why = str(err) or type(err).__name__
            report(f"node      did not start: {why}")
            findings.append(Finding(f"a node with these options did not start: {why}",
                                    "fix what the message names, then run doctor again"))
            return Diagnosis(bootstraps=checks, findings=findings)
        try:
            report(f"node      started as {node.peer_id}")
            diagnosis = await diagnose(node, checks, run_id=config.run_id, timeout_s=config.timeout_s,
                                       relay_wait_s=config.relay_wait_s, report=report,
                                       upload_bytes=int(config.upload_mib * (1 << 20)))
        finally:
            await node.shutdown()
    diagnosis.findings[:0] = findings
    return diagnosis


def _identity_path(identity: str, tmp: str, identity_cls: type[Identity]) -> str:
    """The --identity file (created if missing, never overwritten), or a throwaway one in `tmp`."""
    from pathlib import Path

    if identity:
        path = Path(identity).expanduser()
        identity_cls.load_or_create(path)
        return str(path)
    path = Path(tmp) / "doctor.key"
    identity_cls.generate().save(path)
    return str(path)
