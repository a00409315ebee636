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
    from ds_tree.bench.steps import BENCH_DTYPES
    from ds_tree.cli import choices
    from ds_tree.cli.sample import SAMPLER_OPTIONS
    from ds_tree.data import convert
    from ds_tree.data.synthetic import SyntheticConfig
    from ds_tree.kernel.function import DTYPES as KERNEL_DTYPES
    from ds_tree.losses.rl import KL_ESTIMATORS
    from ds_tree.losses.sft import NORMALISATIONS, POLICIES
    from ds_tree.models.loading import DTYPES
    from ds_tree.packing.modes import MODES
    from ds_tree.registries import AGGREGATIONS, ATTENTION_ENGINES
    from ds_tree.sampling.hf import SamplerSettings
    from ds_tree.verify.tree_vs_flat import VERIFY_DTYPES
    from ds_tree.vocab.tokenizer import DEFAULT_VOCAB_SIZE

    assert choices.engines() == ("auto", *ATTENTION_ENGINES.names()) and choices.MODES == tuple(MODES)
    assert (choices.NORMALISATIONS, choices.POLICIES) == (tuple(NORMALISATIONS), tuple(POLICIES))
    assert (choices.aggregations(), choices.KL_ESTIMATORS) == (AGGREGATIONS.names(), tuple(KL_ESTIMATORS))
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


# ------------------------------------------------------------------- bench-engines, multiturn-reuse, plot-multiturn
PNG = b"\x89PNG\r\n\x1a\n"


