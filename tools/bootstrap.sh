#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install ds_tree into it.
# torch==2.13.0 goes first (the CPU wheel on local disk), everything else under a constraint
# that keeps it. Re-running is cheap: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
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
"$VENV/bin/python" -m pip install --quiet -c tools/constraints.txt -e ".[dev]"
echo "$want" > "$stamp"
