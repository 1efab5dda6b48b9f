"""Auditing a group sum, and the evidence that an aggregator lied (ARCHITECTURE.md "Aggregation").

A sum is exact (sync/exact_sum.py), so "is this the sum of what it names" has one answer, bit for bit, on every
machine. An auditor holding a sum's inputs (its child sums and the updates its aggregator added itself, the
*direct* parts) recomputes a chunk and compares. A chunk proves itself against the root a signed header names
(wire/merkle.py), so a check needs only the chunks it draws, and a mismatch is **evidence anyone can verify**:
the lying sum's signed header with that chunk and its proof, each child's signed header with the same chunk and
proof, and the direct parts as whole signed updates. It is re-checked on receipt like an equivocation proof and
acted on alike (the aggregator banned; a total it signed is never merged).

What the aggregator cannot misstate at all: which updates it covers (each part is its author's signed herald) and
the weight each merges with (the merge rule's, from the part's own header). What it can do and the audit sees:
put anything else in the payload. What this module does not see: a member's update it left out (that takes the
member's signed receipt: not built). Encoded for the wire by `encode_lie` / `decode_lie`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import msgpack
import torch
from torch import Tensor

from p2p_diloco.sync.exact_sum import decode_grid
from p2p_diloco.sync.types import UpdateLike
from p2p_diloco.wire.envelope import OuterUpdate, decode_update, encode_update
from p2p_diloco.wire.merkle import CHUNK, chunk_bytes, merkle_proof, verify_chunk
from p2p_diloco.wire.sums import GroupSum, decode_sum_header

StepOf = Callable[[UpdateLike], Tensor | None]
"""An update's exact merge step on the grid (`Replica.exact_step`); None if it is refused."""


@dataclass(frozen=True)
class ChunkProof:
    """Chunk `index` of a sum's payload, provable against the root its signed header names."""

    sum: GroupSum  # its header and signature are what count; the payload may be absent (b"")
    data: bytes
    proof: tuple[bytes, ...]

    def valid(self, index: int) -> bool:
        return verify_chunk(self.sum.header.root, self.sum.header.numel, index, self.data, list(self.proof))


@dataclass(frozen=True)
class SumLie:
    """Evidence that `claimed` is not, at chunk `index`, its children's chunks plus its direct parts' steps."""

    index: int
    claimed: ChunkProof
    children: tuple[ChunkProof, ...]
    direct: tuple[UpdateLike, ...]

    @property
    def aggregator(self) -> str:
        return self.claimed.sum.aggregator


def prove_chunk(s: GroupSum, index: int) -> ChunkProof:
    """Chunk `index` of a sum whose payload we hold, with its proof."""
    return ChunkProof(s, chunk_bytes(s.payload, index), tuple(merkle_proof(s.payload, s.header.numel, index)))


def direct_slots(s: GroupSum, children: Sequence[GroupSum]) -> set[tuple[str, int]] | None:
    """The slots `s` adds itself: its parts less its children's; None if the children are not the ones it names
    or their parts are not all among its own (that alone is a malformed sum: refuse it)."""
    named = {c.sum_id for c in children}
    if named != {sid for sid, _ in s.header.children} or len(named) != len(children):
        return None
    mine = set(s.header.slots)
    theirs = [slot for c in children for slot in c.header.slots]
    if len(theirs) != len(set(theirs)) or not set(theirs) <= mine:
        return None
    return mine - set(theirs)


def named_inputs(s: GroupSum, children: Sequence[GroupSum], direct: Sequence[UpdateLike]) -> bool:
    """True if `children` and `direct` are exactly the inputs `s` names, each direct part the very update."""
    slots = direct_slots(s, children)
    if slots is None or slots != {(u.sender, u.seq) for u in direct} or len(direct) != len(slots):
        return False
    ids = {p.slot: p.update_id for p in s.header.parts}
    return all(ids[(u.sender, u.seq)] == u.update_id for u in direct)


def expected_chunk(index: int, numel: int, children: Sequence[bytes], direct: Sequence[Tensor]) -> bytes:
    """What chunk `index` of a sum must be: its children's chunks plus its direct parts' steps, as int32 bytes."""
    lo, hi = index * CHUNK, min(numel, (index + 1) * CHUNK)
    total = torch.zeros(hi - lo, dtype=torch.int64)
    for data in children:
        total += decode_grid(data, hi - lo)
    for step in direct:
        total += step[lo:hi]
    return total.to(torch.int32).numpy().astype("<i4").tobytes()


