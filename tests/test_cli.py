"""The ``ds-tree`` command: every subcommand reaches its tool's ``main``, as does every tools/ shim."""

import subprocess
import sys
from pathlib import Path

import pytest

from ds_tree.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
DS_TREE = Path(sys.executable).parent / "ds-tree"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_a_main_and_a_tools_shim(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: ds-tree {command} ")
    shim = ROOT / "tools" / f"{command.replace('-', '_')}.py"
    assert f"from ds_tree.cli.{command.replace('-', '_')} import main" in shim.read_text()


def test_usage_and_unknown_commands(capsys):
    assert main([]) == 2
    assert "usage: ds-tree COMMAND" in capsys.readouterr().err
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert all(f"  {command} " in usage for command in COMMANDS)
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_the_console_script_is_installed():
    done = subprocess.run([str(DS_TREE), "stats", "--help"], capture_output=True, text=True, check=True)
    assert done.stdout.startswith("usage: ds-tree stats ")
