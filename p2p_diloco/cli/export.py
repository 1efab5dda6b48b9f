"""`p2p-diloco export` and `p2p-diloco generate`: use the result of a run.

`export` writes a Hugging Face model folder (config.json, model.safetensors, tokenizer files, a model card) that
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` load, from
- `--checkpoint PATH`: a checkpoint folder (ckpt-N), a peer's checkpoint folder (its newest good checkpoint) or a
  peer's --out-dir (its checkpoints/, else the theta.pt it wrote at exit); or
- `--bootstrap MULTIADDR [--run-id RUN]`: a running swarm, where a throwaway client-mode node reads the run's spec
  from the DHT and fetches a verified snapshot (theta + version vector) from the peer with the freshest replica,
  by the joiners' state-sync client (net/statesync/client.py).
The model is rebuilt from the run's spec: recorded in the checkpoint (or published on the DHT); for an older
checkpoint or a theta.pt, pass the --preset / --config (and --model, --corpus) the peer joined with, which are
checked against the recorded spec hash. The conversion itself is train/models/export.py.

`generate FOLDER --prompt TEXT` samples from such a folder with transformers' `generate`.

torch, transformers and hivemind are imported only inside the command functions: every `p2p-diloco ...`
invocation builds all sub-parsers, and `--help` must stay fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from p2p_diloco.cli.swarm import _fail
from p2p_diloco.config import PRESETS, ConfigError, RunSpec

if TYPE_CHECKING:  # imported where used: `export --help` imports neither torch nor transformers
    from p2p_diloco.train.models.export import State

SPEC_OPTIONS = {"run_id": "join__spec__run_id", "model": "join__spec__model__arch",
                "corpus": "join__spec__data__corpus"}
"""export's spec options, under the dests of join's generated options (`load_config(JoinConfig, args, "join")`)."""


def add_export_commands(sub: argparse._SubParsersAction) -> None:
    """Register `export` and `generate` on the CLI's sub-parsers."""
    text = "write a run's model as a Hugging Face folder (from a checkpoint or a running swarm)"
    p = sub.add_parser("export", help=text, description=text + ". The folder holds config.json, model.safetensors, "
                       "the tokenizer (the token dataset's, or a byte-level one for a byte corpus: ids are byte "
                       "values), README.md and run_spec.json, and loads with transformers' "
                       "AutoModelForCausalLM/AutoTokenizer.from_pretrained. The built-in byte-level GPT is written "
                       "as GPT-2. Give --checkpoint or --bootstrap.")
    source = p.add_argument_group("where theta comes from (one of)")
    source.add_argument("--checkpoint", metavar="PATH", help="a checkpoint folder (ckpt-N), a peer's checkpoint "
                        "folder (its newest good checkpoint is taken) or a peer's --out-dir")
    source.add_argument("--bootstrap", metavar="MULTIADDR", action="append", default=[],
                        help="a running swarm's bootstrap multiaddr (repeat, or comma-separate): fetch a verified "
                        "snapshot of the freshest replica of --run-id")
    p.add_argument("--out", metavar="DIR", required=True, help="the folder to write (refused if it is not empty, "
                   "unless --force); written beside it first, then renamed")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="weights' dtype (default fp32)")
    p.add_argument("--tokenizer", metavar="DIR", help="the tokenizer folder to ship (default: the run's token "
                   "dataset's tokenizer/, or a byte-level tokenizer for a byte corpus)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="with --bootstrap: DHT and transfer timeout "
                   "(default 30)")
    spec = p.add_argument_group("the run's spec, for a checkpoint that does not record it (older ones, theta.pt) "
                                "or to name the run with --bootstrap")
    spec.add_argument("--preset", choices=list(PRESETS), help="the preset the peer joined with")
    spec.add_argument("--config", metavar="FILE", help="the --config TOML file the peer joined with")
    spec.add_argument("--run-id", dest=SPEC_OPTIONS["run_id"], metavar="RUN", help="the run (default: default)")
    spec.add_argument("--model", dest=SPEC_OPTIONS["model"], metavar="ARCH", help="join's --model")
    spec.add_argument("--corpus", dest=SPEC_OPTIONS["corpus"], metavar="CORPUS", help="join's --corpus")
    p.set_defaults(func=cmd_export)

    text = "sample text from an exported model folder"
    p = sub.add_parser("generate", help=text, description=text + " (written by `p2p-diloco export`, or any local "
                       "Hugging Face causal LM folder). Prints the prompt and its continuation.")
    p.add_argument("folder", metavar="FOLDER", help="the model folder")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add (default 64; fewer if the "
                   "model's context ends sooner)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0: greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0: all (default 50)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", default="auto", help="auto (cuda, else mps, else cpu), cpu, cuda, cuda:N, mps")
    p.set_defaults(func=cmd_generate)