def audit(s: GroupSum, children: Sequence[GroupSum], direct: Sequence[UpdateLike], step_of: StepOf,
          indices: Sequence[int]) -> SumLie | None:
    """Check `s` (payload held) at chunks `indices` against its inputs, held whole: the evidence if it lies.
    ValueError if the inputs are not the ones it names (the caller cannot audit with them)."""
    proofs = {i: [prove_chunk(c, i) for c in children] for i in indices}
    return audit_chunks(s, [c for c in children], proofs, direct, step_of, indices)


def audit_chunks(s: GroupSum, children: Sequence[GroupSum], proofs: dict[int, list[ChunkProof]],
                 direct: Sequence[UpdateLike], step_of: StepOf, indices: Sequence[int]) -> SumLie | None:
    """`audit` with the children's chunks only (each proven against the root `s` names: what an aggregator sends
    its auditor); ValueError if the inputs are not the ones `s` names or a chunk does not prove itself."""
    if not named_inputs(s, children, direct):
        raise ValueError("these are not the inputs the sum names")
    roots = {c.sum_id: c.header.root for c in children}
    steps = [step_of(u) for u in direct]
    for index in indices:
        got = proofs.get(index, [])
        if sorted(c.sum.sum_id for c in got) != sorted(roots) or not all(c.valid(index) for c in got):
            raise ValueError(f"chunk {index} of a child sum is missing or does not prove itself")
        lie = _check(s, index, got, direct, steps)
        if lie is not None:
            return lie
    return None


def verify_lie(lie: SumLie, step_of: StepOf) -> bool:
    """Re-check evidence received from another peer: True only if it proves the lie (signatures were checked
    when each sum was decoded; here: the proofs, the inputs' names, and the arithmetic)."""
    s, index = lie.claimed.sum, lie.index
    if not lie.claimed.valid(index) or not all(c.valid(index) for c in lie.children):
        return False
    if not named_inputs(s, [c.sum for c in lie.children], lie.direct):
        return False
    steps = [step_of(u) for u in lie.direct]
    return _check(s, index, list(lie.children), lie.direct, steps, claimed=lie.claimed) is not None


def _check(s: GroupSum, index: int, children: list[ChunkProof], direct: Sequence[UpdateLike],
           steps: Sequence[Tensor | None], claimed: ChunkProof | None = None) -> SumLie | None:
    claimed = claimed or prove_chunk(s, index)
    if any(step is None for step in steps):  # it added a part the merge rule refuses: as false as a wrong sum
        return SumLie(index, claimed, tuple(children), tuple(direct))
    expected = expected_chunk(index, s.header.numel, [c.data for c in children], [t for t in steps if t is not None])
    if expected == claimed.data:
        return None
    return SumLie(index, claimed, tuple(children), tuple(direct))


def encode_lie(lie: SumLie) -> bytes:
    """The evidence on the wire: signed headers (no payloads), the chunk and its proof for each, and the direct
    parts as their signed envelopes."""
    def proof(c: ChunkProof) -> list[object]:
        return [c.sum.header_bytes, c.sum.signature, c.data, list(c.proof)]
    data: bytes = msgpack.packb({"i": lie.index, "c": proof(lie.claimed), "k": [proof(c) for c in lie.children],
                                 "d": [encode_update(cast(OuterUpdate, u)) for u in lie.direct]}, use_bin_type=True)
    return data


def decode_lie(data: bytes, *, run_id: str, spec_hash: str, numel: int, max_update_bytes: int) -> SumLie:
    """Parse received evidence (every signature checked); WireError or ValueError if it is malformed. Whether it
    proves a lie is `verify_lie`'s."""
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0, max_bin_len=len(data))
    except Exception as exc:  # untrusted bytes
        raise ValueError(f"cannot parse evidence: {type(exc).__name__}") from None
    if not isinstance(m, dict) or set(m) != {"i", "c", "k", "d"} or type(m["i"]) is not int:
        raise ValueError("evidence is a map of i, c, k, d")

    def proof(item: object) -> ChunkProof:
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[2], bytes)
                and isinstance(item[3], list) and all(isinstance(h, bytes) for h in item[3])):
            raise ValueError("a chunk proof is [header, signature, chunk, proof]")
        header = decode_sum_header(item[0], item[1], run_id=run_id, spec_hash=spec_hash, numel=numel)
        return ChunkProof(GroupSum(header, item[0], item[1], b""), item[2], tuple(item[3]))
    direct = tuple(decode_update(d, max_bytes=max_update_bytes, run_id=run_id, spec_hash=spec_hash) for d in m["d"])
    return SumLie(m["i"], proof(m["c"]), tuple(proof(c) for c in m["k"]), direct)
