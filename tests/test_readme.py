"""Every command, config, script and page the README names exists (issue 51: a README a newcomer can trust)."""

from __future__ import annotations

import re
from pathlib import Path

from ds_tree.cli import COMMANDS
from tests.helpers import ROOT

README = ROOT / "README.md"
PATH = re.compile(r"(?<![\w./-])((?:configs|launch|tools|docs|tests|ds_tree)/[\w./-]*\w)")
"""A repository path as the README writes it (in code, in a link, in a table)."""
COMMAND = re.compile(r"`(?:\.venv/bin/)?ds-tree ([a-z][a-z-]*)")
"""A ds-tree command as the README writes it: in a code span."""
LINK = re.compile(r"\]\(([^)#]+)(?:#[^)]*)?\)")


def text() -> str:
    return README.read_text()


def test_every_path_the_readme_names_exists() -> None:
    named = set(PATH.findall(text())) | {link for link in LINK.findall(text()) if "://" not in link}
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert named and not missing, f"README.md names paths that do not exist: {missing}"


def test_every_ds_tree_command_the_readme_names_exists() -> None:
    named = set(COMMAND.findall(text())) - {"COMMAND"}
    assert named <= set(COMMANDS), sorted(named - set(COMMANDS))
    other = re.search(r"Other commands: (.*?)\.\n\n", text(), flags=re.S)
    listed = set(re.findall(r"`([a-z][a-z-]*)`", other.group(1))) if other else set()
    assert listed, "the README lists its other commands in one sentence: Other commands: `a`, `b`."
    assert listed <= set(COMMANDS), sorted(listed - set(COMMANDS))


def test_the_two_commands_are_the_quickstart_and_the_test_runner() -> None:
    commands = re.search(r"## The two commands\n.*?```bash\n(.*?)```", text(), flags=re.S).group(1)
    scripts = [line.split()[1] for line in commands.splitlines() if line.startswith("bash ")]
    assert scripts == ["launch/quickstart.sh", "tools/run_tests.sh"]
    assert "bash tools/run_tests.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_stays_short() -> None:
    assert len(text().splitlines()) <= 120


def test_the_path_pattern_sees_a_missing_path(tmp_path: Path) -> None:
    found = PATH.findall("run `bash launch/nope.sh` with configs/x.yaml and [a](docs/NOPE.md)")
    assert found == ["launch/nope.sh", "configs/x.yaml", "docs/NOPE.md"]
    assert not (ROOT / "launch/nope.sh").exists()