def usage_error(capsys, command: str, argv: list[str]) -> str:
    """The stderr of ``ds-tree COMMAND argv`` that must stop with a usage error (exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: ds-tree {command} ") and "error: " in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "command, argv, expected",
    [
        ("bench-engines", ["--tokenizer", "no_tokenizer", "--groups", "0"], "--groups must be >= 1"),
        ("bench-engines", ["--tokenizer", "no_tokenizer", "--prompt-tokens", "-3"], "--prompt-tokens must be >= 1"),
        (
            "multiturn-reuse",
            ["--model", "m", "--tokenizer", "t", "--tasks", "x", "--config", "c", "--count", "0"],
            "--count must be >= 1",
        ),
        ("plot-multiturn", ["run", "--output", "o.png", "--window", "0"], "--window must be >= 1"),
    ],
)
def test_counts_below_one_are_usage_errors(command, argv, expected, capsys):
    """Found before anything is loaded: the paths named do not exist."""
    assert expected in usage_error(capsys, command, argv)


def test_a_missing_tokenizer_or_config_exits_2_with_one_error_line(tmp_path, capsys):
    """No vLLM server or model is started: the tokenizer (bench-engines) and the config
    (multiturn-reuse) are checked first."""
    assert main(["bench-engines", "--tokenizer", str(tmp_path / "none")]) == 2
    captured = capsys.readouterr()
    assert (
        captured.out == ""
        and captured.err == f"ds-tree bench-engines: error: {tmp_path / 'none'}: no such tokenizer directory\n"
    )
    argv = ["--model", str(tmp_path), "--tokenizer", str(tmp_path), "--tasks", str(tmp_path / "t.jsonl")]
    assert main(["multiturn-reuse", *argv, "--config", str(tmp_path / "none.yaml")]) == 2
    captured = capsys.readouterr()
    assert (
        captured.out == ""
        and captured.err == f"ds-tree multiturn-reuse: error: {tmp_path / 'none.yaml'}: no such config file\n"
    )
    assert main(["multiturn-reuse", *argv, "--config", str(ROOT / "configs/tiny_cpu.yaml")]) == 2
    assert "rollout.env.path is not set" in capsys.readouterr().err


def test_bench_engines_samples_with_the_repository_model_config():
    from ds_tree.bench.engines import MODEL_CONFIG, bench_prompts

    assert MODEL_CONFIG == ROOT / "configs/models/tiny_llama_vllm.json" and MODEL_CONFIG.is_file()
    prompts = bench_prompts(groups=2, prompt_tokens=5)
    assert len(prompts) == 3 and {len(prompt) for prompt in prompts} == {5}


def test_multiturn_reuse_table():
    from ds_tree.cli.multiturn_reuse import markdown_table

    row = {"sampling": "tree", "leaves": 4, "reward": 0.5, "sampled_tokens": 10, "forward_tokens": 12}
    text = markdown_table([row | {"tree_tokens": 20, "flat_tokens": 40}])
    assert text.splitlines() == [
        "| sampling | leaves | reward | sampled tokens | forward tokens | tree tokens | flat tokens |",
        "|---|---|---|---|---|---|---|",
        "| tree | 4 | 0.500 | 10 | 12 | 20 | 40 |",
    ]


def multiturn_records() -> list[dict]:
    """Two warm-up steps, six RL steps, one refresh step (step 6) and one discarded step (no metrics)."""
    records = [{"step": step, "warmup/sft_loss": 1.0, "time/step_s": 2.0} for step in (1, 2)]
    for step in (3, 4, 5, 7, 8, 9):
        records.append(
            {
                "step": step,
                "rollout/reward_mean": step / 10,
                "rollout/sampled_tokens": 100,
                "rollout/tokens_saved": 300,
                "tree/por": 0.9,
                "rollout/parse_errors": 1,
                "rollout/env_errors": 0,
                "time/step_s": 3.0,
            }
        )
    return [*records, {"step": 6, "warmup/sft_loss": 0.5, "time/step_s": 1.0}, {"step": 10, "loss/train": 0.1}]


def test_plot_multiturn_writes_the_figure_and_prints_the_figures(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in multiturn_records()))
    output = tmp_path / "plots" / "multiturn"  # no extension, a folder that does not exist yet
    assert main(["plot-multiturn", str(run), "--output", str(output), "--window", "2"]) == 0
    assert output.read_bytes()[:8] == PNG and not output.with_suffix(".png").exists()
    assert capsys.readouterr().out.splitlines() == [
        "warm-up steps: 2; RL steps: 6 (steps 3-9); refresh steps: 1",
        "reward: first 2 RL steps 0.350, last 2 0.850 (gain +0.500), best step 0.900",
        "sampled tokens per RL step: trees 100, independent 400 (4.00x); trained tree/por 0.900",
        "parse errors 6, env errors 0; wall: warm-up 4 s, RL 18 s, refresh 1 s (step times)",
        f"wrote {output}",
    ]
    assert f"--output {tmp_path}: is a directory" in usage_error(
        capsys, "plot-multiturn", [str(run), "--output", str(tmp_path)]
    )


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"step": 4, "rollout/reward_mean": 0.', ":4: malformed JSON"),
        ("[1, 2]", ":4: a record must be a JSON object"),
        ('{"step": 4, "rollout/reward_mean": 0.5}', ":4: the record has no 'rollout/sampled_tokens'"),
        ('{"step": 4, "warmup/sft_loss": "low", "time/step_s": 1}', ":4: warmup/sft_loss must be a number, got 'low'"),
    ],
)
def test_plot_multiturn_names_the_file_and_line_of_a_bad_record(line, expected, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    good = [json.dumps(record) for record in multiturn_records()[:3]]
    (run / "metrics.jsonl").write_text("\n".join([*good, line, *good[2:]]) + "\n")
    output = tmp_path / "multiturn.png"
    assert main(["plot-multiturn", str(run), "--output", str(output)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"ds-tree plot-multiturn: error: {run / 'metrics.jsonl'}{expected}")
    assert not output.exists()


def test_plot_multiturn_needs_metrics_with_an_rl_step(tmp_path, capsys):
    output = tmp_path / "multiturn.png"
    assert main(["plot-multiturn", str(tmp_path), "--output", str(output)]) == 2
    assert f"error: {tmp_path / 'metrics.jsonl'}: no such file" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(json.dumps(multiturn_records()[0]) + "\n")
    assert main(["plot-multiturn", str(tmp_path), "--output", str(output)]) == 2
    assert "metrics.jsonl: no RL step (rollout/reward_mean) yet" in capsys.readouterr().err
    assert not output.exists()
