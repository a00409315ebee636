#!/usr/bin/env bash
# Set up the environment (tools/bootstrap.sh) and run the test suite. Extra arguments go to pytest.
#   bash tools/run_tests.sh           the full suite: the README's test command, what CI (.ci/run) runs
#   bash tools/run_tests.sh --fast    the edit-test loop's tier: pytest -m "not distributed and not slow",
#                                     every test but those that start several processes (launchers, ranks,
#                                     a vLLM server, SLURM) or take over ~20 s alone; tests/conftest.py fails
#                                     an unmarked test that starts processes (tests/helpers/processes.py)
# An -m of your own comes after the tier's and replaces it. --strict-markers: a misspelt marker would
# silently put its test in the fast tier.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
args=()
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then fast=1; else args+=("$arg"); fi
done
tier=()
if [ "$fast" = 1 ]; then tier=(-m "not distributed and not slow"); fi
bash tools/bootstrap.sh
# vLLM in its own venv (.venv-vllm; reused when present) for tests/test_vllm.py (rollout.engine: vllm).
# Not fatal here: without it those tests skip and say how to install it (under CI=true they fail).
# The fast tier needs no server: it does not install it.
if [ "$fast" = 0 ]; then
  bash tools/bootstrap.sh --vllm || echo "run_tests.sh: could not install vLLM (bash tools/bootstrap.sh --vllm): tests/test_vllm.py will skip" >&2
fi
# The Triton interpreter must be chosen before anything imports triton (transformers does).
export TRITON_INTERPRET=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
# Two pytest workers (pytest-xdist), each running one test file at a time. With OMP_NUM_THREADS=1 a
# single-process test keeps one core busy, so one worker left the other core idle for much of the
# suite: measured on 2 cores, 28 min in one process (a busy machine), 10-11 min on two workers (fresh
# clones; ~19 min by 2026-11-28, issue 51; 25 min for 1929 tests after issues 52-54; 27.5 min for 1950 tests (37 skipped) after issue 53). A test file stays
# on one worker, so its module-scoped fixtures (the vLLM server, the SLURM cluster) are started once.
# The fast tier: 1849 tests in 4 min 15 s on 2 quiet cores (2026-11-28; docs/DEVELOPING.md).
# PYTEST_WORKERS=0 runs everything in one process.
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile --strict-markers "${tier[@]}" "${args[@]}"
