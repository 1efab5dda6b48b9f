"""`p2p-diloco plan`: how much memory a unit needs, part by part, on each device and on the host, and whether it
fits (train/hardware/memory_plan.py estimates; memory_fit.py reads what is free and finds the largest Llama).

It takes `join`'s options (the same generator, cli/args.py), so the command a volunteer is about to run, with
`join` replaced by `plan`, answers before anything is allocated.
"""

from __future__ import annotations

import argparse
import dataclasses

from p2p_diloco.cli.args import add_run_args, load_config
from p2p_diloco.cli.options import join_options
from p2p_diloco.config import JoinConfig, preset

# memory_fit.LLAMA_FAMILY's keys, here without importing torch (`--help` must stay fast)
LLAMA_SIZES = ("135M", "360M", "1B", "2B", "3B", "7B", "13B", "34B", "70B")


def add_plan_command(sub: argparse._SubParsersAction) -> None:
    text = "how much memory a unit needs, part by part, and whether it fits this machine"
    p = sub.add_parser("plan", help=text, description=text + ". Takes join's options (--model, --preset, --config, "
                       "--precision, --micro-batch, --gpus, --training.parallel fsdp, --SECTION.FIELD...) and prints "
                       "each part of the memory a unit needs on each device and on the host of rank 0, against what "
                       "is free here (or --device-memory / --host-memory). Exit 0 if it fits; 1 with one line naming "
                       "what to change.")
    add_run_args(p, join_options, default_preset="test")
    p.add_argument("--device-memory", metavar="SIZE", help="memory of each GPU, e.g. 24GB or 24GiB (default: free "
                   "memory of the visible GPU); given, the plan is for a GPU unit")
    p.add_argument("--host-memory", metavar="SIZE", help="host memory, e.g. 64GB (default: MemAvailable)")
    p.add_argument("--llama", choices=LLAMA_SIZES, help="plan a Llama of this size (its shape replaces the model's; "
                   "the block size stays --spec.model.block-size)")
    p.add_argument("--largest", action="store_true", help="list every Llama size from 135M to 70B with these "
                   "settings and name the largest that fits")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    config = load_config(JoinConfig(spec=preset(args.preset)), args, "join").validate()
    import torch  # only once the options are known to be good

    from p2p_diloco.train.data.resolve import resolve_spec
    from p2p_diloco.train.hardware.memory_fit import (
        LLAMA_FAMILY,
        device_available,
        host_available,
        join_setup,
        largest_llama,
        parse_size,
    )
    from p2p_diloco.train.hardware.memory_plan import plan_memory

    spec = resolve_spec(config.spec)
    if args.llama:
        spec = dataclasses.replace(spec, model=dataclasses.replace(LLAMA_FAMILY[args.llama],
                                                                   block_size=spec.model.block_size))
    config = dataclasses.replace(config, spec=spec)
    device = config.training.device
    if device == "auto":  # a machine without a GPU plans one when told its memory
        device = "cuda" if torch.cuda.is_available() or args.device_memory else "cpu"
    setup = join_setup(config, device=device, ranks=config.training.gpus)
    device_bytes = parse_size(args.device_memory) if args.device_memory else device_available(device)
    host_bytes = parse_size(args.host_memory) if args.host_memory else host_available()
    if args.largest:
        return _print_largest(largest_llama(setup, device_bytes, host_bytes), device_bytes, host_bytes)
    plan = plan_memory(setup)
    print(plan.table(device_bytes, host_bytes))
    if setup.gpu and device_bytes is None:
        print("(no GPU visible here: pass --device-memory SIZE to check the device too)")
    verdict = plan.check(device_bytes, host_bytes)
    print(verdict or "fits")
    return 0 if verdict is None else 1


def _print_largest(rows: list, device_bytes: int | None, host_bytes: int | None) -> int:
    from p2p_diloco.train.hardware.memory_plan import gib

    print(f"{'Llama':<6}{'parameters':>14}{'each device':>14}{'host':>14}  fits")
    for name, plan, fits in rows:
        device = gib(plan.device_total) if plan.setup.gpu else "(host)"
        print(f"{name:<6}{plan.params / 1e9:>13.2f}B{device:>14}{gib(plan.host_need):>14}  {'yes' if fits else 'no'}")
    fitting = [(name, plan) for name, plan, fits in rows if fits]
    if not fitting:
        print(f"no Llama of this family fits: the smallest {rows[0][1].check(device_bytes, host_bytes)}")
        return 1
    name, plan = fitting[-1]
    print(f"largest that fits: Llama {name} ({plan.params / 1e9:.2f}B parameters; {plan.describe()})")
    return 0
