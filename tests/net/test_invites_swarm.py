"""A run that admits by invitation, with real `p2p-diloco` processes on 127.0.0.1.

The operator makes a key and invites A (`p2p-diloco invite`); A starts the run with `--operators` and its
invitation. V, a volunteer invited while the run goes on, joins with `--invite` alone (no new spec, no
--operators: the invitation names its signer) and A merges its updates. U, uninvited, is refused and told why.
Then the operator revokes V (`p2p-diloco revoke --bootstrap`): A carries the revocation in its record, and V,
restarted, is refused with the reason. The fast representative is tests/net/test_invites_loopback.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from p2p_diloco.net.admission.invites import REVOKED_FIELD
from p2p_diloco.net.discovery.records import PeerRecordValidator, list_peers
from p2p_diloco.net.discovery.status import counts
from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
from p2p_diloco.wire.identity import Identity
from tests.helpers.swarm import Launcher, Proc, cli, wait_until

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

RUN = "invited"
START_S = 150  # start-up of a process on a loaded 2-core machine, with margin


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(cli(*args), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _invite(workdir: Path, operator: Path, name: str) -> tuple[str, str]:
    """A fresh identity for `name` and the operator's invitation of it: (its PeerID, the invitation file)."""
    identity = Identity.generate()
    identity.save(workdir / f"{name}.key")
    out = workdir / f"{name}.invite"
    _run_cli("invite", "--operator-key", str(operator), "--peer", identity.peer_id, "--run-id", RUN,
             "--ttl-days", "1", "--out", str(out))
    return identity.peer_id, str(out)


def _refused(proc: Proc, why: str) -> None:
    """`proc` (a join) exits with code 2 and a last line that says why: its admission check's refusal, or the
    same refusal from the donors it then asked for the state (when its first read of the DHT found no peer)."""
    assert proc.wait(START_S) == 2, proc.tail()
    last = proc.output().strip().splitlines()[-1]
    assert last.startswith("p2p-diloco join: error: ") and f"not allowed in this run: {why}" in last, proc.tail()


def test_an_invited_volunteer_joins_a_running_run_and_a_revoked_one_is_refused(loop, tmp_path) -> None:
    operator = tmp_path / "operator.key"
    _run_cli("keygen", "--identity", str(operator))
    op_id = Identity.load(operator).peer_id
    a_id, a_invite = _invite(tmp_path, operator, "A")
    with Launcher(tmp_path) as launcher:
        _, bootstrap = launcher.bootstrap()
        observer = loop.run(_observer(tmp_path, bootstrap), timeout_s=90)
        try:
            a = launcher.peer("A", bootstrap, "--run-id", RUN, "--operators", op_id, "--invite", a_invite,
                              linger_s=5, nice=10)
            a.wait_rounds(1, START_S)
            # Invited while the run goes on; V knows only its invitation.
            v_id, v_invite = _invite(tmp_path, operator, "V")
            v_args = ("--run-id", RUN, "--invite", v_invite)
            v = launcher.peer("V", bootstrap, *v_args, linger_s=5)

            def records() -> dict[str, dict]:
                return loop.run(list_peers(observer, RUN, timeout_s=10), timeout_s=30)

            wait_until(lambda: counts(records().get(a_id, {}), "vv").get(v_id, 0) >= 1, START_S,
                       "A to merge an update of the invited V", procs=[a, v])
            u = launcher.peer("U", bootstrap, "--run-id", RUN, linger_s=5)  # uninvited
            _refused(u, "no invitation: this run admits the peers its operators invite")

            _run_cli("revoke", "--operator-key", str(operator), "--peer", v_id, "--run-id", RUN,
                     "--bootstrap", bootstrap)
            wait_until(lambda: records().get(a_id, {}).get(REVOKED_FIELD), 60, "A to carry the revocation",
                       procs=[a])
            v.kill_group()
            _refused(launcher.restart(v, "V-again"), "invitation revoked by the run's operator")
            assert a.returncode is None, a.tail()
            a.interrupt()
            assert a.wait(60) == 0, a.tail()
        finally:
            loop.run(observer.shutdown(), timeout_s=30)


async def _observer(workdir: Path, bootstrap: str) -> SwarmNode:
    path = str(workdir / "observer.key")
    Identity.generate().save(path)
    config = NodeConfig(initial_peers=(bootstrap,), client_mode=True, start_timeout_s=60)
    return await SwarmNode.start(path, config, record_validators=[PeerRecordValidator([RUN])])
