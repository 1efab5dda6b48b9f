"""Run one fuzz target for N inputs: coverage-guided with atheris (libFuzzer), or by plain seed mutation.

    python -m fuzz.harness TARGET [--runs N] [--engine atheris|mutate] [--workdir DIR] [-- FLAGS...]

TARGET is one of fuzz.targets.TARGETS. The seed corpus (valid and signed-but-invalid messages from fuzz.seeds)
is written to WORKDIR/corpus/TARGET, where libFuzzer also keeps the inputs that found new coverage; crashing
inputs go to WORKDIR/TARGET-crash-*. Prints one `fuzz-summary` line at the end: runs, exec/s and outcome counts.
Exit status 0 if no input broke a contract, 1 (atheris: libFuzzer's own code) otherwise.

The `mutate` engine needs no atheris (it is not a required dependency): it mutates seeds at random (bit flips,
byte edits, cuts, inserts, splices, msgpack-interesting bytes, deep nesting) with no coverage feedback, so it
explores less.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# msgpack type bytes and boundary values: nil, false/true, bin8/16/32, float32/64, uint8-64, int8-64, str8, array16,
# map16, fixarray/fixmap/fixstr headers, and 0xc1 (never used).
_INTERESTING = (0xC0, 0xC2, 0xC3, 0xC4, 0xC5, 0xC6, 0xCA, 0xCB, 0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD3, 0xD9, 0xDC,
                0xDE, 0x90, 0x9F, 0x80, 0x8F, 0xA0, 0xBF, 0xC1, 0x00, 0x7F, 0xFF)


def mutate(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    """One to four random edits of `data`; also used by tests/fuzzing/test_fuzz.py with hypothesis's Random."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        i = rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[min(i, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[min(i, len(out) - 1)] = rng.choice(_INTERESTING) if rng.random() < 0.5 else rng.randrange(256)
        elif op == 2:
            del out[i:i + rng.randint(1, 16)]
        elif op == 3:
            out[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 4 and out:  # duplicate a range (repeats containers, lengthens strings)
            j = rng.randrange(len(out))
            out[i:i] = out[j:j + rng.randint(1, 32)]
        elif op == 5 and corpus:  # splice with another seed
            other = rng.choice(corpus)
            j = rng.randrange(len(other) + 1)
            out = out[:i] + other[j:]
        elif op == 6:
            out[i:i] = bytes([rng.choice(_INTERESTING)])
        else:  # deep nesting: a run of one-element arrays, up to past msgpack's 1024-level stack limit
            out[i:i] = rng.choice((b"\x91", b"\xdc\x00\x01")) * rng.randint(1, 1100)
    return bytes(out)


def _write_seeds(corpus_dir: Path, seeds: list[bytes]) -> None:
    corpus_dir.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds):
        (corpus_dir / f"seed-{i:03d}").write_bytes(seed)


def _summary(name: str, engine: str, counts: collections.Counter[str], started: float) -> str:
    runs = sum(counts.values())
    elapsed_s = time.monotonic() - started
    outcomes = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    return (f"fuzz-summary target={name} engine={engine} runs={runs} elapsed_s={elapsed_s:.1f} "
            f"exec_per_s={runs / max(elapsed_s, 1e-9):.0f} {outcomes}")


def _run_mutate(name: str, target: Callable[[bytes], str], seeds: list[bytes], runs: int, workdir: Path,
                seed: int) -> int:
    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    for i in range(runs):
        data = seeds[i] if i < len(seeds) else mutate(rng, rng.choice(seeds), seeds)
        try:
            counts[target(data)] += 1
        except Exception:
            crash = workdir / f"{name}-crash-{i}"
            crash.write_bytes(data)
            print(traceback.format_exc(), f"input written to {crash}", file=sys.stderr)
            print(_summary(name, "mutate", counts, started) + " crashes=1", flush=True)
            return 1
        if (i + 1) % 20000 == 0:
            print(_summary(name, "mutate", counts, started), file=sys.stderr, flush=True)
    print(_summary(name, "mutate", counts, started) + " crashes=0", flush=True)
    return 0


def _run_atheris(name: str, target: Callable[[bytes], str], seeds: list[bytes], runs: int, workdir: Path,
                 extra: list[str]) -> int:
    import atheris

    corpus_dir = workdir / "corpus" / name
    _write_seeds(corpus_dir, seeds)
    counts: collections.Counter[str] = collections.Counter()
    started = time.monotonic()

    def one_input(data: bytes) -> None:
        counts[target(data)] += 1
        if sum(counts.values()) == runs:  # libFuzzer exits right after its last run, skipping Python's atexit
            print(_summary(name, "atheris", counts, started) + " crashes=0", flush=True)

    def mutator(data: bytes, max_size: int, seed: int) -> bytes:
        # libFuzzer inserts at most ~128 repeated bytes at once, and deeper nesting adds no Python coverage, so it
        # never builds msgpack nested ~1000 levels deep (which once broke decode_update); 5% of mutations do, at
        # depths between Python's recursion limit (1000) and msgpack's nesting limit (1024).
        rng = random.Random(seed)
        depth = rng.randint(980, 1023)
        if rng.random() < 0.05 and len(data) + depth <= max_size:
            i = rng.randrange(len(data) + 1)
            return data[:i] + b"\x91" * depth + data[i:]
        return atheris.Mutate(data, max_size)

    argv = [sys.argv[0], f"-runs={runs}", f"-artifact_prefix={workdir}/{name}-", "-max_len=4096",
            "-timeout=20", "-rss_limit_mb=4096", "-print_final_stats=1", *extra, str(corpus_dir)]
    atheris.Setup(argv, one_input, custom_mutator=mutator)
    atheris.Fuzz()
    return 0


def _import_targets(engine: str) -> tuple[Any, Any]:
    """fuzz.targets and fuzz.seeds; under atheris, our package (and base58, which parses peer ids) is imported
    inside instrument_imports, so that libFuzzer sees Python branch coverage. Must run before anything else
    imports p2p_diloco."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if engine != "atheris":
        from fuzz import seeds, targets
        return targets, seeds
    try:
        import atheris
    except ImportError:
        raise SystemExit("atheris is not installed: pip install -e '.[fuzz]', or use --engine mutate") from None
    with atheris.instrument_imports(include=["p2p_diloco", "fuzz", "base58"]):
        from fuzz import seeds, targets
    return targets, seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target", help="envelope, envelope_signed, codec, manifest, manifest_signed, "
                                       "gossip_request or peer_record")
    parser.add_argument("--runs", type=int, default=100_000, help="inputs to run (default 100000)")
    parser.add_argument("--engine", choices=("atheris", "mutate"), default="atheris")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/p2p-diloco-fuzz"), help="corpus and crashes")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the mutate engine")
    argv = sys.argv[1:] if argv is None else argv
    # Everything after "--" goes to libFuzzer untouched (argparse would take "-flag=value" for its own options).
    libfuzzer_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    targets, seeds = _import_targets(args.engine)
    import torch

    # One input at a time on tiny tensors: torch's thread pool only adds contention (10x slower on a busy host).
    torch.set_num_threads(1)
    if args.target not in targets.TARGETS:
        parser.error(f"unknown target {args.target!r}; targets: {', '.join(targets.TARGETS)}")
    target = targets.TARGETS[args.target]
    args.workdir.mkdir(parents=True, exist_ok=True)
    corpus = seeds.fixtures().seeds[args.target]
    if args.engine == "atheris":
        return _run_atheris(args.target, target, corpus, args.runs, args.workdir, libfuzzer_flags)
    return _run_mutate(args.target, target, corpus, args.runs, args.workdir, args.seed)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
