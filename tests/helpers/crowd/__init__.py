"""A crowd of cheap identities against an open run (tests/net/test_crowd.py, test_fair_share.py and
benchmarks/bench_crowd.py, bench_uplink.py).

In an open run an identity costs nothing, so the attacker is a crowd: each identity its own Ed25519 key and
libp2p host, speaking the run's real RPCs. Here each one is a bare hivemind `P2P` (one p2pd daemon, no DHT:
a `SwarmNode` would add a forked DHT process of a few hundred MiB per identity). Measured on the 2-core test
machine (PSS, shared pages counted once): 46-50 MiB per daemon, and 0.3-0.7 s of start per identity, 8 started
at once; the Python side adds ~0.2 MiB per identity, a worker process ~200 MiB. 12 identities start in 2-7 s;
100 in two workers take 45-70 s and ~6.1 GiB (61 MiB per identity, workers included). Memory would allow ~300
here; the two cores are the limit (100 idle daemons already load them).

Behaviours (each covers every identity of the crowd; `quiet()` stops them all):
  stall(targets)          every `interval_s` (0.5 s), announce to each target a vector naming an update of our
                          own it lacks (`{own id: n}`, n growing); when it pulls, read its request and never
                          answer, holding the stream open (up to `hold_s`, or until the puller gives up)
  flood(targets)          pull everything from each target in a loop (an empty vector), reading every stream
                          to its end; bytes counted per identity and per target
  claim_holes(targets, v) announce `v` (a vector with holes naming real updates, as repair sees one) every
                          `interval_s`
  advertise(node)         a signed DHT record for every identity, stored through one SwarmNode (the DHT
                          validator checks the signature against the subkey, not who stores it), so the crowd
                          counts as members with records (repair's votes, `status`)
Every identity also serves `announce` (an ack) and, when not stalling, `pull` (nothing: END at once), so an
honest peer that pulls from it (anti-entropy, a pull back) gets a quick empty answer.

Processes: `processes=0` runs the identities on the caller's event loop; `processes=k` spreads them over k
worker processes (`python -m tests.helpers.crowd.worker RUN_ID`, JSON lines on stdin/stdout), so the crowd's own
Python work does not share the GIL with honest peers measured in the caller's process. A worker runs in its
own session and exits when its stdin closes (the parent died); `close()` asks each to stop, then kills its
whole process group (its p2pd daemons with it); in-process daemons are shut down, then SIGKILLed by pid.
`leftover_daemons(workdir)` lists any p2pd still running with a key of ours (the tests assert none).

Honest peers for the scenarios (`start_honest`): SwarmNode + Replica + Intake + UpdateStore + PeerGuard +
Gossip on the caller's loop, as PeerNetwork composes them minus training; `publish_loop` makes each publish a
signed update every `every_s`, and `LagMeter` samples how far each lags behind the others' published seqs.

Modules: group.py (the identities of one event loop and their behaviours), worker.py (a group in a child process),
crowd.py (`Crowd`: groups here or in workers), honest.py (honest peers, `publish_loop`, `LagMeter`), scenarios.py
(`engage`, `measure`, `disengage`).
"""
