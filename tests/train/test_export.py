"""Exporting a replica as a Hugging Face folder (train/models/export.py): the folder loads with AutoModelForCausalLM and
AutoTokenizer and gives the trained model's logits; the byte tokenizer round-trips text; theta is found in a real
checkpoint, an older one without the spec, and a peer's final theta.pt."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import ModelConfig, preset
from p2p_diloco.train.data.corpus import load_corpus
from p2p_diloco.train.exchange import CollectingExchange
from p2p_diloco.train.learner import Learner, SwarmView
from p2p_diloco.train.loop import run_rounds
from p2p_diloco.train.models.build import build_model, flat_params, load_flat_params
from p2p_diloco.train.models.export import ExportError, byte_tokenizer, export_folder, read_state
from p2p_diloco.train.state.checkpoint import CheckpointStore
from p2p_diloco.train.state.manager import StateManager
from p2p_diloco.wire.identity import Identity

pytestmark = pytest.mark.timeout(120)

BASE = preset("test")
SPEC = dataclasses.replace(BASE, inner=dataclasses.replace(BASE.inner, inner_steps=2))
LLAMA = dataclasses.replace(SPEC, model=ModelConfig(arch="llama", n_layer=2, n_head=2, n_embd=64, block_size=32,
                                                    vocab_size=256))
TEXT = "def f(x):\n\treturn x ** 2  # héllo ☃ 😀\n"


def trained_theta(spec, scale: float = 0.05) -> tuple[torch.nn.Module, torch.Tensor]:
    """The run's model moved away from its init (so a mix-up of weights would show), and its flat theta."""
    model = build_model(spec.model, spec.seed).eval()
    theta = flat_params(model)
    theta = theta + scale * torch.randn(theta.numel(), generator=torch.Generator().manual_seed(1))
    load_flat_params(model, theta)
    return model, theta


def load(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.mark.parametrize("spec", [SPEC, LLAMA], ids=["builtin-gpt", "llama"])
def test_exported_model_gives_the_same_logits(tmp_path: Path, spec) -> None:
    model, theta = trained_theta(spec)
    out = export_folder(spec, theta, tmp_path / "hf", meta={"round": 3, "version_vector": {"peerA": 2}},
                        source="test")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "run_spec.json"} <= names
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp folder left beside it
    hf, tokenizer = load(out)
    ids = torch.tensor([tokenizer(TEXT)["input_ids"][: spec.model.block_size]])
    with torch.no_grad():
        ours, theirs = model(ids)[0], hf(ids).logits
    assert theirs.shape == ours.shape and torch.allclose(ours, theirs, atol=1e-4)
    expected_type = "gpt2" if spec.model.arch == "gpt" else "llama"
    assert json.loads((out / "config.json").read_text())["model_type"] == expected_type
    card = (out / "README.md").read_text()
    assert spec.spec_hash() in card and "2 updates merged from 1 sender" in card
    assert json.loads((out / "run_spec.json").read_text()) == json.loads(json.dumps(spec.to_dict()))


def test_byte_tokenizer_round_trips_text_as_utf8_bytes(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    byte_tokenizer(64).save_pretrained(str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in (TEXT, " leading space", "", "\x00\x7f\r\n"):
        ids = tokenizer(text)["input_ids"]
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 256


def test_bf16_export_and_out_rules(tmp_path: Path) -> None:
    _, theta = trained_theta(SPEC)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export_folder(SPEC, theta, tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    export_folder(SPEC, theta, tmp_path / "busy", dtype="bf16", force=True)
    assert not (tmp_path / "busy" / "keep.txt").exists()
    hf, _ = load(tmp_path / "busy")
    assert next(hf.parameters()).dtype == torch.bfloat16
    with pytest.raises(ExportError, match="does not fit"):
        export_folder(SPEC, theta[:-1], tmp_path / "short")


def test_export_from_a_real_checkpoint(tmp_path: Path) -> None:
    """A learner trains a round, the StateManager checkpoints it (with the spec now), and the export of that
    checkpoint is the learner's replica."""
    identity = Identity.generate()
    corpus = load_corpus(SPEC.data, block_size=SPEC.model.block_size)
    learner = Learner(SPEC, identity, corpus, shard=1, num_shards=4)
    state = StateManager(tmp_path / "ckpts", run_id=SPEC.run_id, spec_hash=SPEC.spec_hash(),
                         peer_id=identity.peer_id)
    state.open()
    try:
        state.attach(learner)
        view = SwarmView(num_peers=2, samples_per_round=2 * SPEC.inner.inner_steps * SPEC.data.batch_size)
        run_rounds(learner, CollectingExchange(view))
        state.save(learner, round=1)
    finally:
        state.close()
    found = read_state(tmp_path / "ckpts")  # the peer's folder: its newest good checkpoint
    assert found.spec() == SPEC and found.meta["round"] == 1
    theta, _ = learner.replica.snapshot()
    assert torch.equal(found.theta, theta)
    assert torch.equal(read_state(Path(found.source)).theta, theta)  # the ckpt-N folder itself
    out = export_folder(found.spec(), found.theta, tmp_path / "hf", meta=found.meta, source=found.source)
    hf, tokenizer = load(out)
    model = build_model(SPEC.model, SPEC.seed).eval()
    load_flat_params(model, theta)
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(model(ids)[0], hf(ids).logits, atol=1e-4)
    assert "1 updates merged from 1 sender" in (out / "README.md").read_text()


def test_older_checkpoint_and_final_theta_have_no_spec(tmp_path: Path) -> None:
    _, theta = trained_theta(SPEC)
    CheckpointStore(tmp_path / "old").save({"theta": theta}, {"round": 2, "spec_hash": SPEC.spec_hash(),
                                                              "version_vector": {}})
    found = read_state(tmp_path / "old")
    assert found.spec() is None and torch.equal(found.theta, theta) and found.meta["round"] == 2
    out_dir = tmp_path / "peer-out"  # what peer/output.py save_state writes at exit
    out_dir.mkdir()
    torch.save(theta, out_dir / "theta.pt")
    (out_dir / "version_vector.json").write_text(json.dumps({"version_vector": {}, "spec_hash": SPEC.spec_hash()}))
    found = read_state(out_dir)
    assert found.spec() is None and torch.equal(found.theta, theta) and found.source.endswith("theta.pt")
    with pytest.raises(ExportError, match="no such folder"):
        read_state(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="holds no checkpoint"):
        read_state(tmp_path / "empty")
