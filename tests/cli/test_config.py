"""RunSpec hashing and validation, the config schema, and the CLI options generated from the dataclasses."""

import dataclasses

import pytest

from p2p_diloco.cli.args import ArgumentParser, add_config_args, apply_args, field_docs
from p2p_diloco.cli.options import simulate_options
from p2p_diloco.config import (
    PRESETS,
    BootstrapConfig,
    ConfigError,
    JoinConfig,
    RunSpec,
    SimConfig,
    SimulateConfig,
    StatusConfig,
    preset,
)
from p2p_diloco.config.load import leaves


def test_spec_hash_is_content_hash():
    a, b = preset("test"), preset("test")
    assert a.spec_hash() == b.spec_hash()
    c = dataclasses.replace(a, inner=dataclasses.replace(a.inner, inner_steps=21))
    assert c.spec_hash() != a.spec_hash()
    assert a.differing_fields(c) == ["inner.inner_steps: 20 != 21"]
    assert RunSpec.from_dict(a.to_dict()) == a


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_validate(name):
    preset(name).validate()


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown preset 'huge'.*test, tiny, small, base"):
        preset("huge")


@pytest.mark.parametrize("change, message", [
    (lambda s: dataclasses.replace(s, inner=dataclasses.replace(s.inner, inner_steps=0)), "inner_steps must be > 0"),
    (lambda s: dataclasses.replace(s, outer=dataclasses.replace(s.outer, codec="zip")), "codec must be one of"),
    (lambda s: dataclasses.replace(s, outer=dataclasses.replace(s.outer, momentum=1.0)), "momentum must be in"),
    (lambda s: dataclasses.replace(s, model=dataclasses.replace(s.model, n_head=3)), "divisible by model.n_head"),
    (lambda s: dataclasses.replace(s, run_id=""), "run_id must be"),
])
def test_invalid_hyper_parameters_are_refused_clearly(change, message):
    with pytest.raises(ConfigError, match=message):
        change(preset("test")).validate()


def test_from_dict_refuses_unknown_fields():
    d = preset("test").to_dict()
    d["inner"]["inner_stepz"] = 3
    with pytest.raises(ConfigError, match="unknown inner fields"):
        RunSpec.from_dict(d)


@pytest.mark.parametrize("root", [JoinConfig, SimulateConfig, BootstrapConfig, StatusConfig])
def test_every_config_field_has_a_docstring(root):
    owners = {owner for _path, owner, _tp in leaves(root)} | {root}
    for cls in owners:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_generated_options_override_nested_fields():
    parser = ArgumentParser()
    add_config_args(parser, simulate_options("test"))
    args = parser.parse_args(["--inner-steps", "7", "--spec.outer.codec", "int4", "--nesterov", "false",
                              "--spec.run_id", "x", "--sim.peers", "3"])
    config = apply_args(SimulateConfig(spec=preset("test")), args, "simulate")
    spec = config.spec
    assert (spec.inner.inner_steps, spec.outer.codec, spec.outer.nesterov, spec.run_id) == (7, "int4", False, "x")
    assert spec.model == preset("test").model and config.sim.peers == 3


def test_sim_config_parses_scripts_and_refuses_bad_ones():
    sim = SimConfig(peers=3, speeds=("1", "0.5"), crash=("2@30",), join=("60",)).validate()
    assert sim.speed_factors() == [1.0, 0.5, 1.0] and sim.crashes() == [(2, 30.0)] and sim.joins() == [60.0]
    with pytest.raises(ConfigError, match="PEER@SECONDS"):
        SimConfig(crash=("soon",)).validate()
    with pytest.raises(ConfigError, match="peers are 0..3"):
        SimConfig(crash=("9@1",)).validate()
