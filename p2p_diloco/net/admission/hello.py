"""Admission (`hello`): before it joins, a joiner asks a few live peers whether it may take part.

The hello RPC does nothing itself: the guard in front of it refuses non-members with the reason, which starts
with REFUSED_PREFIX. If every peer that answers refuses the joiner, `join` stops with their reason
(`AccessDenied`). One hostile peer that refuses everyone cannot keep a member out unless it is the only peer the
joiner asks.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

from hivemind.p2p import P2P

from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.admission.membership import REFUSED_PREFIX
from p2p_diloco.net.admission.policy import RECORD_NOT_SEEN
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import NodeError

HELLO_ASKED = 3
"""Live peers a joiner asks for admission."""
HELLO_OK = b"welcome"
HELLO_TRIES = 4
HELLO_RETRY_S = 2.0
"""Asked again after 2, 4, 6 s while every refusal says our record was not found yet (12 s of the DHT's time
to show a record just announced)."""


class AccessDenied(NodeError):
    """This peer may not take part in the run (allow list, run secret or invitation); the message says why and
    what to do, in one line."""


def hello_name(run_id: str) -> str:
    return f"p2p-diloco/{run_id}/hello"


async def serve_hello(p2p: P2P, run_id: str, guard: PeerGuard, timeout_s: float) -> rpc.RpcStats:
    """Answer admission checks: the guard refuses non-members before the handler runs."""
    async def rpc_hello(request: bytes, caller: str) -> bytes:
        return HELLO_OK

    return await rpc.serve(p2p, hello_name(run_id), rpc_hello, max_request_bytes=64, timeout_s=timeout_s,
                           max_concurrent=16, guard=guard, min_bytes_per_s=guard.limits.min_stream_bytes_per_s)


async def ask_admission(p2p: P2P, run_id: str, peers: Sequence[str], timeout_s: float) -> dict[str, str]:
    """Ask up to HELLO_ASKED of `peers` whether we may take part; {peer: "ok" | refusal | "no answer: ..."}.

    Raises AccessDenied when every peer that answered refused us with an access refusal.
    """
    asked = random.sample(list(peers), min(HELLO_ASKED, len(peers)))

    async def ask(peer: str) -> str:
        try:
            await rpc.call(p2p, peer, hello_name(run_id), b"", max_response_bytes=64, timeout_s=timeout_s)
            return "ok"
        except rpc.RpcRemoteError as e:
            return e.remote_message
        except Exception as e:  # RpcError, or an old peer without the handler: no verdict
            return f"no answer: {e}"

    for attempt in range(1, HELLO_TRIES + 1):
        answers = dict(zip(asked, await asyncio.gather(*(ask(p) for p in asked))))
        verdicts = [a for a in answers.values() if not a.startswith("no answer")]
        refusals = [a for a in verdicts if a.startswith(REFUSED_PREFIX)]
        # Our record was announced just before: a busy peer's read of the DHT may not hold it yet.
        if attempt == HELLO_TRIES or not refusals or not all(RECORD_NOT_SEEN in r for r in refusals):
            break
        await asyncio.sleep(HELLO_RETRY_S * attempt)
    if verdicts and len(refusals) == len(verdicts):
        raise AccessDenied(f"{refusals[0]} (refused by {len(refusals)} of {len(asked)} live peer(s) asked)"
                           + _what_to_do(refusals[0]))
    return answers


def _what_to_do(refusal: str) -> str:
    if "invitation" in refusal or "operator" in refusal:  # those reasons say what to do (net/admission/invites.py)
        return ""
    return (". Ask the run's operator to add your PeerID (`p2p-diloco id`) to the allow list, or for the run "
            "secret (--run-secret-file)")
