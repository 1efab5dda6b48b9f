"""An audit's question and answer (sync/sum_audit.py checks the answer), shared by the simulator's audits
(sim/audits.py) and the real peer's (net/gossip/tree_audits.py), so both ask and judge alike.

The question is a sum's id and the chunk indices the auditor drew from a secret of its own and that id
(`draw_chunks`: the aggregator signed the sum before it could know them). The answer is the sum's inputs at
those chunks: its direct parts as their signed updates, and its children's signed headers, each with the drawn
chunks and their Merkle proofs. Everything in it is signed by someone else, so an aggregator can only answer
truly or not at all.

    answer = msgpack {"id": sum_id, "d": [encoded update], "k": [[header_bytes, signature, [[i, chunk, [proof]]]]]}
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import msgpack

from p2p_diloco.sync.sum_audit import ChunkProof, StepOf, SumLie, audit_chunks, prove_chunk
from p2p_diloco.wire.envelope import OuterUpdate, decode_update, encode_update
from p2p_diloco.wire.merkle import chunk_count
from p2p_diloco.wire.sums import MAX_CHILDREN, GroupSum, decode_sum_header

CHUNKS = 4
"""Chunks an auditor draws per sum."""


def draw_chunks(secret: int, s: GroupSum, k: int = CHUNKS) -> list[int]:
    """The chunk indices an auditor with `secret` checks `s` at (nobody else can predict them)."""
    seed = hashlib.sha256(secret.to_bytes(32, "big") + s.sum_id).digest()
    n = chunk_count(s.header.numel)
    return sorted(random.Random(seed).sample(range(n), min(k, n)))


def encode_ask(s: GroupSum, indices: Sequence[int]) -> bytes:
    data: bytes = msgpack.packb({"id": s.sum_id, "j": list(indices)}, use_bin_type=True)
    return data


def decode_ask(data: bytes) -> tuple[bytes, list[int]]:
    """(sum_id, chunk indices); ValueError if malformed."""
    try:
        m = msgpack.unpackb(data, raw=False, max_bin_len=64, max_array_len=4 * CHUNKS, max_map_len=2)
    except Exception as exc:  # untrusted bytes
        raise ValueError(f"cannot parse an audit question: {type(exc).__name__}") from None
    if not (isinstance(m, dict) and isinstance(m.get("id"), bytes) and isinstance(m.get("j"), list)
            and all(type(i) is int and i >= 0 for i in m["j"])):
        raise ValueError("an audit question is {id, j}")
    return m["id"], m["j"]


def encode_answer(sum_id: bytes, direct: Sequence[OuterUpdate], children: Sequence[GroupSum],
                  indices: Sequence[int]) -> bytes:
    """The inputs of the sum `sum_id` at `indices` (the aggregator's side)."""
    def chunks(c: GroupSum) -> list[list[object]]:
        return [[i, (p := prove_chunk(c, i)).data, list(p.proof)] for i in indices]
    data: bytes = msgpack.packb({"id": sum_id, "d": [encode_update(u) for u in direct],
                                 "k": [[c.header_bytes, c.signature, chunks(c)] for c in children]},
                                use_bin_type=True)
    return data


def judge_answer(s: GroupSum, indices: Sequence[int], answer: bytes, step_of: StepOf, *, run_id: str,
                 spec_hash: str, max_update_bytes: int) -> SumLie | None:
    """Check `s` at `indices` against the aggregator's `answer`: the evidence if it lies, None if it holds;
    ValueError if the answer does not hold together (not the inputs `s` names, a chunk that does not prove
    itself, bad signatures): the auditor drops the sum, as it does an unanswered one."""
    numel = s.header.numel
    try:
        m = msgpack.unpackb(answer, raw=False, max_bin_len=len(answer), max_map_len=3)
    except Exception as exc:  # untrusted bytes
        raise ValueError(f"cannot parse an audit answer: {type(exc).__name__}") from None
    if not (isinstance(m, dict) and m.get("id") == s.sum_id and isinstance(m.get("d"), list)
            and isinstance(m.get("k"), list) and len(m["k"]) <= MAX_CHILDREN):
        raise ValueError("an audit answer is {id, d, k} for the sum asked about")
    direct = [decode_update(d, max_bytes=max_update_bytes, run_id=run_id, spec_hash=spec_hash) for d in m["d"]]
    children: list[GroupSum] = []
    proofs: dict[int, list[ChunkProof]] = {i: [] for i in indices}
    for item in m["k"]:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[2], list)):
            raise ValueError("a child's entry is [header, signature, chunks]")
        header = decode_sum_header(item[0], item[1], run_id=run_id, spec_hash=spec_hash, numel=numel)
        child = GroupSum(header, item[0], item[1], b"")
        children.append(child)
        for chunk in item[2]:
            if not (isinstance(chunk, list) and len(chunk) == 3 and isinstance(chunk[1], bytes)
                    and isinstance(chunk[2], list) and all(isinstance(h, bytes) for h in chunk[2])):
                raise ValueError("a chunk is [index, data, proof]")
            proofs.setdefault(chunk[0], []).append(ChunkProof(child, chunk[1], tuple(chunk[2])))
    return audit_chunks(s, children, proofs, direct, step_of, indices)
