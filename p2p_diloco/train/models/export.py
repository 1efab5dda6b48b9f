"""A trained replica as a Hugging Face model folder: (spec, theta) -> config.json, model.safetensors, tokenizer.

`export_folder(spec, theta, out)` writes a folder that `transformers.AutoModelForCausalLM.from_pretrained(out)`
and `AutoTokenizer.from_pretrained(out)` load, with no code of ours:
- a Hugging Face family (llama, qwen2, mistral, gpt2, or a model folder's config) is the run's own transformers
  model with theta loaded, saved by `save_pretrained`; the tokenizer is the token dataset's (its `tokenizer/`
  folder), and the config's bos/eos/pad ids come from it where the config has none;
- the built-in byte-level GPT (train/models/gpt.py) becomes a `GPT2LMHeadModel`: the same architecture (pre-LN,
  exact GELU, learned positions, tied head), with its Linear weights transposed into GPT-2's Conv1D layout;
- a byte corpus gets a byte-level tokenizer whose ids are the byte values: text -> its UTF-8 bytes and back.
A README.md (model card: run, spec hash, version vector, parameters) and run_spec.json (the RunSpec) go with it.

`read_state(path)` finds theta and its meta in what a peer leaves on disk: a checkpoint folder, a peer's checkpoint
folder (the newest good checkpoint), or a peer's --out-dir (its checkpoints/, else its final theta.pt).
Nothing here touches the network.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from p2p_diloco.config import ConfigError, RunSpec
from p2p_diloco.sync.version_vector import VersionVector
from p2p_diloco.train.state.checkpoint import MANIFEST_FILE, STATE_FILE, CheckpointError, CheckpointStore

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SPEC_FILE = "run_spec.json"
FINAL_THETA, FINAL_VV = "theta.pt", "version_vector.json"  # what a peer writes into --out-dir at exit


class ExportError(ConfigError):
    """Nothing usable to export, or nowhere to write it; the message says what to pass instead."""


# ---- where theta comes from ---------------------------------------------------------------------------------

@dataclasses.dataclass
class State:
    """theta and what is known of it: meta (spec_hash, round, step, version_vector, maybe spec) and its source."""

    theta: torch.Tensor
    meta: dict[str, Any]
    source: str

    def spec(self) -> RunSpec | None:
        """The run's spec recorded with theta (checkpoints written since the spec went into the meta), else None."""
        d = self.meta.get("spec")
        if not isinstance(d, dict):
            return None
        spec = RunSpec.from_dict(d)
        want = self.meta.get("spec_hash")
        if want and spec.spec_hash() != want:
            raise ExportError(f"{self.source}: the recorded spec hashes to {spec.spec_hash()[:12]}, the manifest "
                              f"says {str(want)[:12]} (corrupt?)")
        return spec


def read_state(path: str | Path) -> State:
    """theta and its meta from a checkpoint, a peer's checkpoint folder or its --out-dir (see the docstring)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ExportError(f"{folder}: no such folder; pass a checkpoint (ckpt-N), a peer's checkpoint folder or "
                          f"its --out-dir")
    if (folder / MANIFEST_FILE).is_file():  # one checkpoint
        store = CheckpointStore(folder.parent)
        try:
            body = store.verify(folder)
            tensors = load_file(str(folder / STATE_FILE))
        except (CheckpointError, OSError, ValueError) as e:
            raise ExportError(f"checkpoint {folder} is unusable: {e}") from None
        return _checked(tensors, body["meta"], str(folder))
    for candidate in (folder, folder / "checkpoints"):
        store = CheckpointStore(candidate)
        if store.numbered():
            found = store.load_newest(lambda c: _checked(c.tensors, c.meta, str(c.path)))
            if found is None:
                reasons = "; ".join(f"{name}: {why}" for name, why in store.skipped)
                raise ExportError(f"no usable checkpoint in {candidate} ({reasons})")
            return _checked(found.tensors, found.meta, str(found.path))
    if (folder / FINAL_THETA).is_file():
        try:
            theta = torch.load(folder / FINAL_THETA, map_location="cpu", weights_only=True)
            meta = json.loads((folder / FINAL_VV).read_text()) if (folder / FINAL_VV).is_file() else {}
        except Exception as e:  # a torn or foreign file: say which
            raise ExportError(f"{folder / FINAL_THETA} is unreadable: {type(e).__name__}: {e}") from None
        return _checked({"theta": theta}, meta if isinstance(meta, dict) else {}, str(folder / FINAL_THETA))
    raise ExportError(f"{folder} holds no checkpoint (ckpt-N/manifest.json), no checkpoints/ and no {FINAL_THETA}")


def _checked(tensors: dict[str, torch.Tensor], meta: dict[str, Any], source: str) -> State:
    theta = tensors.get("theta")
    if not torch.is_tensor(theta) or theta.dim() != 1 or theta.dtype != torch.float32:
        raise ExportError(f"{source}: no 1-D float32 theta in it")
    if not bool(torch.isfinite(theta).all()):
        raise ExportError(f"{source}: theta is not finite")
    return State(theta, dict(meta), source)


# ---- the model -------------------------------------------------------------------------------------------------

def build_for_export(spec: RunSpec, theta: torch.Tensor) -> Any:
    """The run's model (train/models/build.py) with theta loaded, on the CPU in float32."""
    from p2p_diloco.train.models.build import build_model, load_flat_params

    # theta overwrites every weight: a run that started from a model folder's weights needs no such folder here
    model = build_model(dataclasses.replace(spec.model, weights_sha256=""), spec.seed)
    try:
        load_flat_params(model, theta)
    except ValueError as e:
        raise ExportError(f"theta does not fit the run's model: {e}") from None
    return model.eval()


