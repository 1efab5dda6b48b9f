"""Hugging Face causal LMs as learner models (train/models/hf.py, train/data/resolve.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from p2p_diloco.config import ConfigError, ModelConfig, RunSpec
from p2p_diloco.train.data.resolve import resolve_spec
from p2p_diloco.train.models.build import build_model, flat_params, load_flat_params
from p2p_diloco.train.models.hf import HFCausalLM, init_weights

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_families_build_the_same_theta_from_the_seed_and_train(arch):
    cfg = ModelConfig(arch=arch, **TINY)
    a, b = build_model(cfg, 7), build_model(cfg, 7)
    assert isinstance(a, HFCausalLM)
    assert torch.equal(flat_params(a), flat_params(b))
    assert not torch.equal(flat_params(a), flat_params(build_model(cfg, 8)))
    x, y = torch.randint(0, 256, (2, 2, 16))
    logits, loss = a(x, y)
    assert logits.shape == (2, 16, 256)
    assert loss.item() == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)  # a fresh model guesses
    loss.backward()
    assert all(p.grad is not None for p in a.parameters())


def test_init_depends_on_names_and_shapes_not_on_transformers_init():
    cfg = ModelConfig(arch="llama", **TINY)
    model = build_model(cfg, 1)
    theta = flat_params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_()  # whatever HF's own init drew
    init_weights(model.hf, torch.Generator().manual_seed(1), n_layer=2)
    assert torch.equal(flat_params(model), theta)


def test_gpt2_family_has_the_builtin_gpts_size():
    gpt, hf = build_model(ModelConfig(**TINY), 0), build_model(ModelConfig(arch="gpt2", **TINY), 0)
    assert flat_params(gpt).numel() == flat_params(hf).numel()


def test_grouped_query_attention_and_bad_sizes():
    gqa = build_model(ModelConfig(arch="llama", n_kv_head=1, **TINY), 0)
    full = build_model(ModelConfig(arch="llama", **TINY), 0)
    assert flat_params(gqa).numel() < flat_params(full).numel()
    with pytest.raises(ConfigError, match="n_kv_head"):
        ModelConfig(arch="llama", n_kv_head=3, **TINY).validate()
    with pytest.raises(ConfigError, match="at most 256 tokens"):
        ModelConfig(vocab_size=4096).validate()


def _save_folder(tmp_path, with_weights: bool):
    model = build_model(ModelConfig(arch="qwen2", **TINY), 5)
    folder = tmp_path / "qwen"
    model.hf.save_pretrained(folder) if with_weights else folder.mkdir()
    if not with_weights:
        model.hf.config.to_json_file(folder / "config.json")
    return model, folder


def test_model_from_a_config_json_is_in_the_spec_not_its_path(tmp_path):
    _, folder = _save_folder(tmp_path, with_weights=False)
    spec = resolve_spec(RunSpec(model=ModelConfig(arch=str(folder / "config.json"), block_size=16)))
    assert spec.model.arch == "qwen2" and spec.model.hf_config and not spec.model.weights_sha256
    assert str(folder) not in json.dumps(spec.to_dict())  # another machine may keep it elsewhere
    moved = tmp_path / "elsewhere.json"
    moved.write_text((folder / "config.json").read_text())
    assert resolve_spec(RunSpec(model=ModelConfig(arch=str(moved), block_size=16))).spec_hash() == spec.spec_hash()
    model = build_model(spec.model, 0)
    assert model(torch.zeros((1, 16), dtype=torch.long))[0].shape == (1, 16, 256)


def test_model_folder_with_weights_starts_from_them(tmp_path):
    original, folder = _save_folder(tmp_path, with_weights=True)
    spec = resolve_spec(RunSpec(model=ModelConfig(arch=str(folder), block_size=16)))
    assert len(spec.model.weights_sha256) == 64
    started = build_model(spec.model, seed=123)  # the seed does not matter: the weights are the start
    assert torch.equal(flat_params(started), flat_params(original))
    other = dataclasses.replace(spec.model, weights_sha256="0" * 64)
    with pytest.raises(ConfigError, match="pass --model FOLDER"):
        build_model(other, 0)


def test_bad_model_paths_say_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_spec(RunSpec(model=ModelConfig(arch=str(tmp_path / "missing/"))))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        resolve_spec(RunSpec(model=ModelConfig(arch=str(bad))))
    with pytest.raises(ConfigError, match="model.arch must be one of"):
        ModelConfig(arch="lama").validate()


def test_flat_params_round_trip_through_an_hf_model():
    model = build_model(ModelConfig(arch="llama", **TINY), 0)
    theta = flat_params(model)
    load_flat_params(model, theta * 2)
    assert torch.equal(flat_params(model), theta * 2)


def test_a_cached_hub_name_resolves_offline(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = cache / "models--acme--tiny-llama" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text("a" * 40)
    build_model(ModelConfig(arch="llama", **TINY), 0).hf.config.to_json_file(snapshot / "config.json")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # read at call time
    spec = resolve_spec(RunSpec(model=ModelConfig(arch="acme/tiny-llama", block_size=16)))
    assert spec.model.arch == "llama" and spec.model.n_layer == 2
    with pytest.raises(ConfigError, match="nor a hub model of that name in the local cache"):
        resolve_spec(RunSpec(model=ModelConfig(arch="acme/not-cached")))


def test_a_spec_mismatch_names_the_field_inside_the_model_config():
    a = resolve_spec(RunSpec(model=ModelConfig(arch="llama", **TINY)))
    b = dataclasses.replace(a.model, hf_config=json.dumps({"model_type": "llama", "hidden_size": 64}))
    c = dataclasses.replace(a.model, hf_config=json.dumps({"model_type": "llama", "hidden_size": 32}))
    diff = RunSpec(model=b).differing_fields(RunSpec(model=c))
    assert diff == ["model.hf_config.hidden_size: 64 != 32"]


def test_any_model_type_transformers_builds_is_accepted_from_a_config(tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    config.to_json_file(tmp_path / "config.json")
    spec = resolve_spec(RunSpec(model=ModelConfig(arch=str(tmp_path / "config.json"), block_size=16)))
    assert spec.model.arch == "qwen3"
    RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))).validate()  # as a peer receives it from the DHT
    assert build_model(spec.model, 0)(torch.zeros((1, 16), dtype=torch.long))[0].shape == (1, 16, 256)
