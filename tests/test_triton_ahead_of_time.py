"""The ``list`` tile schedule's kernels compile for Hopper (sm_90) with no branch and pipelined loads.

No GPU needed: ``ds_tree.kernel.ahead_of_time`` runs Triton's compiler for an explicit target.
It runs in a child process because the test runner sets ``TRITON_INTERPRET=1``, under which Triton
replaces the kernels by the interpreter. What the GPU's Triton (3.6 on the project's machine) makes of
them may differ from this one's (3.9): the timings are the GPU run's business (docs/KERNEL.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import json
from ds_tree.kernel.ahead_of_time import compile_kernel
found = [compile_kernel(kernel, "list") for kernel in ("forward", "query", "key_value")]
found.append(compile_kernel("key_value", "list", window=True, softcap=True) | {"kernel": "key_value+window+cap"})
found.append(compile_kernel("forward", "loop"))
print(json.dumps(found))
"""


def test_list_kernels_compile_for_sm90_branch_free_and_pipelined():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    *lists, loop = json.loads(done.stdout.strip().splitlines()[-1])
    for summary in lists:
        assert summary["branches"] == 0, summary  # two branch-free loops
        assert summary["async_copies"] > 0, summary  # Triton pipelined their loads
        assert summary["tensor_core_dots"] > 0 and summary["shared_bytes"] <= 227 * 1024, summary
    # the same compiler leaves the loop schedule's per-tile branch in place, unpipelined: what the lists fix
    assert loop["branches"] > 0 and loop["async_copies"] == 0, loop
