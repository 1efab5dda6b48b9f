"""Anti-entropy: what keeps a quiet swarm converging when no announce reaches us.

Every `anti_entropy_s` (jittered +-50%), let the intake skip gaps that waited out `gap_timeout_s` (a quiet swarm
brings nothing that would fill them), then pull from one random peer whatever it holds (a forced pull: it claims
nothing, so bringing nothing is no failure).
"""

from __future__ import annotations

import asyncio
import logging
import random

from p2p_diloco.net.gossip.messages import GossipConfig
from p2p_diloco.net.gossip.pulls import Puller
from p2p_diloco.net.gossip.targets import PeerPicker
from p2p_diloco.sync.intake import Intake
from p2p_diloco.sync.version_vector import VersionVector

logger = logging.getLogger(__name__)


class AntiEntropy:
    """The periodic round of the module docstring, as one task on the gossip's loop, while the puller runs."""

    def __init__(self, run_id: str, intake: Intake, config: GossipConfig, *, puller: Puller, picker: PeerPicker,
                 rng: random.Random) -> None:
        self.run_id, self.intake, self.config = run_id, intake, config
        self.puller, self.picker, self.rng = puller, picker, rng
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"anti-entropy:{self.run_id}")

    def halt(self) -> list[asyncio.Task]:
        """Cancel the round; returns its task (if any), for the caller to wait on."""
        task, self._task = self._task, None
        if task is None:
            return []
        task.cancel()
        return [task]

    async def _loop(self) -> None:
        while self.puller.running:
            await asyncio.sleep(self.config.anti_entropy_s * self.rng.uniform(0.5, 1.5))
            try:
                await asyncio.to_thread(self.intake.expire_gaps)  # may merge a released chain: CPU, off the loop
                targets = self.picker.pick(1, ())
                if targets:
                    self.puller.want(targets[0], VersionVector(), force=True)
            except Exception:  # a bug here must not silently end anti-entropy
                logger.exception("anti-entropy round failed run_id=%s", self.run_id)
