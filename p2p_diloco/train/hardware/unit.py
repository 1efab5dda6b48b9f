"""A learner unit of several processes: `torchrun --nproc-per-node N -m p2p_diloco join ...` (or `join --gpus N`).

Rank 0 is the unit: it alone speaks to the swarm (DHT, gossip, state sync, checkpoints), holds the replica and
the outer state, and runs the round loop. Ranks 1..N-1 only train: `follow` runs inner steps as rank 0 tells
them. The N processes are one data-parallel (DDP) model: each inner step, rank 0 broadcasts one command (the lr,
whether the parameters or the AdamW state changed) and the unit's batch; every rank takes its rows
(`batch_size / N` each), DDP averages the gradients, and every rank takes the same AdamW step from the same
parameters. So phi is equal on every rank, and the update rank 0 computes from it is the update a one-process
unit would compute from the same batches (up to the order of float additions).

Rank 0 sends the parameters (one at a time) after it changed them: the start of a phase (phi <- theta) and a
rebase; it sends its AdamW state after loading a checkpoint. Nothing else crosses between ranks: the replica, the
version vector and everything on the wire stay on rank 0. The data needs no agreement either: the batch comes
from rank 0's sampler.

`SoloUnit` is the one-process unit (every call a no-op); the learner always goes through one of the two, or
through `ShardedUnit` (train/hardware/sharded.py), whose ranks shard the model instead of each holding a copy;
train/hardware/units.py picks one.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from p2p_diloco.config import ConfigError

logger = logging.getLogger(__name__)

STEP, STOP = 1.0, 0.0  # rank 0's commands; an FSDP unit adds its own (train/hardware/sharded.py)
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)
"""How long a training rank waits for rank 0's next command: rank 0 may state-sync, checkpoint or linger between
phases. A rank 0 that dies ends the wait sooner: its sockets close and torchrun stops the whole unit."""


def unit_device(name: str) -> str:
    """The device this process trains on: `--device` resolved (train/hardware/device.py), and under torchrun a bare
    "cuda" (or auto on a GPU machine) becomes this process's own GPU, cuda:LOCAL_RANK."""
    from p2p_diloco.train.hardware.device import resolve_device

    device = resolve_device(name)
    if device.startswith("cuda") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if device != "cuda":
            raise ConfigError(f"--device {device} with a unit of several processes: each process takes its own "
                              f"GPU (cuda:LOCAL_RANK); pass --device cuda or auto (CUDA_VISIBLE_DEVICES picks GPUs)")
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        resolve_device(device)  # fewer GPUs than processes: a clear error
    return device


