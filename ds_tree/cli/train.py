"""``ds-tree train CONFIG [key=value ...]``: a training run under the DeepSpeed launcher.

It runs the repository's ``launch/train.sh`` in its place (``exec``: the same process, so a signal to
``ds-tree train`` is a signal to the script, which forwards it to the ranks), with the same arguments
and the same environment variables (``NGPU``, ``NNODES``, ``HOSTFILE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``SP_SIZE``, ``DEEPSPEED``, ``PYTHON``, ``DRY_RUN=1``; the script's header lists them and ``--help`` shows
that list). One launcher implementation serves both, so every job is a ``ds-tree`` command and SLURM's
``launch/slurm.sbatch`` keeps calling the script.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from ds_tree.cli.common import command_parser

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "train.sh"
"""The launcher script of the repository ds_tree runs from (an editable install: tools/bootstrap.sh)."""


def script_environment() -> str:
    """The ``Environment`` block of the script's header comment (its variables and their defaults)."""
    if not SCRIPT.is_file():
        return ""
    lines, inside = [], False
    for line in SCRIPT.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        text = line[2:] if line.startswith("# ") else line[1:]
        inside = inside or text.startswith("Environment")
        if inside and not text.strip():
            break
        if inside:
            lines.append(text)
    return "\n".join(lines)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = command_parser(
        prog,
        "Train on CONFIG with the DeepSpeed launcher: runs launch/train.sh in its place, with the same\n"
        "arguments and environment (docs/LAUNCH.md).",
        script_environment(),
    )
    parser.add_argument("config", help="the training config (YAML), relative to the current directory")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides of the config (max_steps=5)")
    return parser


def main(argv: list[str] | None = None, prog: str = "ds-tree train") -> int:
    argv = sys.argv[1:] if argv is None else argv
    build_parser(prog).parse_args(argv)  # --help and usage errors, before anything runs
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