# ---------------------------------------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    if bool(args.checkpoint) == bool(args.bootstrap):
        return _fail("export", "give one of --checkpoint PATH or --bootstrap MULTIADDR")
    if args.timeout_s <= 0:
        return _fail("export", f"--timeout-s must be > 0, got {args.timeout_s}")
    _quiet_transformers()
    from p2p_diloco.train.models.export import export_folder

    try:
        spec, state = _from_swarm(args) if args.bootstrap else _from_checkpoint(args)
        out = export_folder(spec, state.theta, args.out, dtype=args.dtype, tokenizer_dir=args.tokenizer,
                            meta=state.meta, source=state.source, force=args.force)
    except (ConfigError, OSError) as err:  # ExportError, StateSyncError-as-ConfigError, a bad spec, disk full
        return _fail("export", err)
    print(f"wrote {out} ({spec.model.arch}, run {spec.run_id!r}, spec {spec.spec_hash()[:12]}, from "
          f"{state.source})")
    return 0


def _spec_given(args: argparse.Namespace) -> bool:
    return bool(args.preset or args.config or any(getattr(args, dest) for dest in SPEC_OPTIONS.values()))


def _spec_from_args(args: argparse.Namespace) -> RunSpec:
    """The spec the --preset / --config / --model / --corpus options give, resolved like join's."""
    from p2p_diloco.cli.args import load_config
    from p2p_diloco.config import JoinConfig, preset
    from p2p_diloco.train.data.resolve import resolve_spec

    config = load_config(JoinConfig(spec=preset(args.preset or "test")), args, "join")
    return resolve_spec(config.spec.validate())


def _from_checkpoint(args: argparse.Namespace) -> tuple[RunSpec, State]:
    from p2p_diloco.train.models.export import ExportError, read_state

    state = read_state(args.checkpoint)
    spec = state.spec()
    if spec is not None:
        if _spec_given(args):
            print("p2p-diloco export: the checkpoint records its run's spec; --preset/--config/--model/--corpus "
                  "are ignored", file=sys.stderr)
        return spec, state
    if not _spec_given(args):
        raise ExportError(f"{state.source} does not record the run's spec (written by an older version, or a "
                          "peer's final theta.pt): pass the --preset and --config (and --model, --corpus) the "
                          "peer joined with")
    spec = _spec_from_args(args)
    want = state.meta.get("spec_hash")
    if want and spec.spec_hash() != want:
        raise ExportError(f"the options give spec {spec.spec_hash()[:12]} but {state.source} is of spec "
                          f"{str(want)[:12]}: pass the --preset, --config, --model and --corpus the peer joined with")
    return spec, state


def _from_swarm(args: argparse.Namespace) -> tuple[RunSpec, State]:
    import asyncio

    from p2p_diloco.net.statesync.client import StateSyncError
    from p2p_diloco.net.transport.node import NodeError

    bootstrap = tuple(part for arg in args.bootstrap for part in arg.split(",") if part)
    run_id = getattr(args, SPEC_OPTIONS["run_id"]) or "default"
    try:
        return asyncio.run(_fetch_replica(bootstrap, run_id, args.timeout_s))
    except (StateSyncError, NodeError) as err:
        raise ConfigError(str(err)) from None
    except (TimeoutError, asyncio.TimeoutError):
        raise ConfigError(f"the swarm did not answer within {args.timeout_s:g}s") from None


