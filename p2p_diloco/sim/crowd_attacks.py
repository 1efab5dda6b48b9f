"""What each identity of a crowd (sim/crowd.py `CrowdSwarm`) signs, given the honest update it copies: the
tampering modes, including those designed against the copy test and the norm bound (ARCHITECTURE.md "Who counts").

    sign_flip       minus the honest update (an exact negated copy)
    scale           the honest update times `factor` (an exact scaled copy)
    copy            the honest update itself, re-signed (a crowd that copies a newcomer: the copy rule's tie)
    noise           a random direction at the honest update's length times `factor` (Gaussian: its peak can
                    pass the norm bound where the honest update is flat, as at small H)
    noise_shaped    the honest update's magnitudes in a random order with random signs: a random direction
                    with the honest length, peak and distribution of magnitudes (no norm test tells it apart)
    near_copy       minus the honest update plus this identity's own noise (NEAR_NOISE of its length), rescaled
                    to the honest length: |cos| with the original ~0.9988, with another identity's ~0.9975, so no
                    two payloads are copies under a copy test at |cos| >= 0.9999
    near_copy_pos   the same, not negated: K more votes for the honest direction (amplification, overshoot)
    scale_bound     a negated near copy scaled to BOUND_MARGIN of the spec's per-coordinate norm bound (the
                    longest payload the bound lets through; `factor` times the honest length if there is none)
    echo_noise      the swarm's own recent move (`along`: theta's move since the copied peer's last update, what
                    anyone holding the public updates can compute) plus this identity's own noise, at cosine
                    ECHO_COSINE with that move and the honest length: no compute, no honest work in it, yet it
                    points along the sponsors' work (built against a judge of directions), and no two identities'
                    payloads are near copies (|cos| ~ ECHO_COSINE ** 2)
    echo_source     the same with the copied update itself as `along`: an echo of one published update (a
                    sponsor's, when the crowd copies a sponsor) with enough noise to pass the copy rule
    echo_soft       echo_source at cosine SOFT_COSINE, built against the sponsors' echo test (sync/sponsorship.py
                    ECHO_OF): most of its new parts pass under it (the cosine of a sweep from 0.3 to 0.9 that cost
                    the sponsors most)
    mixed           sign_flip and scale alternating (identity i: i % 2)
    mixed_adaptive  near_copy, near_copy_pos, scale_bound and noise_shaped in turn (identity i: i % 4)

Every near copy keeps its largest coordinate under BOUND_MARGIN of the bound, as the attacker knows the spec.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from p2p_diloco.wire.envelope import OuterUpdate, make_update
from p2p_diloco.wire.identity import Identity

NEAR_NOISE = 0.05
"""A near copy's own noise, as a fraction of the honest update's L2 length."""
BOUND_MARGIN = 0.98
"""What fraction of the norm bound a bounded payload reaches (the codec's rounding must not carry it over)."""
ECHO_COSINE = 0.9
"""`echo_noise`'s cosine with the swarm's recent move."""
SOFT_COSINE = 0.6
"""`echo_soft`'s cosine with the update it echoes."""
MIXES = {"mixed": ("sign_flip", "scale"),
         "mixed_adaptive": ("near_copy", "near_copy_pos", "scale_bound", "noise_shaped")}
MODES = ("sign_flip", "scale", "copy", "noise", "noise_shaped", "near_copy", "near_copy_pos", "scale_bound",
         "echo_noise", "echo_source", "echo_soft", *MIXES)


def mode_of(mode: str, identity: int) -> str:
    """The plain mode identity number `identity` of a crowd in `mode` plays."""
    if mode not in MODES:
        raise ValueError(f"unknown crowd mode {mode!r} (one of {', '.join(MODES)})")
    mix = MIXES.get(mode)
    return mix[identity % len(mix)] if mix else mode


def crowd_delta(mode: str, d: Tensor, *, factor: float, bound: float, rng: torch.Generator,
                along: Tensor | None = None) -> Tensor:
    """The payload (decoded, before compression) a crowd identity in plain mode `mode` signs in place of the
    honest decoded payload `d`; `bound` is the spec's per-coordinate bound (inf: none); `along`: the swarm's
    recent move, for `echo_noise` (None: pure noise)."""
    if mode == "sign_flip":
        return -d
    if mode == "scale":
        return d * factor
    if mode == "copy":
        return d.clone()
    length = d.norm()
    if mode == "noise":  # a random direction at the honest norm: no cosine test can tell it apart
        noise = torch.randn(d.numel(), generator=rng)
        return noise * (length / noise.norm()) * factor
    if mode == "noise_shaped":
        order = torch.randperm(d.numel(), generator=rng)
        signs = torch.randint(0, 2, (d.numel(),), generator=rng, dtype=d.dtype) * 2 - 1
        return d.abs()[order] * signs
    cosine = SOFT_COSINE if mode == "echo_soft" else ECHO_COSINE
    if mode in ("echo_source", "echo_soft"):
        mode, along = "echo_noise", d
    if mode == "echo_noise":
        noise = torch.randn(d.numel(), generator=rng)
        along_norm = float(along.norm()) if along is not None else 0.0
        if along is None or not (along_norm > 0 and math.isfinite(along_norm)):
            return _bounded(noise * (length / noise.norm()), bound)
        s = along / along_norm
        noise = noise - torch.dot(noise, s) * s
        x = cosine * s + math.sqrt(1 - cosine ** 2) * noise / noise.norm()
        return _bounded(x * length, bound)
    if mode not in ("near_copy", "near_copy_pos", "scale_bound"):
        raise ValueError(f"{mode!r} is not a plain crowd mode")
    noise = torch.randn(d.numel(), generator=rng)
    x = (d if mode == "near_copy_pos" else -d) + noise * (NEAR_NOISE * length / noise.norm())
    x = x * (length / x.norm())
    if mode == "scale_bound":
        return x * (BOUND_MARGIN * bound / x.abs().max()) if math.isfinite(bound) else x * factor
    return _bounded(x, bound)


def _bounded(x: Tensor, bound: float) -> Tensor:
    """`x`, scaled down so that its largest coordinate stays under BOUND_MARGIN of `bound` (the attacker knows
    the spec)."""
    peak = float(x.abs().max())
    return x * (BOUND_MARGIN * bound / peak) if math.isfinite(bound) and peak > BOUND_MARGIN * bound else x


def within_bound(d: Tensor, factor: float, bound: float) -> Tensor:
    """`d` times `factor`, its largest coordinate capped at BOUND_MARGIN of `bound` (a hostile trainer that
    scales its own work as far as the norm bound lets it)."""
    x = d * factor
    peak = float(x.abs().max())
    return x * (BOUND_MARGIN * bound / peak) if math.isfinite(bound) and peak > BOUND_MARGIN * bound else x


def forged(honest: OuterUpdate, payload: bytes, identity: Identity, seq: int, weight: float, *,
           declare: bool = False) -> OuterUpdate:
    """`payload` (compressed) re-signed by `identity` as its update `seq`, claiming `weight`, with the honest
    update's other header fields (run, spec, tau, samples, codec, creation time): what a crowd identity publishes.
    `declare`: it also declares the honest update's data position (the batches a fit check would redraw)."""
    h = honest.header
    return make_update(run_id=h.run_id, spec_hash=h.spec_hash, seq=seq, tau=h.tau, samples=h.samples, weight=weight,
                       codec=h.codec, numel=h.numel, payload=payload, identity=identity, created_at=h.created_at,
                       data=h.position if declare else None)
