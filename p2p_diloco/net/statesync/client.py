"""State sync: a joiner fetches a verified snapshot of (theta, V) from a donor (ARCHITECTURE.md,
"The network").

Protocol and manifest: net/statesync/manifest.py (the donor's side: net/statesync/server.py).

The joiner trusts nothing it has not checked, and never loads a snapshot it could not verify: the manifest's
signature against the donor's PeerID (the one libp2p authenticated for the stream), its run id, spec hash and
numel against its own (it allocates from its own numel, never from a remote's), the chunk count against
numel, the vector's syntax; then every chunk against its digest and every value for finiteness. Any failure
drops that donor (the reason is logged, and counted against the donor by the guard: `bad_manifest`,
`bad_chunk`, `nonfinite_chunk`, or how the call failed), and the joiner starts over with the next one. A
donor that served something unverifiable is also penalized: it is not asked again for a while, so a hostile
donor that claims the freshest replica costs each joiner one attempt. A donor whose snapshot verified is
credited in the guard's ledger (a contributor: its pulls and requests go first). After loading the snapshot, the joiner
pulls the updates newer than its V by gossip.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from p2p_diloco.config.network import StateSyncConfig
from p2p_diloco.net.admission.guard import PeerGuard
from p2p_diloco.net.statesync.manifest import DonorError, Manifest, chunk_name, manifest_name, parse_manifest
from p2p_diloco.net.transport import rpc
from p2p_diloco.net.transport.node import SwarmNode
from p2p_diloco.sync.version_vector import VersionVector

logger = logging.getLogger(__name__)

_PROGRESS_LOG_S = 5.0
BUSY_WAIT_S = 120.0
"""How long one chunk may be refused as busy (retried with 0.5-8 s backoff) before the donor is dropped."""


class StateSyncError(RuntimeError):
    """No donor could serve a verified snapshot; the message lists each donor tried and why it was dropped."""


def check_host() -> None:
    """State sync sends theta as little-endian float32: refuse on a big-endian host."""
    if sys.byteorder != "little":
        raise StateSyncError("state sync sends theta as little-endian float32; this host is big-endian")


# ---------------------------------------------------------------------------------------------- joiner


_UNVERIFIABLE = ("bad_manifest", "bad_chunk", "nonfinite_chunk")
_CALL_FAILURES = ((rpc.RpcTimeoutError, "donor_timeout"), (rpc.RpcTooLargeError, "oversize"),
                  (rpc.RpcRemoteError, "donor_refused"), (rpc.RpcConnectionError, "disconnect"))


def _failure_reason(error: BaseException) -> str:
    if isinstance(error, DonorError):
        return error.reason
    return next((reason for kind, reason in _CALL_FAILURES if isinstance(error, kind)), "donor_error")


async def fetch_snapshot(node: SwarmNode, run_id: str, spec_hash: str, donors: Sequence[str], numel: int,
                         config: StateSyncConfig, *, guard: PeerGuard | None = None,
                         on_progress: Callable[[int, int], None] | None = None,
                         on_manifest: Callable[[Manifest], None] | None = None,
                         ) -> tuple[torch.Tensor, VersionVector, str]:
    """Fetch and verify a snapshot from the first donor (in the given order) that serves a good one.

    Returns (theta, its version vector, the donor used); load them with `replica.load(theta, vv)`, then let
    gossip pull what is newer. StateSyncError if every donor failed (each one's reason is in the message).
    With a `guard` (PeerGuard), non-members and penalized donors are skipped, every failure is counted against
    its donor, and a donor that served anything unverifiable is penalized. `on_progress(bytes_done, total)` is
    called after each verified chunk (a progress bar; it must not block); `on_manifest(manifest)` with the
    manifest of the snapshot returned (e.g. the donor's standing, to inherit).
    """
    config.validate()
    check_host()
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    failures: list[str] = []
    for donor in dict.fromkeys(donors):
        if donor == node.peer_id:
            continue
        skip = guard.may_pull_from(donor) if guard is not None else None
        if skip:
            failures.append(f"{donor}: skipped ({skip})")
            continue
        started = time.monotonic()
        try:
            theta, manifest = await _fetch_from(node, donor, run_id, spec_hash, numel, config, on_progress)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # DonorError, RpcError, or anything else a remote could provoke
            failures.append(f"{donor}: {_donor_failed(donor, e, guard)}")
            continue
        elapsed_s, nbytes = time.monotonic() - started, theta.numel() * theta.element_size()
        if guard is not None:  # it gave us a verified state: a contributor (net/admission/ledger.py)
            guard.ledger.gave_snapshot(donor, nbytes)
        logger.info("state sync done donor=%s numel=%d updates=%d took_s=%.2f mb_per_s=%.1f", donor, numel,
                    manifest.version_vector.total(), elapsed_s, nbytes / 1e6 / max(elapsed_s, 1e-9))
        if on_manifest is not None:
            on_manifest(manifest)
        return theta, manifest.version_vector, donor
    if not failures:
        raise StateSyncError("no donor to fetch a snapshot from; wait until other peers of the run are listed")
    raise StateSyncError(f"no donor served a verified snapshot ({len(failures)} tried): " + "; ".join(failures))


async def _fetch_from(node: SwarmNode, donor: str, run_id: str, spec_hash: str, numel: int, config: StateSyncConfig,
                      on_progress: Callable[[int, int], None] | None) -> tuple[torch.Tensor, Manifest]:
    """`donor`'s manifest and every chunk of its snapshot, each verified (digest, finite) as it arrives."""
    # A fresh buffer per donor: a dropped donor's verify-and-copy thread may still be running (cancelling
    # its task does not stop the thread) and must not write into the next donor's snapshot.
    theta = torch.empty(numel, dtype=torch.float32)  # our numel: never allocate what a remote declares
    buffer = theta.numpy().data.cast("B")
    manifest = parse_manifest(
        await rpc.call(node.p2p, donor, manifest_name(run_id),
                       msgpack.packb({"run_id": run_id, "spec_hash": spec_hash, "numel": numel}),
                       max_response_bytes=config.max_manifest_bytes, timeout_s=config.timeout_s),
        donor=donor, run_id=run_id, spec_hash=spec_hash, numel=numel,
        max_manifest_bytes=config.max_manifest_bytes)
    await _fetch_chunks(node, run_id, manifest, buffer, config, on_progress)
    return theta, manifest


def _donor_failed(donor: str, error: Exception, guard: PeerGuard | None) -> str:
    """Log a dropped donor and count it (penalized if it served anything unverifiable); returns why."""
    why = str(error) if isinstance(error, (DonorError, rpc.RpcError)) else f"{type(error).__name__}: {error}"
    reason = _failure_reason(error)
    logger.warning("state sync donor dropped donor=%s reason=%s detail=%s", donor, reason, why)
    if guard is not None:
        guard.count(donor, reason)
        if reason in _UNVERIFIABLE:
            guard.penalize(donor, reason)
    return why


@dataclass
class _Progress:
    """The chunks' workers' shared count of verified bytes, and when it was last logged."""

    logged_at: float
    bytes_done: int = 0


async def _fetch_chunks(node: SwarmNode, run_id: str, manifest: Manifest, buffer: memoryview,
                        config: StateSyncConfig, on_progress: Callable[[int, int], None] | None = None) -> None:
    """Fetch every chunk with `parallel_chunks` in flight, verify it and copy it into `buffer`."""
    total, size = len(buffer), manifest.chunk_bytes
    indices = iter(range(len(manifest.chunk_digests)))  # shared: each index goes to exactly one worker
    progress = _Progress(logged_at=time.monotonic())

    async def worker() -> None:
        for index in indices:
            start = index * size
            length = min(size, total - start)
            request = msgpack.packb({"snapshot_id": manifest.snapshot_id, "index": index})
            data = await _call_with_retries(node, manifest.donor, chunk_name(run_id), request, length, config)
            if len(data) != length:
                raise DonorError(f"chunk {index} is {len(data)} bytes, expected {length}", "bad_chunk")
            problem = await asyncio.to_thread(_check_and_copy, data, manifest.chunk_digests[index], buffer, start)
            if problem:
                reason = "nonfinite_chunk" if "non-finite" in problem else "bad_chunk"
                raise DonorError(f"chunk {index} {problem}", reason)
            progress.bytes_done += length
            if on_progress is not None:
                on_progress(progress.bytes_done, total)
            if time.monotonic() - progress.logged_at > _PROGRESS_LOG_S:
                progress.logged_at = time.monotonic()
                logger.info("state sync progress donor=%s done_mb=%.0f total_mb=%.0f", manifest.donor,
                            progress.bytes_done / 1e6, total / 1e6)

    workers = [asyncio.create_task(worker()) for _ in range(min(config.parallel_chunks, len(manifest.chunk_digests)))]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


async def _call_with_retries(node: SwarmNode, donor: str, name: str, request: bytes, max_response_bytes: int,
                             config: StateSyncConfig) -> bytes:
    """One chunk call, retried with backoff when the stream broke or timed out (libp2p occasionally resets a
    short-lived stream under load) and, for up to BUSY_WAIT_S, while the donor says it is busy: a joiner is a
    newcomer to every donor, and a snapshot of tens of MB is bigger than a newcomers' uplink burst (measured
    with the small preset in namespaces: 12 "busy" drops and a failed sync). Any other refusal, or an oversize
    answer, is not retried."""
    attempt, busy_until, busy_delay_s = 0, time.monotonic() + BUSY_WAIT_S, 0.5
    while True:
        try:
            return await rpc.call(node.p2p, donor, name, request, max_response_bytes=max_response_bytes,
                                  timeout_s=config.timeout_s)
        except rpc.RpcRemoteError as e:
            if "busy" not in str(e) or time.monotonic() + busy_delay_s > busy_until:
                raise
            await asyncio.sleep(busy_delay_s)  # the donor's uplink share refills: pace to it
            busy_delay_s = min(busy_delay_s * 2, 8.0)
            continue
        except (rpc.RpcConnectionError, rpc.RpcTimeoutError) as e:
            if attempt == config.chunk_retries:
                raise
            logger.info("state sync chunk retry donor=%s attempt=%d/%d error=%s", donor, attempt + 1,
                        config.chunk_retries, e)
            await asyncio.sleep(0.1 * 2**attempt)
            attempt += 1


def _check_and_copy(data: bytes, digest: bytes, buffer: memoryview, start: int) -> str | None:
    """Runs in a worker thread: verify one chunk and copy it into place; returns what is wrong, or None."""
    if not hmac.compare_digest(hashlib.sha256(data).digest(), digest):
        return "does not match its digest"
    # A signed digest proves the donor sent it, not that the values are sane. numpy, per chunk: about 20x faster
    # than torch.isfinite(theta).all() on the whole tensor with this CPU build, and it overlaps the transfer.
    if not np.isfinite(np.frombuffer(data, dtype="<f4")).all():
        return "has non-finite values"
    buffer[start:start + len(data)] = data
    return None