async def _fetch_replica(bootstrap: tuple[str, ...], run_id: str, timeout_s: float) -> tuple[RunSpec, State]:
    """(spec, State) of the freshest live replica of `run_id`, fetched and verified through state sync."""
    import asyncio
    import dataclasses
    import tempfile

    from p2p_diloco.cli.status import _reader_node
    from p2p_diloco.config import StateSyncConfig, StatusConfig
    from p2p_diloco.net.discovery.records import fetch_run_spec, list_peers
    from p2p_diloco.net.discovery.status import number
    from p2p_diloco.net.statesync.client import fetch_snapshot
    from p2p_diloco.train.models.build import build_model
    from p2p_diloco.train.models.export import ExportError, State

    config = StatusConfig(bootstrap=bootstrap, run_id=run_id, timeout_s=timeout_s).validate()
    with tempfile.TemporaryDirectory(prefix="p2p-diloco-export-") as tmp:
        node = await _reader_node(config, tmp)
        try:
            found = await fetch_run_spec(node, run_id, timeout_s=timeout_s)
            if found is None:
                raise ExportError(f"no spec published for run {run_id!r} on this swarm (check --run-id)")
            spec = RunSpec.from_dict(found[0])
            if spec.spec_hash() != found[1]:
                raise ExportError(f"the run's published spec hashes to {spec.spec_hash()[:12]}, not "
                                  f"{found[1][:12]}")
            records = await list_peers(node, run_id, timeout_s=timeout_s)
            donors = sorted((pid for pid, r in records.items() if number(r, "version_vector_total") > 0),
                            key=lambda pid: -number(records[pid], "version_vector_total"))
            if not donors:
                raise ExportError(f"run {run_id!r} has {len(records)} live peer(s), none with a merged update yet")
            model_cfg = dataclasses.replace(spec.model, weights_sha256="")
            numel = await asyncio.to_thread(lambda: build_model(model_cfg, spec.seed).num_params())
            theta, vv, donor = await fetch_snapshot(node, run_id, spec.spec_hash(), donors, numel,
                                                    StateSyncConfig(timeout_s=timeout_s))
        finally:
            await node.shutdown()
    meta = {"spec_hash": spec.spec_hash(), "version_vector": vv.to_dict(), "version_vector_holes": vv.holes_dict(),
            "round": "unknown (a live replica)", "step": "unknown (a live replica)"}
    return spec, State(theta, meta, f"peer {donor} of run {run_id!r} (live)")


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---------------------------------------------------------------------------------------------- generate


def cmd_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    folder = Path(args.folder).expanduser()
    if not (folder / "config.json").is_file():
        return _fail("generate", f"{folder} is not a model folder (no config.json); make one with "
                     "`p2p-diloco export --checkpoint PATH --out DIR`")
    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0:
        return _fail("generate", "--max-new-tokens must be >= 1, --temperature and --top-k >= 0")
    _quiet_transformers()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from p2p_diloco.train.hardware.device import resolve_device

    device = resolve_device(args.device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                     dtype=torch.float32 if device == "cpu" else "auto")
    except (OSError, ValueError) as err:
        return _fail("generate", f"cannot load {folder}: {type(err).__name__}: {err}")
    module: torch.nn.Module = model  # transformers types its wrapped `to` without `self`; the model is a Module
    module.to(device).eval()
    ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        if tokenizer.bos_token_id is None:
            return _fail("generate", "the prompt is empty and the tokenizer has no bos token to start from")
        ids = torch.tensor([[tokenizer.bos_token_id]])
    context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    new = args.max_new_tokens
    if context:
        if ids.shape[1] >= context:  # keep the prompt's end, leave room for one new token at least
            ids = ids[:, -(context - 1):]
            print(f"p2p-diloco generate: prompt cut to its last {context - 1} tokens (context {context})",
                  file=sys.stderr)
        if ids.shape[1] + new > context:
            new = context - ids.shape[1]
            print(f"p2p-diloco generate: {new} new tokens (the model's context is {context})", file=sys.stderr)
    torch.manual_seed(args.seed)
    sample = args.temperature > 0
    kwargs: dict[str, Any] = dict(max_new_tokens=new, do_sample=sample,
                                  pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                  else tokenizer.eos_token_id)
    if sample:
        kwargs.update(temperature=args.temperature, top_k=args.top_k or None)
    ids = ids.to(device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    return 0
