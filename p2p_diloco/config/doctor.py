"""`p2p-diloco doctor`: would a `join` from this host work, and if not, what to change.

The network section is `join`'s own (`NetworkConfig`), so the doctor starts its node exactly as `join` with the
same options would, and its diagnosis holds for that `join`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2p_diloco.config.errors import require
from p2p_diloco.config.network import NetworkConfig


def _doctor_network() -> NetworkConfig:
    return NetworkConfig(identity="")  # empty: a throwaway identity, so the doctor never writes a key file


@dataclass(frozen=True)
class DoctorConfig:
    """The bootstraps to check, the run whose spec to read, and `join`'s network options to check them with."""

    network: NetworkConfig = field(default_factory=_doctor_network)
    """The network options of the `join` to check (--bootstrap, --host, --port, --announce, --reachability...;
    --identity empty: a throwaway identity; never give the identity of a peer running now)."""
    run_id: str = "default"
    """The run whose published spec to check (spec hash, model size, bytes per outer update)."""
    timeout_s: float = 10.0
    """Bound on each step (each connect, the node start, each probe, the spec read), in seconds."""
    relay_wait_s: float = 5.0
    """Seconds to wait for a relay slot (a /p2p-circuit address) when no bootstrap could dial us back."""
    upload_mib: float = 1.0
    """MiB per upload probe (two are sent to the first bootstrap; the faster counts); 0: skip the upload test."""
    json: bool = False
    """Print the diagnosis as one JSON object instead of lines."""

    def validate(self) -> DoctorConfig:
        require(bool(self.network.bootstrap), "give the swarm's bootstrap multiaddr(s) with --bootstrap")
        self.network.validate()
        require(self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        require(self.relay_wait_s >= 0, f"relay_wait_s must be >= 0, got {self.relay_wait_s}")
        require(0 <= self.upload_mib <= 4, f"upload_mib must be in [0, 4], got {self.upload_mib}")
        return self
