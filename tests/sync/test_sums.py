"""Group sums (issue 26): exact whatever the grouping, signed and naming their parts, merged all at once or not at
all, and a lying aggregator caught by an audit anyone can re-check."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.config import preset
from p2p_diloco.sync.aggregate import build_sum, sum_parts, sum_total
from p2p_diloco.sync.exact_sum import ExactSum, decode_grid, from_grid, to_grid
from p2p_diloco.sync.replica import Replica
from p2p_diloco.sync.sum_audit import audit, verify_lie
from p2p_diloco.wire.codecs import get_codec
from p2p_diloco.wire.envelope import OuterUpdate, WireError, make_update
from p2p_diloco.wire.identity import Identity
from p2p_diloco.wire.merkle import CHUNK, chunk_bytes, chunk_count, merkle_proof, merkle_root, verify_chunk
from p2p_diloco.wire.sums import GroupSum, decode_sum, make_sum

NUMEL = 3 * CHUNK + 100  # four chunks, the last one short
BASE = preset("test")
EXACT = dataclasses.replace(BASE, run_id="sums", defence=dataclasses.replace(BASE.defence, copy_cosine=0.0))
CODEC = get_codec(EXACT.outer.codec, EXACT.outer.codec_block)
KEYS = [Identity.generate() for _ in range(6)]


def update(key: Identity, seq: int, seed: int, spec=EXACT) -> OuterUpdate:
    delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * 0.01
    return make_update(run_id=spec.run_id, spec_hash=spec.spec_hash(), seq=seq, tau=0, samples=8, weight=0.5,
                       codec=CODEC.name, numel=NUMEL, payload=CODEC.compress(delta), identity=key)


def replica(spec=EXACT) -> Replica:
    return Replica.from_spec(spec, torch.linspace(-1.0, 1.0, NUMEL), codec=CODEC)


def signed_sum(agg: Identity, direct: list[OuterUpdate], children: list[GroupSum] = (), epoch: int = 0) -> GroupSum:
    s = build_sum(identity=agg, run_id=EXACT.run_id, spec_hash=EXACT.spec_hash(), epoch=epoch, numel=NUMEL,
                  direct=direct, children=list(children), step_of=replica().exact_step)
    assert s is not None
    return s


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 9), st.integers(0, 2**31 - 1))
def test_an_exact_sum_has_the_same_bits_whatever_the_grouping(n, seed):
    rng = torch.Generator().manual_seed(seed)
    scales = [10.0 ** float(torch.randint(-6, 0, (1,), generator=rng)) for _ in range(n)]
    steps = [torch.randn(257, generator=rng) * scale for scale in scales]
    flat = ExactSum(257)
    for s in steps:
        flat.add(s)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    cut = 1 + seed % (n - 1)
    halves = []
    for group in (order[:cut], order[cut:]):
        part = ExactSum(257)
        for i in group:
            part.add(steps[i])
        halves.append(part)
    nested = ExactSum(257)
    for part in reversed(halves):
        nested.add_grid(decode_grid(part.encode(), 257))
    assert flat.encode() == nested.encode()
    assert torch.allclose(from_grid(flat.total), torch.stack(steps).sum(0), atol=n * 2.0**-24)


def test_a_step_off_the_grid_is_refused():
    with pytest.raises(ValueError):
        to_grid(torch.tensor([200.0]))
    with pytest.raises(ValueError):
        to_grid(torch.tensor([float("nan")]))


def test_every_chunk_proves_itself_and_nothing_else_does():
    payload = torch.arange(NUMEL, dtype=torch.int32).numpy().tobytes()
    root = merkle_root(payload, NUMEL)
    for i in range(chunk_count(NUMEL)):
        data, proof = chunk_bytes(payload, i), merkle_proof(payload, NUMEL, i)
        assert verify_chunk(root, NUMEL, i, data, proof)
        assert not verify_chunk(root, NUMEL, (i + 1) % chunk_count(NUMEL), data, proof)
        forged = bytes([data[0] ^ 1]) + data[1:]
        assert not verify_chunk(root, NUMEL, i, forged, proof)


def test_a_sum_names_its_parts_by_their_authors_signatures():
    parts = [update(k, 1, i) for i, k in enumerate(KEYS[:3])]
    s = signed_sum(KEYS[5], parts)
    got = decode_sum(s.encoded, run_id=EXACT.run_id, spec_hash=EXACT.spec_hash(), numel=NUMEL)
    assert got.sum_id == s.sum_id and got.aggregator == KEYS[5].peer_id
    assert [p.update_id for p in got.header.parts] == [u.update_id for u in sorted(parts, key=lambda u: (u.sender, 1))]
    with pytest.raises(WireError, match="bad_digest"):  # a payload it did not sign
        decode_sum(dataclasses.replace(s, payload=bytes(len(s.payload))).encoded, run_id=EXACT.run_id,
                   spec_hash=EXACT.spec_hash(), numel=NUMEL)
    other = make_sum(identity=KEYS[4], run_id=EXACT.run_id, spec_hash=EXACT.spec_hash(), epoch=0,
                     heralds=[p.herald for p in s.header.parts], children=[], payload=s.payload, numel=NUMEL)
    with pytest.raises(WireError, match="bad_signature"):  # another aggregator's signature on this header
        decode_sum(dataclasses.replace(s, signature=other.signature).encoded, run_id=EXACT.run_id,
                   spec_hash=EXACT.spec_hash(), numel=NUMEL)
    with pytest.raises(WireError, match="wrong_run"):
        decode_sum(s.encoded, run_id="another", spec_hash=EXACT.spec_hash(), numel=NUMEL)
    with pytest.raises(WireError):  # a herald forged for another author fails its own signature
        forged = bytearray(s.header.parts[0].herald)
        forged[-1] ^= 1
        make_sum(identity=KEYS[5], run_id=EXACT.run_id, spec_hash=EXACT.spec_hash(), epoch=0,
                 heralds=[bytes(forged)], children=[], payload=s.payload, numel=NUMEL)


def test_a_sum_merges_to_what_its_parts_merge_to_one_by_one():
    parts = [update(k, seq, 10 * i + seq) for i, k in enumerate(KEYS[:4]) for seq in (1, 2)]
    one_by_one, summed = replica(), replica()
    for u in parts:
        assert one_by_one.offer(u)[0].value == "merged"
    inner = signed_sum(KEYS[4], [u for u in parts if u.sender in (KEYS[0].peer_id, KEYS[1].peer_id)])
    total = signed_sum(KEYS[5], [u for u in parts if u.sender not in (KEYS[0].peer_id, KEYS[1].peer_id)], [inner])
    assert len(total.header.parts) == 8
    outcome = summed.offer_sum(sum_parts(total), sum_total(total))
    assert outcome.merged
    assert summed.version_vector == one_by_one.version_vector
    assert torch.allclose(summed.theta, one_by_one.theta, atol=1e-6)
    assert summed.merged_weight(KEYS[0].peer_id, 1) == 0.25  # probation by seq, as one by one
    again = summed.offer_sum(sum_parts(total), sum_total(total))
    assert not again.merged and again.reason == "held"  # no slot twice, through two sums
    assert summed.offer(parts[0])[0].value == "duplicate"  # nor through a sum and a pull
    # An author merged its own updates when it published them: the total takes them out by their exact steps.
    author = replica()
    own = {(u.sender, u.seq): u for u in parts if u.sender == KEYS[2].peer_id}
    for u in own.values():
        author.offer(u)
    assert author.offer_sum(sum_parts(total), sum_total(total)).reason == "held"  # without its store: refused
    assert author.offer_sum(sum_parts(total), sum_total(total), held=lambda a, s: own.get((a, s))).merged
    assert author.version_vector == one_by_one.version_vector
    assert torch.allclose(author.theta, one_by_one.theta, atol=1e-6)


def test_a_sum_ahead_of_the_vector_leaves_holes_that_the_late_sum_fills():
    """A total that overtook (or outlived) the one before it merges at once and leaves the seqs between as holes;
    the earlier total fills them late, and the replica ends equal to one that merged every part in order. Before,
    such a total waited on the gap, and a lost total held every later one back (BENCHMARKS "The tree's delay")."""
    a, b = KEYS[0], KEYS[1]
    first = signed_sum(KEYS[5], [update(a, 1, 1), update(b, 1, 2)])
    later = signed_sum(KEYS[5], [update(a, 2, 3), update(a, 3, 4), update(b, 2, 5)])
    r, in_order = replica(), replica()
    assert r.offer_sum(sum_parts(later), sum_total(later)).merged  # seq 2 and 3 of a, 2 of b, before their seq 1
    assert r.version_vector.holes(a.peer_id) == {1} and r.version_vector.holes(b.peer_id) == {1}
    assert r.stats["sum_holes_opened"] == 2
    assert r.offer_sum(sum_parts(first), sum_total(first)).merged  # the late total fills both holes
    for s in (first, later):
        assert in_order.offer_sum(sum_parts(s), sum_total(s)).merged
    assert r.version_vector == in_order.version_vector and not r.version_vector.n_holes
    assert torch.allclose(r.theta, in_order.theta, rtol=0, atol=1e-6)  # float theta: to rounding, either order
    assert not r.offer_sum(sum_parts(first), sum_total(first)).merged  # and never twice


def test_a_sum_that_does_not_fit_the_vector_merges_nothing():
    r = replica()
    far = signed_sum(KEYS[5], [update(KEYS[0], r.max_hole_span + 2, 1)])  # more seqs ahead than a hole may span
    before = r.theta.clone()
    assert r.offer_sum(sum_parts(far), sum_total(far)).reason == "gap"
    assert torch.equal(r.theta, before) and r.version_vector.get(KEYS[0].peer_id) == 0
    buffered = replica()  # a skipped seq waiting in the buffer (a direct update before its own gap) is not a hole
    assert buffered.offer(update(KEYS[0], 2, 2))[0].value == "buffered"
    third = signed_sum(KEYS[5], [update(KEYS[0], 3, 3)])
    assert buffered.offer_sum(sum_parts(third), sum_total(third)).reason == "gap"
    assert buffered.version_vector.get(KEYS[0].peer_id) == 0
    vetting = replica(dataclasses.replace(EXACT, defence=BASE.defence))  # the copy rule reads payloads
    first = signed_sum(KEYS[5], [update(KEYS[0], 1, 1)])
    assert vetting.offer_sum(sum_parts(first), sum_total(first)).reason == "inexact"


def test_a_lying_aggregator_is_caught_and_the_proof_holds_anywhere():
    leaves = [update(k, 1, i) for i, k in enumerate(KEYS[:4])]
    child = signed_sum(KEYS[4], leaves[:2])
    honest = signed_sum(KEYS[5], leaves[2:], [child])
    auditor = replica()
    chunks = range(chunk_count(NUMEL))
    assert audit(honest, [child], leaves[2:], auditor.exact_step, chunks) is None
    # The liar adds a little of its own direction to one chunk: every part and weight it names is still true.
    values = decode_grid(honest.payload, NUMEL).clone()
    values[CHUNK + 7] += 5000
    lie = make_sum(identity=KEYS[5], run_id=EXACT.run_id, spec_hash=EXACT.spec_hash(), epoch=0,
                   heralds=[p.herald for p in honest.header.parts], children=[child],
                   payload=values.to(torch.int32).numpy().tobytes(), numel=NUMEL)
    found = audit(lie, [child], leaves[2:], auditor.exact_step, chunks)
    assert found is not None and found.index == 1 and found.aggregator == KEYS[5].peer_id
    assert verify_lie(found, replica().exact_step)  # another replica, from the evidence alone
    assert audit(lie, [child], leaves[2:], auditor.exact_step, [0, 2, 3]) is None  # a chunk not drawn: unseen
    framed = dataclasses.replace(found, claimed=dataclasses.replace(found.claimed, sum=honest))
    assert not verify_lie(framed, replica().exact_step)  # an honest aggregator cannot be framed with it
    with pytest.raises(ValueError):
        audit(honest, [child], leaves[3:], auditor.exact_step, chunks)
