"""The memory plan (train/hardware/memory_plan.py, memory_fit.py), `p2p-diloco plan`, and `join`'s refusal."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.cli.plan import LLAMA_SIZES
from p2p_diloco.config import ConfigError, JoinConfig, ModelConfig, preset
from p2p_diloco.train.hardware.memory_fit import LLAMA_FAMILY, check_join_memory, largest_llama, parse_size
from p2p_diloco.train.hardware.memory_plan import (
    CHUNK_NUMEL,
    ModelShape,
    UnitSetup,
    layer_activation_bytes,
    model_shape,
    plan_memory,
)
from p2p_diloco.train.models.build import build_model

LLAMA = ModelConfig(arch="llama", n_layer=2, n_head=4, n_embd=64, n_kv_head=2, block_size=32, vocab_size=512)
GIB = 2**30


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2p_diloco.cli", *args], capture_output=True, text=True,
                          timeout=120)


def _part(components: tuple[tuple[str, int], ...], prefix: str) -> int:
    return sum(b for name, b in components if name.startswith(prefix))


def _activations(plan) -> int:
    return sum(b for name, b in plan.device if "layer" in name or name.startswith(("activations", "logits")))


@pytest.mark.parametrize("model", [preset("test").model, LLAMA], ids=["gpt", "llama"])
def test_parameter_count_is_the_real_models(model: ModelConfig) -> None:
    shape = model_shape(model)  # built on the meta device
    real = build_model(model, seed=0)
    assert shape.params == sum(p.numel() for p in real.parameters())
    assert shape.n_layer == model.n_layer and 0 < shape.largest_unit < shape.params


def test_fsdp_divides_the_sharded_parts_by_the_ranks() -> None:
    shape = model_shape(LLAMA)
    one = plan_memory(UnitSetup(LLAMA, batch_size=8, precision="bf16", gpu=True), shape)
    four = plan_memory(UnitSetup(LLAMA, batch_size=8, precision="bf16", gpu=True, ranks=4, parallel="fsdp"), shape)
    for part in ("weights", "gradients", "AdamW"):
        assert _part(four.device, part) == _part(one.device, part) // 4 == 4 * (2 if part == "AdamW" else 1) \
            * shape.params // 4
    assert _part(four.device, "gathered") == shape.largest_unit * 6 * 2  # fp32 gathered + bf16 cast, x2 prefetch
    ddp = plan_memory(UnitSetup(LLAMA, batch_size=8, precision="bf16", gpu=True, ranks=4), shape)
    assert _part(ddp.device, "weights") == 4 * shape.params and _part(ddp.device, "gradients") == 4 * shape.params
    assert _activations(four) < _activations(one)  # each rank runs batch / 4 sequences
    assert _part(four.host, "replica") == _part(one.host, "replica") == 4 * shape.params  # rank 0's: never sharded
    assert _part(one.host, "chunk buffers") == min(CHUNK_NUMEL, shape.params) * 4 * 3


def test_checkpointing_and_micro_batches_lower_the_activations() -> None:
    shape = model_shape(LLAMA)
    base = UnitSetup(LLAMA, batch_size=16, precision="bf16", gpu=True)
    whole = _activations(plan_memory(base, shape))
    micro = _activations(plan_memory(dataclasses.replace(base, micro_batch=4), shape))
    ckpt = _activations(plan_memory(dataclasses.replace(base, activation_checkpointing=True), shape))
    assert micro * 4 == whole
    assert ckpt < whole
    fp32 = plan_memory(dataclasses.replace(base, precision="fp32"), shape)
    assert _part(fp32.device, "activations") == 2 * _part(plan_memory(base, shape).device, "activations")
    assert layer_activation_bytes(shape, "bf16") > 34 * shape.hidden  # Korthikanti's 34 h, plus SwiGLU and norms


def _between(fits, short) -> int:
    """Free device memory that `fits` fits and `short` does not (a plan fits in MARGIN = 0.95 of what is free)."""
    assert fits.device_total < short.device_total
    return int((fits.device_total + short.device_total) / 2 / 0.95)


MID = ModelConfig(arch="llama", n_layer=8, n_head=4, n_embd=256, block_size=512, vocab_size=512)
BIG = ModelConfig(arch="llama", n_layer=8, n_head=16, n_embd=2048, block_size=512, vocab_size=512)


def test_check_names_the_flag_that_makes_it_fit() -> None:
    shape, host = model_shape(MID), 64 * GIB
    setup = UnitSetup(MID, batch_size=16, precision="bf16", gpu=True)
    plan = plan_memory(setup, shape)
    assert plan.check(int(plan.device_total / 0.9), host) is None
    half = plan_memory(dataclasses.replace(setup, micro_batch=8), shape)
    assert plan.check(_between(half, plan), host) == f"will not fit: {plan.device_short(_between(half, plan))}; " \
        "use --micro-batch 8"
    # two sequences: one alone keeps half the activations, checkpointing a quarter
    two = dataclasses.replace(setup, batch_size=2)
    one_seq, ckpt = (plan_memory(dataclasses.replace(two, **change), shape)
                     for change in ({"micro_batch": 1}, {"activation_checkpointing": True}))
    advice = plan_memory(two, shape).check(_between(ckpt, one_seq), host)
    assert advice is not None and advice.endswith("use --activation-checkpointing true"), advice
    # one long sequence, already checkpointed, in fp32: only bf16 is left before sharding
    long = UnitSetup(dataclasses.replace(MID, block_size=4096), batch_size=1, precision="fp32",
                     activation_checkpointing=True, gpu=True)
    fp32, bf16 = (plan_memory(dataclasses.replace(long, precision=p), shape) for p in ("fp32", "bf16"))
    advice = fp32.check(_between(bf16, fp32), host)
    assert advice is not None and advice.endswith("use --precision bf16"), advice
    big = plan_memory(dataclasses.replace(setup, model=BIG), model_shape(BIG))  # 18 B/parameter on half a card
    advice = big.check(big.device_total // 2, host)
    assert advice is not None and "--training.parallel fsdp" in advice, advice
    advice = plan.check(10 * GIB, 2**20)  # the outer state alone overflows the host: no flag helps
    assert advice is not None and "the host needs" in advice and "smaller model" in advice, advice
    assert "\n" not in advice


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 64), block=st.integers(8, 4096), layers=st.integers(1, 96), grow=st.integers(1, 8),
       which=st.sampled_from(["batch", "block", "layers"]), gpu=st.booleans(), ckpt=st.booleans(),
       precision=st.sampled_from(["fp32", "bf16"]))
def test_totals_grow_with_batch_block_and_layers(batch: int, block: int, layers: int, grow: int, which: str,
                                                 gpu: bool, ckpt: bool, precision: str) -> None:
    def plan(b: int, t: int, n: int):
        h, v = 256, 1000
        block_params = 12 * h * h
        shape = ModelShape(params=n * block_params + 2 * v * h, largest_unit=max(block_params, 2 * v * h),
                           n_layer=n, hidden=h, ffn=4 * h, vocab=v, gated=False, python_norms=False)
        model = ModelConfig(n_layer=n, n_embd=h, n_head=4, block_size=t)
        return plan_memory(UnitSetup(model, batch_size=b, precision=precision, activation_checkpointing=ckpt,
                                     gpu=gpu), shape)

    small = plan(batch, block, layers)
    big = plan(batch + grow if which == "batch" else batch, block + grow if which == "block" else block,
               layers + grow if which == "layers" else layers)
    assert big.device_total > small.device_total and big.host_need >= small.host_need
    assert big.host_need > small.host_need or gpu  # a GPU unit's host holds per-parameter state only


def test_parse_size() -> None:
    assert parse_size("24GB") == 24 * 10**9 and parse_size("24GiB") == 24 * GIB and parse_size("1MB") == 10**6
    assert parse_size("512m") == 512 * 10**6 and parse_size("1e9") == 10**9
    with pytest.raises(ConfigError):
        parse_size("lots")


@pytest.mark.slow  # 13 s of searching; the plan's table and the join's refusal stay in the default suite
def test_largest_llama_grows_with_the_memory() -> None:
    assert LLAMA_SIZES == tuple(LLAMA_FAMILY)  # `plan --llama` lists them without importing torch
    template = UnitSetup(dataclasses.replace(LLAMA, block_size=1024), batch_size=8, precision="bf16", micro_batch=1,
                         activation_checkpointing=True, gpu=True)
    fits = {gb: [name for name, _, ok in largest_llama(template, gb * 10**9, 64 * 10**9) if ok] for gb in (24, 80)}
    assert fits[24] and fits[24] == list(fits[80])[:len(fits[24])] and len(fits[80]) > len(fits[24])
    assert "70B" not in fits[80]  # 70B x 12 B/parameter of outer state alone is past a 64 GB host


@pytest.mark.slow  # 23 s (three commands); the default suite keeps the plan's arithmetic and the join's refusal
def test_plan_command_prints_the_table_and_exits_by_the_verdict() -> None:
    ok = _cli("plan", "--preset", "tiny", "--host-memory", "64GB")
    assert ok.returncode == 0, ok.stderr
    for part in ("weights (fp32 master)", "AdamW moments", "activations", "replica theta", "outer momentum",
                 "error feedback", "chunk buffers", "gossip store", "fits"):
        assert part in ok.stdout, ok.stdout
    short = _cli("plan", "--preset", "tiny", "--device-memory", "1MB", "--host-memory", "64GB")
    assert short.returncode == 1, short.stdout + short.stderr
    verdict = short.stdout.strip().splitlines()[-1]
    assert verdict.startswith("will not fit: each GPU needs") and "smaller model" in verdict, verdict


HUGE = ("--spec.model.n-layer", "64", "--spec.model.n-embd", "16384", "--spec.model.n-head", "64")  # 206B parameters


def test_join_refuses_a_unit_that_will_not_fit_before_anything_starts(tmp_path: Path) -> None:
    identity, out = tmp_path / "id.key", tmp_path / "out"
    run = _cli("join", *HUGE, "--identity", str(identity), "--out-dir", str(out), "--rounds", "1")
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "will not fit: the host needs" in lines[0] and "smaller model" in lines[0], run.stderr
    assert not identity.exists() and not out.exists()  # refused before the identity, the node or any file


def test_the_memory_check_can_be_turned_off() -> None:
    huge = dict(zip((a.split(".")[-1].replace("-", "_") for a in HUGE[::2]), map(int, HUGE[1::2])))
    config = JoinConfig(spec=dataclasses.replace(preset("test"), model=ModelConfig(**huge)))
    with pytest.raises(ConfigError, match="will not fit"):
        check_join_memory(config)
    off = dataclasses.replace(config, training=dataclasses.replace(config.training, memory_check=False))
    assert check_join_memory(off).spec.model == config.spec.model
    assert check_join_memory(JoinConfig(spec=preset("tiny"))).spec == preset("tiny")  # tiny fits any machine