def to_hf_model(spec: RunSpec, theta: torch.Tensor) -> Any:
    """A transformers PreTrainedModel holding theta: the HF model itself, or the built-in GPT as GPT-2."""
    model = build_for_export(spec, theta)
    return gpt_to_gpt2(model) if spec.model.arch == "gpt" else model.hf.eval()


@torch.no_grad()
def gpt_to_gpt2(model: Any) -> Any:
    """The built-in GPT as a `GPT2LMHeadModel` with the same weights (Conv1D weights = Linear weights, transposed)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = model.config
    config = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=4 * cfg.n_embd,
                        activation_function="gelu", layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                        pad_token_id=None)
    with torch.random.fork_rng(devices=[]):  # its own init draws from the global RNG; every weight is replaced
        gpt2 = GPT2LMHeadModel(config)
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {name: (p.t() if name.endswith(conv1d) else p).detach().clone()
             for name, p in model.state_dict().items() if name != "lm_head.weight"}
    missing, unexpected = gpt2.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" and not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:  # a transformers whose GPT-2 names its weights otherwise: fail, not a silent mix
        raise ExportError(f"GPT-2 conversion: missing {missing[:4]}, unexpected {unexpected[:4]}")
    gpt2.tie_weights()
    return gpt2.eval()


# ---- tokenizers ------------------------------------------------------------------------------------------------

def byte_tokenizer(block_size: int) -> Any:
    """A fast tokenizer whose ids are byte values: text -> its UTF-8 bytes, ids -> bytes -> text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _bytes_to_unicode()  # ByteLevel's printable stand-in for each byte
    tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=block_size,
                                   clean_up_tokenization_spaces=False)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what tokenizers' ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def token_tokenizer_dir(spec: RunSpec) -> Path | None:
    """The `tokenizer/` folder of the run's token dataset, None for a byte corpus; ExportError if it is missing."""
    from p2p_diloco.train.data.resolve import token_dataset_path

    try:
        path = token_dataset_path(spec.data)
    except Exception as e:  # the dataset named by the spec is not on this machine, or broken
        raise ExportError(f"the run's token dataset {spec.data.corpus!r} is not usable here ({e}); pass --tokenizer "
                          f"DIR (its tokenizer/ folder)") from None
    if path is None:
        if spec.model.arch != "gpt" and spec.model.vocab_size > 256:
            raise ExportError(f"data.corpus {spec.data.corpus!r} is not a token dataset on this machine, but the model "
                              f"has {spec.model.vocab_size} tokens; pass --tokenizer DIR (the dataset's tokenizer/)")
        return None
    folder = path / "tokenizer"
    if not (folder / "tokenizer.json").is_file():
        raise ExportError(f"{folder} has no tokenizer.json; pass --tokenizer DIR")
    return folder


def _set_special_ids(hf: Any, tokenizer: Any) -> None:
    """The config's (and generation config's) bos/eos/pad ids from the tokenizer, where the config has none."""
    gen = getattr(hf, "generation_config", None)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if value is None and name == "pad_token_id":
            value = getattr(tokenizer, "eos_token_id", None)  # generate() pads with eos when there is no pad
        if value is not None and getattr(hf.config, name, None) is None:
            setattr(hf.config, name, value)
        if value is not None and gen is not None and getattr(gen, name, None) is None:
            setattr(gen, name, value)