def is_follower() -> bool:
    """A training-only rank (> 0) of a torchrun unit."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) > 0


class SoloUnit:
    """A unit of one process."""

    rank, world = 0, 1

    def place(self, model: nn.Module, device: str) -> nn.Module:
        """The model (built on the host) on this rank's device, before `wrap`."""
        return model.to(device)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def check_batch(self, batch_size: int) -> None:
        pass

    def agree(self, value: str, what: str) -> None:
        """One process always agrees with itself."""

    def lead_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                  lr: float, *, params_changed: bool, optimizer_changed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return x, y

    def no_sync(self, model: nn.Module) -> Callable | None:
        return None

    # ---- the unit's parameters as one flat float32 vector on the host, one parameter at a time ----------------
    # The replica, the phase's base point and the outer state are flat CPU vectors; the model's parameters live
    # on the device (sharded, in an FSDP unit). These two walk them together with no full-size copy on either
    # side: the largest temporary is one parameter.

    def set_params(self, model: nn.Module, source: Callable[[slice], torch.Tensor], *, add: bool = False) -> None:
        """Rank 0: set every parameter to `source(s)` (or add it), where `s` is the parameter's slice of the flat
        vector and `source` returns that many float32 values on the host. The unit's other processes receive the
        parameters before the next step (`lead_step(params_changed=True)`)."""
        with torch.no_grad():
            for s, param in flat_slices(model):
                value = source(s).to(param.device).view_as(param)
                param.add_(value) if add else param.copy_(value)

    def each_param(self, model: nn.Module) -> Iterator[tuple[slice, torch.Tensor]]:
        """Rank 0: (slice of the flat vector, the parameter's full float32 values on the host), one at a time."""
        for s, param in flat_slices(model):
            yield s, param.detach().reshape(-1).float().cpu()

    def evaluate(self, model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Rank 0: the mean loss of `model` (the unit's own, unwrapped) over `batches`; in a sharded unit a
        forward every rank joins."""
        from p2p_diloco.train.data.corpus import evaluate

        return evaluate(model, batches)

    saves_optimizer_state = True
    """Whether a checkpoint holds the inner AdamW state (a sharded unit's restarts with a fresh one)."""

    def step_done(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass


class RankGroup(SoloUnit):
    """A unit of `world` processes started by torchrun (its environment variables say which rank this is)."""

    def __init__(self, device: str) -> None:
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device = device
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(device)  # NCCL's object collectives use the current device: ours, not cuda:0
        else:  # a unit across hosts: gloo's address must be one the other hosts reach (train/hardware/unit_network.py)
            from p2p_diloco.train.hardware.unit_network import pick_gloo_interface
            pick_gloo_interface()
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
        self.comm = torch.device(device) if backend == "nccl" else torch.device("cpu")
        self.stopped = False
        self.in_step = False  # a step's collectives are under way (the others are inside them)

    def wrap(self, model: nn.Module) -> nn.Module:
        # DDP broadcasts rank 0's parameters at construction: every rank starts equal.
        ids = [torch.device(self.device).index or 0] if self.device.startswith("cuda") else None
        # Gradients as views into DDP's all-reduce buckets: without it every rank holds them twice (4 B/parameter).
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)

    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.world:
            raise ConfigError(f"data.batch_size {batch_size} does not split over the unit's {self.world} processes; "
                              f"use a batch size divisible by {self.world} (each process trains batch/{self.world})")

    def agree(self, value: str, what: str) -> None:
        """Check that every rank holds the same `value` (e.g. the spec's hash); a clear error otherwise."""
        values: list = [None] * self.world
        dist.all_gather_object(values, value)
        if len(set(values)) > 1:
            raise ConfigError(f"the ranks of this unit disagree on {what}: {values}; start them with the same options")

    def lead_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                  lr: float, *, params_changed: bool, optimizer_changed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0: tell the others to take a step (with what changed), send the batch; this rank's rows."""
        command = torch.tensor([STEP, float(params_changed), float(optimizer_changed), x.shape[0], x.shape[1], lr],
                               dtype=torch.float64, device=self.comm)
        self.in_step = True  # until step_done: the others will be inside this step's collectives
        dist.broadcast(command, 0)
        self._share_state(model, optimizer, params_changed, optimizer_changed)
        batch = torch.stack([x, y]).to(self.comm)
        dist.broadcast(batch, 0)
        return self._rows(batch)

    def follow_step(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """Ranks > 0: the next command: None at stop, else (lr, this rank's rows). Other commands (an FSDP unit's
        parameter moves and evaluations) are served on the way."""
        while True:
            command = torch.empty(6, dtype=torch.float64, device=self.comm)
            dist.broadcast(command, 0)
            cmd, params_changed, optimizer_changed, b, t, lr = command.tolist()
            if cmd in (STEP, STOP):
                break
            self._serve(model, command.tolist())
        if cmd == STOP:
            return None
        self._share_state(model, optimizer, bool(params_changed), bool(optimizer_changed))
        batch = torch.empty((2, int(b), int(t)), dtype=torch.long, device=self.comm)
        dist.broadcast(batch, 0)
        return lr, self._rows(batch)

    def _serve(self, model: nn.Module, command: list[float]) -> None:
        raise RuntimeError(f"rank {self.rank}: unknown command {command[0]} from rank 0")

    def no_sync(self, model: nn.Module) -> Callable | None:
        model = getattr(model, "_orig_mod", model)  # under torch.compile
        return model.no_sync if isinstance(model, nn.parallel.DistributedDataParallel) else None

    def step_done(self) -> None:
        self.in_step = False

    def stop(self) -> None:
        """Rank 0: tell the others to end, then close the group. After a step that broke off (an error inside
        it), the others wait inside that step's collectives, where a stop would not match: close the group
        instead, which ends their wait with an error (torchrun or `join --gpus` then ends them)."""
        if self.rank != 0 or self.stopped or not dist.is_initialized():
            return
        self.stopped = True
        if self.in_step:
            logger.warning("a step broke off mid-way: closing the unit's process group instead of a stop")
        else:
            dist.broadcast(torch.tensor([STOP, 0, 0, 0, 0, 0], dtype=torch.float64, device=self.comm), 0)
            if self.comm.type == "cuda":
                torch.cuda.synchronize(self.comm)  # NCCL is asynchronous: the stop must leave before we exit
        self.close()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
            # Collect now the garbage a backward's collectives left (autograd graphs, gloo work): freed in the
            # interpreter's teardown instead, it aborts the process now and then ("terminate called without an
            # active exception", exit -6, seen with DDP and FSDP on gloo), and torchrun reports the unit failed.
            gc.collect()

    # ---- helpers ----------------------------------------------------------------------------------------------

    def _rows(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = batch.shape[1] // self.world
        mine = batch[:, self.rank * rows:(self.rank + 1) * rows].to(self.device)
        return mine[0], mine[1]

    def _share_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, params: bool, opt: bool) -> None:
        if params:  # one parameter at a time, into the parameter itself where it is on the backend's device
            with torch.no_grad():
                for _, param in flat_slices(model):
                    value = param.detach().to(self.comm)
                    dist.broadcast(value, 0)
                    if self.rank and value.data_ptr() != param.data_ptr():
                        param.copy_(value)
        if opt:
            own = optimizer.state_dict() if self.rank == 0 else None
            if own is not None:  # rank 0: tensors to the CPU: a pickled CUDA tensor would land on rank 0's device
                own["state"] = {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                                for i, s in own["state"].items()}
            state = [own]
            dist.broadcast_object_list(state, 0)
            if self.rank:
                received = state[0]
                assert received is not None  # broadcast_object_list filled it with rank 0's
                optimizer.load_state_dict(received)


def flat_slices(model: nn.Module) -> Iterator[tuple[slice, nn.Parameter]]:
    """Each parameter of the unwrapped model with its slice of the flat vector (train/models/build.py
    `flat_params` order: `model.parameters()`)."""
    model = getattr(model, "_orig_mod", model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    start = 0
    for param in model.parameters():
        n = param.numel()
        yield slice(start, start + n), param
        start += n


def follow(spec, unit: RankGroup, compute, device: str) -> int:
    """Ranks > 0 of a unit: build the model, then take inner steps as rank 0 says until it says stop.
    Returns the number of steps taken."""
    from p2p_diloco.train.inner import inner_step, make_inner_optimizer
    from p2p_diloco.train.models.build import build_model

    unit.agree(spec.spec_hash(), "the run's spec")
    unit.check_batch(spec.data.batch_size)
    model = unit.place(build_model(spec.model, spec.seed), device)
    compute.prepare(model)
    ddp = compute.compiled(unit.wrap(model))
    optimizer = make_inner_optimizer(model, spec.inner)
    steps = 0
    while (order := unit.follow_step(ddp, optimizer)) is not None:
        lr, (x, y) = order
        inner_step(ddp, optimizer, x, y, 0, spec.inner, compute=compute, lr=lr, no_sync=unit.no_sync(ddp))
        steps += 1
    logger.info("rank %d: rank 0 said stop after %d inner steps", unit.rank, steps)
    return steps
