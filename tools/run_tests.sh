#!/usr/bin/env bash
# Set up the environment (tools/bootstrap.sh) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/bootstrap.sh
# vLLM in its own venv (.venv-vllm; reused when present) for tests/test_vllm.py (rollout.engine: vllm).
# Not fatal here: without it those tests skip and say how to install it (under CI=true they fail).
bash tools/bootstrap.sh --vllm || echo "run_tests.sh: could not install vLLM (bash tools/bootstrap.sh --vllm): tests/test_vllm.py will skip" >&2
# The Triton interpreter must be chosen before anything imports triton (transformers does).
export TRITON_INTERPRET=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
# Two pytest workers (pytest-xdist), each running one test file at a time. With OMP_NUM_THREADS=1 a
# single-process test keeps one core busy, so one worker left the other core idle for much of the
# suite: measured on 2 cores, 28 min in one process (a busy machine), 10-11 min on two workers (fresh
# clones). A test file stays on one worker, so its module-scoped fixtures (the vLLM server, the SLURM
# cluster) are started once.
# PYTEST_WORKERS=0 runs everything in one process.
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
