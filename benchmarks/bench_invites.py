"""What invitations cost, and how fast a revocation reaches a running swarm.

    python benchmarks/bench_invites.py            # the token alone (pure, a second)
    python benchmarks/bench_invites.py --swarm    # also a 2-peer run on 127.0.0.1 (about a minute)

Pure: an invitation's size, one decode + signature check, a member's check of a record whose token it has
verified before, and the record bytes of the MAX_CARRIED revocations a member carries. With --swarm: a bootstrap
and two invited `p2p-diloco join` peers (A, B; the "test" preset) train until A merged B's update; then
`p2p-diloco revoke --bootstrap` revokes B, timed, and an observer node polls A's record until it carries the
revocation (timed from the moment the command returned). Every process runs in its own session and is killed at
the end whatever happened; every wait has a timeout.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2p_diloco.net.admission.invites import (  # noqa: E402
    INVITE_FIELD,
    MAX_CARRIED,
    OPERATORS_FIELD,
    REVOKED_FIELD,
    Invitations,
)
from p2p_diloco.wire.identity import Identity  # noqa: E402
from p2p_diloco.wire.invite import decode_token, make_token  # noqa: E402

RUN = "bench-invites"
DAY_S = 86400.0


def pure(n: int = 2000) -> None:
    operator, invitee = Identity.generate(), Identity.generate().peer_id
    token = make_token("invite", operator, run_id=RUN, peer=invitee, ttl_s=DAY_S)
    print(f"invitation bytes: {len(token.encoded)}")
    per = timeit.timeit(lambda: decode_token(token.encoded, "invite"), number=n) / n
    print(f"decode + signature check: {per * 1e6:.0f} us")
    book = Invitations(RUN, (operator.peer_id,))
    record = {OPERATORS_FIELD: book.digest, INVITE_FIELD: token.encoded}
    per = timeit.timeit(lambda: book.why_not(invitee, record), number=n) / n
    print(f"member check of a record (token verified before): {per * 1e6:.1f} us")
    for _ in range(MAX_CARRIED):
        book.add(make_token("revoke", operator, run_id=RUN, peer=Identity.generate().peer_id, ttl_s=DAY_S))
    print(f"record bytes of {MAX_CARRIED} carried revocations: {len(msgpack.packb(book.record_fields()))}")


def swarm(workdir: Path) -> None:
    from p2p_diloco.net.discovery.records import PeerRecordValidator, list_peers
    from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
    from tests.helpers.net import LoopThread
    from tests.helpers.swarm import Launcher, cli, wait_until

    operator = Identity.generate()
    operator.save(workdir / "operator.key")
    ids = {}
    for name in ("A", "B"):
        identity = Identity.generate()
        identity.save(workdir / f"{name}.key")
        ids[name] = identity.peer_id
        subprocess.run(cli("invite", "--operator-key", str(workdir / "operator.key"), "--peer", identity.peer_id,
                           "--run-id", RUN, "--out", str(workdir / f"{name}.invite")), check=True, capture_output=True)
    loop = LoopThread()
    with Launcher(workdir) as launcher:
        _, bootstrap = launcher.bootstrap()
        procs = [launcher.peer(name, bootstrap, "--run-id", RUN, "--invite", str(workdir / f"{name}.invite"),
                               linger_s=5, nice=10) for name in ("A", "B")]
        Identity.generate().save(workdir / "observer.key")
        config = NodeConfig(initial_peers=(bootstrap,), client_mode=True, start_timeout_s=60)
        observer = loop.run(SwarmNode.start(str(workdir / "observer.key"), config,
                                            record_validators=[PeerRecordValidator([RUN])]), timeout_s=90)
        try:
            def a_record() -> dict:
                return loop.run(list_peers(observer, RUN, timeout_s=10), timeout_s=30).get(ids["A"], {})

            wait_until(lambda: a_record().get("vv", {}).get(ids["B"], 0) >= 1, 300, "A to merge B's update",
                       procs=procs)
            started = time.monotonic()
            done = subprocess.run(cli("revoke", "--operator-key", str(workdir / "operator.key"), "--peer", ids["B"],
                                      "--run-id", RUN, "--bootstrap", bootstrap), capture_output=True, text=True,
                                  timeout=120)
            returned = time.monotonic()
            print(f"revoke --bootstrap (start a node, publish, read back): {returned - started:.1f} s, "
                  f"rc {done.returncode}")
            wait_until(lambda: a_record().get(REVOKED_FIELD), 120, "A to carry the revocation", interval_s=0.1)
            print(f"then until A's record carries it: {time.monotonic() - returned:.1f} s")
        finally:
            loop.run(observer.shutdown(), timeout_s=30)
    loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swarm", action="store_true", help="also time a revocation in a 2-peer run")
    args = parser.parse_args()
    pure()
    if args.swarm:
        workdir = Path(tempfile.mkdtemp(prefix="bench-invites-"))
        try:
            swarm(workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
