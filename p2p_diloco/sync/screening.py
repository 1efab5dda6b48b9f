"""Screening one update before it merges (rule 4 of sync/replica.py, after the layout check): decode with
the run's codec, all values finite, the norm bound, then shape and weight. Pure: no lock, no replica state but
what the caller passes, so the replica runs it outside its lock (the expensive part).

Under the default aggregation (a plain sum) nothing here makes a full-size vector: the payload is read a chunk at
a time (sync/decoded.py), and the step `scale * delta` is made a chunk at a time by the merge itself."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from p2p_diloco.sync.decoded import Decoded
from p2p_diloco.sync.robust import MergePolicy, peak
from p2p_diloco.sync.types import MergeOutcome, UpdateLike
from p2p_diloco.wire.codecs import Codec

logger = logging.getLogger(__name__)

_F32_OVERFLOW = 2.0**128 - 2.0**103
"""The smallest exact product that float32 rounding (to nearest) makes infinite."""


@dataclass
class Prepared:
    """An update screened for merging: its decoded delta and the scaled step, or why it is rejected."""

    delta: Decoded | None = None
    scaled: Decoded | None = None  # None with no rejection: shaped under the lock (centered_clip), or screen only
    scale: float = 0.0
    bound: float = 0.0  # >= max |scaled_i * factor|
    factor: float = 1.0  # the step merged is `scaled * factor` element by element (1: `scaled` is the step)
    rejection: MergeOutcome | None = None


def check_theta(theta: Tensor) -> None:
    if not isinstance(theta, Tensor) or theta.dim() != 1 or theta.dtype != torch.float32:
        raise ValueError("theta must be a 1-D float32 tensor (all parameters flattened)")
    if not math.isfinite(peak(theta)):
        raise ValueError("theta must be all finite")


def header_ok(update: UpdateLike) -> bool:
    try:
        sender, seq, update_id, weight = update.sender, update.seq, update.update_id, update.weight
        nbytes = update.nbytes
    except AttributeError:
        return False
    return (isinstance(sender, str) and bool(sender)
            and isinstance(seq, int) and not isinstance(seq, bool) and seq >= 1
            and isinstance(update_id, bytes) and isinstance(nbytes, int) and nbytes >= 0
            and isinstance(weight, (int, float)) and not isinstance(weight, bool))


def prepare(update: UpdateLike, theta: Tensor, *, codec: Codec, policy: MergePolicy, outer_lr: float,
            max_weight: float, decoded: Tensor | Decoded | None = None, screen_only: bool = False,
            samples: Sequence[Tensor] = ()) -> Prepared:
    """Decode (unless `decoded`, the same codec's output for this payload, is given), check finiteness and the
    norm bound, shape and weight. `screen_only`: the rejection (or none) and the decoded delta, nothing more.
    The payload is decoded a chunk at a time on each read, unless the policy shapes whole vectors (a clip); the
    pass that finds its peak also takes its values at `samples` (the standing's coordinates)."""
    try:
        weight = float(update.weight)
    except OverflowError:  # an int weight beyond the float range
        weight = math.inf
    if not math.isfinite(weight):
        return Prepared(rejection=MergeOutcome.REJECTED_NONFINITE)
    scale = outer_lr * min(max(weight, 0.0), max_weight)  # same clamp on every peer
    given: object = decoded
    try:  # bounded output: the size is the RunSpec's (theta's), whatever the header claims
        if given is None and policy.shapes_whole:
            given = codec.decompress(update.payload, theta.numel())
        if given is None:
            delta = Decoded.stream(codec, update.payload, theta.numel())
        elif isinstance(given, (Tensor, Decoded)) and given.shape == theta.shape:
            delta = Decoded.of(given if isinstance(given, Decoded) else given.detach().to(theta.device))
        else:
            return Prepared(rejection=MergeOutcome.REJECTED_INVALID)
        delta.want(*samples)
        top = delta.peak()  # the first read of every chunk: a malformed payload raises here, before any merge
    except Exception as exc:  # a remote payload must never crash the peer (invariant 1)
        logger.warning("update rejected reason=decode_error sender=%s seq=%d error=%r",
                       update.sender, update.seq, exc)
        return Prepared(rejection=MergeOutcome.REJECTED_INVALID)
    if not math.isfinite(top):
        return Prepared(rejection=MergeOutcome.REJECTED_NONFINITE)
    if policy.screen(delta):
        return Prepared(rejection=MergeOutcome.REJECTED_NORM)
    if screen_only or not policy.deterministic:
        return Prepared(delta=delta, scale=scale)  # centered_clip: shaped against the window, under the lock
    return shaped_step(delta, scale, policy)


def shaped_step(delta: Decoded, scale: float, policy: MergePolicy) -> Prepared:
    """The step a merge subtracts: `scale * shape(delta)`, or REJECTED_NONFINITE if that overflows."""
    shaped = policy.shape(delta)
    if shaped is delta:
        # The step is delta * scale, left unmade: the merge makes it a chunk at a time (sync/accumulator.py),
        # bit for bit, so the standing and the policy still read delta and no full-size step ever exists.
        # torch multiplies float32 by the scale rounded to float32; a product of two float32 values is exact
        # in a double, so this is the overflow test the whole step's isfinite would make.
        top = delta.peak() * float(torch.tensor(scale, dtype=torch.float32))
        if not top < _F32_OVERFLOW:
            return Prepared(rejection=MergeOutcome.REJECTED_NONFINITE)
        return Prepared(delta=delta, scaled=delta, factor=scale, scale=scale, bound=top * (1 + 2.0**-22))
    assert isinstance(shaped, Tensor)
    step = shaped.mul_(scale)  # the policy made a new tensor (a clip): scale it in place
    if not math.isfinite(peak(step)):  # lr * w * delta can overflow float32
        return Prepared(rejection=MergeOutcome.REJECTED_NONFINITE)
    return Prepared(delta=delta, scaled=Decoded.of(step), scale=scale, bound=peak(step))
