"""A learner unit whose ranks shard the model (`--training.parallel fsdp`): torch's FSDP2 `fully_shard`.

Each rank holds 1/N of every parameter (rows of dim 0), of its gradient and of its AdamW moments, instead of
DDP's full copy per rank; a forward all-gathers one transformer block at a time and a backward reduce-scatters
its gradients (torchtitan's pattern: each block its own group, the embeddings and head in the root's). The
step itself is the DDP unit's: rank 0 sends the command and the batch, every rank trains its rows, the
gradients are averaged, so the update equals a one-process unit's from the same batches (up to float order).

What differs is how the unit's flat parameter vector (on rank 0's host: theta, the phase's base) meets the
model, which no rank holds whole. Rank 0 sends a command that the others serve inside `follow_step`, then
all ranks walk the parameters in `model.parameters()` order, one at a time, so no rank holds more than one
full parameter beyond its shards:

    PARAMS (set or add)   rank 0 broadcasts the parameter's values; each rank copies (adds) its own rows
    GATHER                every rank all-gathers the parameter (DTensor `full_tensor`); rank 0 keeps it
    EVAL                  rank 0 broadcasts each batch; every rank computes the loss of its rows; averaged

Every rank must join each collective in the same order: a command is issued only between steps, when the
others wait in `follow_step`, and a walk that breaks off midway (an error on rank 0) leaves the others inside
it, so `stop` then closes the group instead of sending STOP (as after a broken step).

The inner AdamW state is not checkpointed (`saves_optimizer_state`): its shards live on N processes, and a
restarted unit starts a fresh one (the unit still warms up over its own first steps: train/inner.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from p2p_diloco.train.hardware.unit import RankGroup, flat_slices

logger = logging.getLogger(__name__)

PARAMS, GATHER, EVAL = 2.0, 3.0, 4.0


class ShardedUnit(RankGroup):
    """A unit of `world` processes started by torchrun, the model sharded over them (FSDP2)."""

    saves_optimizer_state = False

    def place(self, model: nn.Module, device: str) -> nn.Module:
        # Left on the host: `wrap` moves each block to the device as it shards it, so the device never holds the
        # whole model.
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        """Shard `model` in place (its parameters become DTensors; build the optimizer after this, so that its
        state is sharded too). No broadcast: every rank built the same model from the run's seed, and rank 0
        sets the parameters (`set_params`) before the first step."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.comm.type, (self.world,))
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def no_sync(self, model: nn.Module) -> Callable | None:
        # Micro-batches reduce-scatter each their gradients into the shards: skipping that would keep whole
        # (unsharded) gradients until the last one, the memory this unit exists to save.
        return None

    # ---- rank 0's side of the commands ------------------------------------------------------------------------

    def set_params(self, model: nn.Module, source: Callable[[slice], torch.Tensor], *, add: bool = False) -> None:
        self._command(PARAMS, float(add))
        self._walk_set(model, source, add)
        self.in_step = False

    def each_param(self, model: nn.Module) -> Iterator[tuple[slice, torch.Tensor]]:
        self._command(GATHER)
        walk = flat_slices(model)
        try:
            for s, param in walk:
                yield s, _full(param).reshape(-1).float().cpu()
        finally:  # a caller that stops early: the others are inside the walk, so finish it
            for _, param in walk:
                _full(param)
            self.in_step = False

    def evaluate(self, model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        if not batches:
            raise ValueError("evaluate needs at least one batch")
        self._command(EVAL, float(len(batches)))
        losses = [self._eval_batch(model, torch.stack([x, y])) for x, y in batches]
        self.in_step = False
        return sum(losses) / len(losses)

    def _command(self, cmd: float, arg: float = 0.0) -> None:
        self.in_step = True  # until the walk ends: the others will be inside its collectives
        dist.broadcast(torch.tensor([cmd, arg, 0, 0, 0, 0], dtype=torch.float64, device=self.comm), 0)

    # ---- every rank's side --------------------------------------------------------------------------------------

    def _serve(self, model: nn.Module, command: list[float]) -> None:
        cmd, arg = command[0], command[1]
        if cmd == PARAMS:
            self._walk_set(model, None, bool(arg))
        elif cmd == GATHER:
            for _, param in flat_slices(model):
                _full(param)
        elif cmd == EVAL:
            for _ in range(int(arg)):
                self._eval_batch(model, None)
        else:
            super()._serve(model, command)

    def _walk_set(self, model: nn.Module, source: Callable[[slice], torch.Tensor] | None, add: bool) -> None:
        """Every rank: each parameter's full values from rank 0 (`source` there), this rank's rows into its shard."""
        with torch.no_grad():
            for s, param in flat_slices(model):
                if source is not None:
                    full = source(s).to(self.comm, torch.float32).contiguous()
                else:
                    full = torch.empty(s.stop - s.start, dtype=torch.float32, device=self.comm)
                dist.broadcast(full, 0)
                local, rows = self._shard_of(param)
                value = full.view(param.shape)[rows].to(local.device, local.dtype)
                local.add_(value) if add else local.copy_(value)

    def _shard_of(self, param: torch.Tensor) -> tuple[torch.Tensor, slice]:
        """This rank's part of `param` (a view to write into) and its rows of the full parameter. FSDP2 shards dim 0
        as torch.chunk does: ceil(rows / N) per rank, the last ones shorter or empty."""
        if not isinstance(param, DTensor):  # not sharded (or unsharded just now): the whole parameter
            return param.data, slice(None)
        if tuple(param.placements) != (Shard(0),):
            raise RuntimeError(f"unexpected placement {param.placements} of a sharded parameter")
        local = param.to_local()
        rows = param.shape[0]
        start = min(self.rank * -(-rows // self.world), rows)
        return local, slice(start, start + local.shape[0])

    def _eval_batch(self, model: nn.Module, batch: torch.Tensor | None) -> float:
        """Every rank: the batch from rank 0, the mean loss of this rank's rows, averaged over the ranks (equal
        rows each: the mean over the batch). A batch that does not split runs whole on every rank."""
        from p2p_diloco.train.data.corpus import evaluate

        shape = torch.tensor(batch.shape if batch is not None else (0, 0, 0), dtype=torch.long, device=self.comm)
        dist.broadcast(shape, 0)
        if batch is None:
            batch = torch.empty(tuple(shape.tolist()), dtype=torch.long, device=self.comm)
        batch = batch.to(self.comm).contiguous()
        dist.broadcast(batch, 0)
        x, y = self._rows(batch) if batch.shape[1] % self.world == 0 else (batch[0].to(self.device),
                                                                           batch[1].to(self.device))
        module = getattr(model, "_orig_mod", model)  # the same forward (and collectives) on every rank
        loss = torch.tensor([evaluate(module, [(x, y)])], dtype=torch.float64, device=self.comm)
        reshard(module)
        dist.all_reduce(loss)
        return float(loss) / self.world

    def _share_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, params: bool, opt: bool) -> None:
        # The parameters reached every rank's shard in `set_params`. A loaded AdamW state (a checkpoint of a
        # one-process unit) would be whole tensors on rank 0 only: every rank starts a fresh state instead.
        if opt:
            if self.rank == 0:
                logger.warning("an FSDP unit does not restore the inner AdamW state: every rank starts a fresh one")
            optimizer.state.clear()


def _full(param: torch.Tensor) -> torch.Tensor:
    """A parameter's full values (an all-gather every rank joins, for a sharded one)."""
    with torch.no_grad():  # no autograd record of the gather
        return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, each sharded as its own group: the ModuleList holding the most parameters (the
    built-in GPT's `transformer.h`, a Hugging Face decoder's `layers`); none for a model without one (then the
    root's group holds everything)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(best)


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters a forward without backward left whole (FSDP2's root keeps its own after a
    forward, expecting the backward): the next `set_params` and step then find every parameter sharded."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
