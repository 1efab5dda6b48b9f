"""`diagnose` (net/discovery/doctor.py) in-process, against a member serving the probes: a published spec is read
and sized, the upload is timed, and a down bootstrap and a bad address become findings with their fixes."""

from __future__ import annotations

from p2p_diloco.config import preset
from p2p_diloco.net.discovery.bootstraps import BAD_ADDRESS_FIX, DOWN_FIX, check_bootstraps
from p2p_diloco.net.discovery.doctor import PUBLIC, RELAYED, diagnose
from p2p_diloco.net.discovery.records import publish_run_spec
from p2p_diloco.net.discovery.update_size import update_bytes
from p2p_diloco.net.transport.probe import serve_probe, unserve_probe
from tests.helpers.net import closed_tcp_port


def test_diagnose_reads_the_spec_and_names_every_problem(loop, members):
    server, client = members[0].node, members[1].node
    spec = preset("test")
    loop.run(serve_probe(server))
    try:
        assert loop.run(publish_run_spec(server, "doctor-run", spec.to_dict(), spec.spec_hash(), timeout_s=10))
        good = server.visible_maddrs()[0]
        down = f"/ip4/127.0.0.1/tcp/{closed_tcp_port()}/p2p/{server.peer_id}"
        lines: list[str] = []
        checks, findings = loop.run(check_bootstraps([good, down, "/ip4/127.0.0.1/tcp/1"], 5, lines.append))
        assert [c.reachable for c in checks] == [True, False, False]
        assert [f.fix for f in findings] == [BAD_ADDRESS_FIX, DOWN_FIX]
        diagnosis = loop.run(diagnose(client, checks, run_id="doctor-run", timeout_s=10, upload_bytes=64 << 10,
                                      report=lines.append))
    finally:
        loop.run(unserve_probe(server))
    assert diagnosis.ok and diagnosis.reachability == PUBLIC and diagnosis.observed_ip == "127.0.0.1"
    assert diagnosis.upload_bytes_per_s and diagnosis.upload_bytes_per_s > 0
    assert diagnosis.spec is not None and diagnosis.spec.spec_hash == spec.spec_hash()
    assert diagnosis.spec.update_bytes == update_bytes(spec.to_dict())[0]
    assert diagnosis.spec.upload_s is not None and diagnosis.clock_skew_s is not None
    assert abs(diagnosis.clock_skew_s) < 5
    assert any(line.startswith("run       'doctor-run': spec ") and "MB per outer update" in line for line in lines)
    assert diagnosis.to_dict()["ok"] is True


def test_a_host_nobody_can_dial_is_relayed_through_a_bootstrap_that_forwards(loop, members, tmp_path):
    """Announcing only a port nothing listens on: no dial-back works, but the bootstrap's relay reaches us."""
    from p2p_diloco.net.transport.node import NodeConfig, SwarmNode
    from p2p_diloco.net.transport.relay import RelayServer
    from p2p_diloco.wire.identity import Identity

    server = members[2].node
    relay = RelayServer(server.p2p)
    loop.run(serve_probe(server))
    loop.run(relay.start())
    node = None
    try:
        Identity.generate().save(tmp_path / "natted.key")
        closed = closed_tcp_port()
        config = NodeConfig(announce_maddrs=(f"/ip4/127.0.0.1/tcp/{closed}",),
                            initial_peers=(server.visible_maddrs()[0],), client_mode=True, start_timeout_s=30)
        node = loop.run(SwarmNode.start(str(tmp_path / "natted.key"), config))
        checks, _ = loop.run(check_bootstraps([server.visible_maddrs()[0]], 5))
        diagnosis = loop.run(diagnose(node, checks, timeout_s=10, relay_wait_s=0, upload_bytes=0))
    finally:
        if node is not None:
            loop.run(node.shutdown())
        loop.run(relay.stop())
        loop.run(unserve_probe(server))
    assert diagnosis.probed_ports == [closed] and diagnosis.open_ports == []
    assert diagnosis.reachability == RELAYED and diagnosis.ok
    assert any(f"open TCP port {closed}" in f.fix for f in diagnosis.findings)
