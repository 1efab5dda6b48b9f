"""Device placement: phi trains on `device`; theta, the outer state and the wire stay on the CPU in float32."""

import dataclasses

import pytest
import torch

from p2p_diloco.config import ConfigError, JoinConfig, SimConfig, TrainingConfig, preset
from p2p_diloco.peer.process import Peer
from p2p_diloco.sim.runner import simulate
from p2p_diloco.sync.intake import Intake
from p2p_diloco.train.hardware.device import resolve_device
from p2p_diloco.train.learner import Learner, SwarmView
from p2p_diloco.wire.envelope import OuterUpdate, encode_update
from p2p_diloco.wire.identity import Identity

SPEC = preset("test")
# A short fp32-codec round: the update then carries the pseudo-gradient's own values, to compare across devices.
SPEC = dataclasses.replace(SPEC, data=dataclasses.replace(SPEC.data, max_corpus_mb=1.0),
                           inner=dataclasses.replace(SPEC.inner, inner_steps=5),
                           outer=dataclasses.replace(SPEC.outer, codec="fp32"))
CUDA = torch.cuda.is_available()


pytestmark = pytest.mark.corpus_mb(1.0)  # the conftest's `corpus`: 1 MB of the stdlib


def one_round(corpus, device: str) -> tuple[Learner, OuterUpdate]:
    """Learner 0 of two trains one phase on `device`; returns it and its (signed, self-merged) update."""
    learner = Learner(SPEC, Identity.generate(), corpus, shard=0, num_shards=2, device=device)
    phase = learner.begin_phase()
    result = learner.run_inner(phase)
    view = SwarmView(num_peers=2, samples_per_round=2 * SPEC.inner.inner_steps * SPEC.data.batch_size)
    return learner, learner.finish_phase(phase, result, view)


def values(learner: Learner, update: OuterUpdate) -> torch.Tensor:
    return learner.codec.decompress(update.payload, update.header.numel)


def test_resolve_device_on_this_machine() -> None:
    assert resolve_device("cpu") == "cpu"
    if not CUDA and not torch.backends.mps.is_available():
        assert resolve_device("auto") == "cpu"


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_missing_cuda_is_a_clear_config_error(corpus) -> None:
    message = r"--device cuda was asked for but torch\.cuda\.is_available\(\) is False: this torch is a CPU build"
    with pytest.raises(ConfigError, match=message):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="is_available"):
        resolve_device("cuda:1")
    # Every entry point checks before it trains: the peer, the simulator, the learner itself.
    with pytest.raises(ConfigError, match=message):
        Peer(JoinConfig(training=TrainingConfig(device="cuda")))
    with pytest.raises(ConfigError, match=message):
        simulate(SPEC, SimConfig(peers=2, total_steps=20, device="cuda"), corpus)
    with pytest.raises(ConfigError, match=message):
        Learner(SPEC, Identity.generate(), corpus, shard=0, num_shards=1, device="cuda")


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "CPU", ""])
def test_unknown_device_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="unknown --device"):
        resolve_device(name)


def test_cpu_round_is_merged_by_another_learner(corpus) -> None:
    sender, update = one_round(corpus, "cpu")
    assert sender.device == "cpu" and next(sender.model.parameters()).device.type == "cpu"
    theta, vv = sender.replica.snapshot()
    assert theta.device.type == "cpu" and theta.dtype == torch.float32 and vv.get(sender.peer_id) == 1
    receiver = Learner(SPEC, Identity.generate(), corpus, shard=1, num_shards=2, device="cpu")
    outcome, received = Intake(SPEC, receiver.numel, receiver.replica).receive(encode_update(update))
    assert outcome == "merged" and received is not None and received.update_id == update.update_id
    # Replicas agree: the receiver merged exactly what the sender merged into its own replica.
    assert receiver.replica.version_vector == sender.replica.version_vector
    assert torch.equal(receiver.replica.snapshot()[0], theta)
    assert receiver.evaluate([sender.sampler.batch(0)]) == sender.evaluate([sender.sampler.batch(0)])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_round_matches_the_cpu_round(corpus) -> None:
    cpu_sender, cpu_update = one_round(corpus, "cpu")
    gpu_sender, gpu_update = one_round(corpus, "cuda")
    assert next(gpu_sender.model.parameters()).device.type == "cuda"
    assert gpu_sender.replica.theta.device.type == "cpu"  # network-facing state stays on the CPU
    assert gpu_sender.outer_state.momentum.device.type == "cpu"
    cpu_values, gpu_values = values(cpu_sender, cpu_update), values(gpu_sender, gpu_update)
    assert float((gpu_values - cpu_values).norm() / cpu_values.norm()) < 1e-4
    # A CPU peer merges the GPU peer's update like any other.
    receiver = Learner(SPEC, Identity.generate(), corpus, shard=1, num_shards=2, device="cpu")
    assert Intake(SPEC, receiver.numel, receiver.replica).receive(encode_update(gpu_update))[0] == "merged"
    assert torch.equal(receiver.replica.snapshot()[0], gpu_sender.replica.snapshot()[0])
    assert abs(gpu_sender.evaluate([gpu_sender.sampler.batch(0)])
               - cpu_sender.evaluate([cpu_sender.sampler.batch(0)])) < 1e-3
