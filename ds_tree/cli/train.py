"""``ds-tree train CONFIG [key=value ...]``: a training run under the DeepSpeed launcher.

It runs the repository's ``launch/train.sh`` in its place (``exec``: the same process, so a signal to
``ds-tree train`` is a signal to the script, which forwards it to the ranks), with the same arguments
and the same environment variables: ``NGPU``, ``NNODES``, ``HOSTFILE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``SP_SIZE``, ``DEEPSPEED``, ``PYTHON`` and ``DRY_RUN=1`` (validate and print the launch command). One
launcher implementation serves both, so every job is a ``ds-tree`` command (``ds-tree train``, ``ds-tree
verify``, ...) and SLURM's ``launch/slurm.sbatch`` keeps calling the script. ``--help`` prints the script's
usage and variables.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "train.sh"
"""The launcher script of the repository ds_tree runs from (an editable install: tools/bootstrap.sh)."""


def main(argv: list[str] | None = None, prog: str = "ds-tree train") -> int:
    argv = sys.argv[1:] if argv is None else argv
    bash = shutil.which("bash")
    if not SCRIPT.is_file() or bash is None:
        missing = f"{SCRIPT} is missing" if bash else "bash is not on PATH"
        print(
            f"{prog}: error: {missing}; {prog} runs the repository's launch/train.sh (install ds_tree from its "
            "repository with tools/bootstrap.sh), or start the ranks yourself: deepspeed --module ds_tree.train "
            "--config CONFIG.yaml [key=value ...]",
            file=sys.stderr,
        )
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(bash, [bash, str(SCRIPT), *argv])
    return 0  # not reached: execv replaces this process
