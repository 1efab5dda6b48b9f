"""The tests' own helpers, importable as `tests.helpers.*` (pyproject's pytest `pythonpath` puts the repository
root on the path; the benchmarks put it there themselves).

net.py       an asyncio loop in a daemon thread, and SwarmNodes on it (the in-process network tests)
swarm.py     real `p2p-diloco` processes: `Launcher`, `Proc`, `wait_until`
faults.py    what a fault scenario asserts about those processes (`assert_replicas_agree`...)
netns.py     hosts in Linux network namespaces, with or without NAT (`NetnsTopology`, `NatTopology`)
hostile.py   `HostilePeer`: the real protocol, spoken by an attacker
crowd/       a crowd of cheap identities against an open run, and honest peers to measure under it
fakes.py     stand-ins for the sync layer's inputs (`FakeUpdate`)
"""
