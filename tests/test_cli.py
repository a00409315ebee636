"""The ``ds-tree`` command: every subcommand reaches its tool's ``main``, as does every tools/ shim;
``--help`` is plain text with one usage line, a help string for every option, and no torch."""

import argparse
import importlib
import json
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from ds_tree.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
DS_TREE = Path(sys.executable).parent / "ds-tree"
HEAVY = ("torch", "transformers", "deepspeed", "triton", "tokenizers", "matplotlib")
"""Modules that take seconds to import: ``--help`` answers without them."""


def command_module(command: str):
    return importlib.import_module(f"ds_tree.cli.{command.replace('-', '_')}")


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


# ------------------------------------------------------------------- --help
def options_of(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_is_plain_text_with_one_usage_line_and_real_flags(command):
    """No reStructuredText (``x``, :mod:`...`), the usage line once (no hand-written copy that can
    drift), and every --flag the text names is one of the command's options."""
    parser = command_module(command).build_parser(f"ds-tree {command}")
    text = parser.format_help()
    assert "``" not in text and not re.search(r":\w+:`", text), text
    assert len(re.findall(r"usage:", text, flags=re.IGNORECASE)) == 1, text
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    assert named <= options_of(parser), sorted(named - options_of(parser))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_a_help_string(command):
    parser = command_module(command).build_parser(f"ds-tree {command}")
    bare = [action.option_strings or [action.dest] for action in parser._actions if not (action.help or "").strip()]
    assert not bare, f"ds-tree {command}: options without help: {bare}"


def test_help_imports_no_heavy_module():
    """Every subcommand's --help, in a fresh process: torch, transformers, deepspeed (and the other
    modules that take seconds to import) stay unimported, so --help answers at once."""
    script = (
        "import contextlib, io, json, sys\n"
        "from ds_tree.cli import COMMANDS, main\n"
        "for command in COMMANDS:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main([command, '--help'])\n"
        f"print(json.dumps(sorted(name for name in {HEAVY!r} if name in sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(done.stdout) == [], done.stdout


def test_tools_shim_help_has_one_usage_line_and_imports_no_torch():
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "tools/verify.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.startswith("usage: verify.py [-h] --data DATA --model MODEL")
    assert done.stdout.lower().count("usage:") == 1
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not {name for name in imported if name.split(".")[0] in HEAVY}, sorted(imported)[:20]


def test_the_help_choices_are_the_library_values():
    """ds_tree.cli.choices and the sampler options copy what the library keeps beside torch."""
    from ds_tree.attention import blocksparse
    from ds_tree.attention.registry import ENGINE_CHOICES
    from ds_tree.attention.triton.function import DTYPES as KERNEL_DTYPES
    from ds_tree.benchmark import BENCH_DTYPES
    from ds_tree.cli import choices
    from ds_tree.cli.sample import SAMPLER_OPTIONS
    from ds_tree.data import convert
    from ds_tree.data.synthetic import SyntheticConfig
    from ds_tree.data.tokenizer import DEFAULT_VOCAB_SIZE
    from ds_tree.losses.advantages import ESTIMATORS
    from ds_tree.losses.rl import AGGREGATIONS, KL_ESTIMATORS
    from ds_tree.losses.sft import NORMALISATIONS, POLICIES
    from ds_tree.models.loading import DTYPES
    from ds_tree.packing.modes import MODES
    from ds_tree.rollout.sampler import SamplerSettings
    from ds_tree.verification import VERIFY_DTYPES

    assert choices.ENGINES == ENGINE_CHOICES and choices.MODES == tuple(MODES)
    assert (choices.NORMALISATIONS, choices.POLICIES) == (tuple(NORMALISATIONS), tuple(POLICIES))
    assert choices.ESTIMATORS == tuple(ESTIMATORS)
    assert (choices.AGGREGATIONS, choices.KL_ESTIMATORS) == (tuple(AGGREGATIONS), tuple(KL_ESTIMATORS))
    assert choices.MODEL_DTYPES == tuple(DTYPES) and choices.VERIFY_DTYPES == tuple(VERIFY_DTYPES)
    assert choices.BENCH_DTYPES == tuple(BENCH_DTYPES)
    assert choices.KERNEL_DTYPES == tuple(str(dtype).removeprefix("torch.") for dtype in KERNEL_DTYPES)
    assert (choices.BLOCK, choices.HUB_MIN_KEYS, choices.HUB_MIN_QUERIES) == (
        blocksparse.DEFAULT_BLOCK,
        blocksparse.HUB_MIN_KEYS,
        blocksparse.HUB_MIN_QUERIES,
    )
    synthetic = SyntheticConfig()
    assert choices.TOKENIZER_VOCAB_SIZE == DEFAULT_VOCAB_SIZE == synthetic.vocab_size
    assert (choices.SYNTHETIC_SEED, choices.SYNTHETIC_MAX_TOKENS) == (synthetic.seed, synthetic.max_tokens)
    assert (choices.CONVERT_FORMATS, choices.MERGES) == (convert.FORMATS, convert.MERGES)
    assert choices.PREFIX_POLICIES == convert.PREFIX_POLICIES
    defaults = convert.ConvertOptions()
    assert choices.CONVERT_DEFAULTS == {name: getattr(defaults, name) for name in choices.CONVERT_DEFAULTS}
    sampler = SamplerSettings()
    numeric = [field for field in fields(SamplerSettings) if field.type not in ("bool", bool)]
    assert list(SAMPLER_OPTIONS) == [field.name for field in numeric]
    for field in numeric:
        kind, default, _ = SAMPLER_OPTIONS[field.name]
        assert default == getattr(sampler, field.name), field.name
        assert kind.__name__ in str(field.type), (field.name, field.type)
