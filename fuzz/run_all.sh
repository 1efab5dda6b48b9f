#!/usr/bin/env bash
# Long fuzz run: every target for RUNS inputs (default 100000 each), summary to benchmarks/results/fuzz.log.
#
#   fuzz/run_all.sh                      # all targets, 100k inputs each, atheris if installed
#   RUNS=1000000 fuzz/run_all.sh codec   # one target, 1M inputs
#   ENGINE=mutate fuzz/run_all.sh        # no atheris: random seed mutation, no coverage feedback
#
# Env: RUNS, ENGINE (atheris|mutate; default atheris when importable), WORKDIR (corpus, crashes, per-target
# logs; default /tmp/p2p-diloco-fuzz), LOG (default benchmarks/results/fuzz.log), PYTHON (default .venv/bin/python).
# Exit status 1 if any target found a crash or a contract violation (the input is kept in WORKDIR/TARGET-crash-*).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
RUNS=${RUNS:-100000}
WORKDIR=${WORKDIR:-/tmp/p2p-diloco-fuzz}
LOG=${LOG:-benchmarks/results/fuzz.log}
if [ -z "${ENGINE:-}" ]; then
  if "$PYTHON" -c "import atheris" 2>/dev/null; then ENGINE=atheris; else ENGINE=mutate; fi
fi
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(envelope envelope_signed herald codec manifest manifest_signed gossip_request peer_record)
mkdir -p "$WORKDIR" "$(dirname "$LOG")"

{
  echo "# fuzz run $(date -u +%Y-%m-%dT%H:%M:%SZ) engine=$ENGINE runs_per_target=$RUNS host=$(uname -n) nproc=$(nproc)"
  echo "# $("$PYTHON" --version 2>&1) atheris=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("atheris"))' 2>/dev/null || echo none) git=$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo +dirty)"
} | tee -a "$LOG"
failed=0
for target in "${TARGETS[@]}"; do
  cmd=("$PYTHON" -m fuzz.harness "$target" --runs "$RUNS" --engine "$ENGINE" --workdir "$WORKDIR")
  echo "\$ ${cmd[*]}" | tee -a "$LOG"
  "${cmd[@]}" > "$WORKDIR/$target.log" 2>&1
  rc=$?
  grep -h "^fuzz-summary" "$WORKDIR/$target.log" | tail -1 | tee -a "$LOG"
  # libFuzzer's last status line: coverage (cov: edges, ft: features) and corpus size.
  grep -hE "^#[0-9]+[[:space:]]+DONE" "$WORKDIR/$target.log" | tail -1 | sed 's/^/  libfuzzer: /' | tee -a "$LOG"
  grep -hE "^stat::(new_units_added|peak_rss_mb)" "$WORKDIR/$target.log" | sed 's/^/  /' | tee -a "$LOG"
  if [ $rc -ne 0 ]; then
    failed=1
    echo "  FAILED rc=$rc crashes: $(ls "$WORKDIR"/"$target"-crash-* 2>/dev/null | tr '\n' ' ')" | tee -a "$LOG"
    grep -hE "Error|assert|Traceback" "$WORKDIR/$target.log" | head -5 | sed 's/^/  /' | tee -a "$LOG"
  fi
done
echo "# result: $([ $failed -eq 0 ] && echo 'no crashes, no contract violations' || echo FAILURES)" | tee -a "$LOG"
exit $failed