# ---- the folder ------------------------------------------------------------------------------------------------

def export_folder(spec: RunSpec, theta: torch.Tensor, out: str | Path, *, dtype: str = "fp32",
                  tokenizer_dir: str | Path | None = None, meta: dict[str, Any] | None = None,
                  source: str = "", force: bool = False) -> Path:
    """Write the HF folder for (spec, theta) at `out`: into a temp folder beside it, renamed at the end. A
    non-empty `out` is refused unless `force` (then replaced whole). Returns `out`."""
    from transformers import AutoTokenizer

    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out).expanduser()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not force:
        raise ExportError(f"{out} exists and is not empty; pass --force to replace it, or another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tok_dir = Path(tokenizer_dir).expanduser() if tokenizer_dir else token_tokenizer_dir(spec)
    if tok_dir is not None and spec.data.tokenizer_fingerprint:
        from p2p_diloco.train.data.tokens_format import tokenizer_fingerprint

        have = tokenizer_fingerprint(tok_dir)
        if have != spec.data.tokenizer_fingerprint:  # a model with another tokenizer's ids writes gibberish
            raise ExportError(f"the tokenizer in {tok_dir} (fingerprint {have}) is not the run's "
                              f"({spec.data.tokenizer_fingerprint}); pass --tokenizer DIR with the run's tokenizer/")
    hf = to_hf_model(spec, theta)
    if tok_dir is None:
        tokenizer = byte_tokenizer(spec.model.block_size)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        except Exception as e:
            raise ExportError(f"cannot load the tokenizer in {tok_dir}: {type(e).__name__}: {e}") from None
        if len(tokenizer) > hf.config.vocab_size:
            raise ExportError(f"the tokenizer in {tok_dir} has {len(tokenizer)} tokens, the model "
                              f"{hf.config.vocab_size}")
    _set_special_ids(hf, tokenizer)
    hf = hf.to(DTYPES[dtype])
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        hf.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=1, sort_keys=True))
        (tmp / "README.md").write_text(model_card(spec, hf, meta or {}, source=source, dtype=dtype,
                                                  tokenizer="bytes (UTF-8)" if tok_dir is None else str(tok_dir)))
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def version_summary(meta: dict[str, Any]) -> str:
    """'N updates from K senders (digest ...)' from a meta's version vector, or 'unknown'."""
    vv_dict = meta.get("version_vector")
    if not isinstance(vv_dict, dict):
        return "unknown"
    try:
        vv = VersionVector.from_dict(vv_dict, holes=meta.get("version_vector_holes"))
    except Exception:  # an odd vector in an old file must not stop the export
        return "unreadable"
    return f"{vv.total()} updates merged from {len(vv_dict)} sender(s), digest {vv.digest().hex()[:16]}"


def model_card(spec: RunSpec, hf: Any, meta: dict[str, Any], *, source: str, dtype: str, tokenizer: str) -> str:
    params = sum(p.numel() for p in hf.parameters())
    m = spec.model
    rows = [("run id", spec.run_id), ("spec hash", spec.spec_hash()), ("source", source or "unknown"),
            ("round", meta.get("round", "unknown")), ("inner steps done here", meta.get("step", "unknown")),
            ("version vector", version_summary(meta)), ("trained as", m.arch if m.arch != "gpt" else
                                                         "the built-in byte-level GPT (exported as GPT-2)"),
            ("architecture", f"{hf.config.model_type}, {m.n_layer} layers, {m.n_head} heads, width {m.n_embd}, "
                             f"context {m.block_size}"),
            ("parameters", f"{params:,}"), ("dtype", dtype), ("tokenizer", tokenizer),
            ("data", spec.data.corpus)]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"""# {spec.run_id}

A causal language model trained with p2p-diloco (peer-to-peer DiLoCo): one peer's replica of the run's
parameters, exported by `p2p-diloco export`.

| | |
|---|---|
{table}

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER")
tokenizer = AutoTokenizer.from_pretrained("THIS_FOLDER")
```

or `p2p-diloco generate THIS_FOLDER --prompt "..."`. The run's full spec is in `{SPEC_FILE}`.
"""
