"""`p2p-diloco doctor` as a user runs it: against a real bootstrap process on 127.0.0.1 it says a join would work
(exit 0); a malformed address and a bootstrap with nothing listening each end non-zero, within the timeout, with
the finding and its fix; never a traceback."""

from __future__ import annotations

import json
import subprocess
import time

from p2p_diloco.net.discovery.bootstraps import parse_bootstrap
from p2p_diloco.net.discovery.update_size import gpt_params, payload_bytes, update_bytes
from tests.helpers.net import closed_tcp_port
from tests.helpers.swarm import Launcher, cli

PEER_ID = "12D3KooWNXBJGqQjDuk11fxCLJdxRyzdZAh9imdWksGX7ZHaAFaR"


def _doctor(*args: str, timeout_s: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    out = subprocess.run(cli("doctor", *args), capture_output=True, text=True, timeout=timeout_s)
    assert "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
    return out, time.monotonic() - started


def test_doctor_against_a_running_bootstrap_says_a_join_would_work(tmp_path):
    with Launcher(tmp_path) as launcher:
        bootstrap, address = launcher.bootstrap()
        out, _ = _doctor("--bootstrap", address, "--timeout-s", "20")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "reachable public" in out.stdout
        assert "upload" in out.stdout and "Mbit/s" in out.stdout
        assert "verdict: OK" in out.stdout
        assert "problem:" not in out.stdout
        assert "Traceback" not in bootstrap.output()



def test_malformed_addresses_are_named_with_what_is_wrong():
    bad = {"/ip4/127.0.0.1/tcp/31337": "must end with /p2p/<peer id>",
           f"/ip4/1.2.3/tcp/31337/p2p/{PEER_ID}": "is not IPv4",
           f"ip4/127.0.0.1/tcp/31337/p2p/{PEER_ID}": "must start with '/'"}
    out, _ = _doctor("--bootstrap", ",".join(bad), "--timeout-s", "5")
    assert out.returncode == 1, out.stdout + out.stderr
    problems = [line for line in out.stdout.splitlines() if line.startswith("problem: ")]
    assert len(problems) == 3 and all("fix: bad address" in line for line in problems), out.stdout
    for what in bad.values():
        assert any(what in line for line in problems), (what, out.stdout)
    assert "verdict: NOT OK" in out.stdout


def test_a_bootstrap_with_nothing_listening_is_down_within_the_timeout():
    address = f"/ip4/127.0.0.1/tcp/{closed_tcp_port()}/p2p/{PEER_ID}"
    out, elapsed_s = _doctor("--bootstrap", address, "--timeout-s", "5")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "DOWN" in out.stdout and "this bootstrap is down" in out.stdout
    assert "verdict: NOT OK" in out.stdout and "no bootstrap is reachable" in out.stdout
    assert elapsed_s < 60  # the CLI's imports included, on a loaded machine

    out, _ = _doctor("--bootstrap", address, "--timeout-s", "5", "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    diagnosis = json.loads(out.stdout)  # nothing but the JSON object on stdout
    assert diagnosis["ok"] is False and diagnosis["bootstraps"][0]["connect_ms"] is None
    assert any("down" in f["fix"] for f in diagnosis["findings"])


def test_doctor_without_bootstrap_is_a_usage_error():
    out, _ = _doctor()
    assert out.returncode == 2 and "--bootstrap" in out.stderr


def test_parse_bootstrap_names_host_port_and_peer():
    check = parse_bootstrap(f"/ip4/203.0.113.5/tcp/31337/p2p/{PEER_ID}")
    assert (check.host, check.port, check.peer_id, check.error) == ("203.0.113.5", 31337, PEER_ID, "")
    assert "p2p" in parse_bootstrap("/ip4/203.0.113.5/tcp/31337").error


def test_update_size_matches_the_model_and_the_codecs():
    import torch

    from p2p_diloco.config import preset
    from p2p_diloco.train.models.gpt import GPT
    from p2p_diloco.wire.codecs import get_codec

    spec = preset("test")
    assert gpt_params(spec.model.n_layer, spec.model.n_embd, spec.model.block_size, spec.model.vocab_size) == \
        GPT(spec.model, torch.Generator().manual_seed(0)).num_params()
    for codec in ("fp32", "fp16", "int8", "int4"):
        for numel in (1, 255, 1000, 123_457):
            assert payload_bytes(codec, numel, 256) == get_codec(codec, 256).payload_bytes(numel)
    size, params, exact, codec = update_bytes(spec.to_dict())
    assert exact and codec == spec.outer.codec and size > payload_bytes(codec, params, spec.outer.codec_block)
    assert update_bytes({"model": {"arch": "gpt"}}) is None  # too little to say
