"""The fla scans' tests (``tests/fla_scan_cases.py``) in a pytest process of their own, with ``fla-core``
from ``.cache/fla-site`` on its path (``tools/bootstrap.sh``).

Not in this process: where ``fla`` imports, transformers' stock Gated DeltaNet layers (Qwen3.5, Qwen3-Next)
call fla's Triton kernels even on the CPU ("0 active drivers"), so the stock-model oracles of the other
test files, which share this worker, would fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLA_SITE = ROOT / ".cache" / "fla-site"


@pytest.mark.slow
def test_fla_scans_equal_the_torch_scans_in_their_own_process() -> None:
    if not (FLA_SITE / "fla").is_dir():
        message = f"fla-core is not in {FLA_SITE} (bash tools/bootstrap.sh installs it there)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(FLA_SITE)]), TRITON_INTERPRET="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    command += [str(ROOT / "tests" / "fla_scan_cases.py")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, output
    assert " passed" in output and "skipped" not in output and "failed" not in output, output
