"""Bad command lines and outputs: one ``error:`` line naming the option or file, exit code 2, found
before any work is done; plots are written at the path given (matplotlib alone would append .png)."""

import json
from pathlib import Path

import pytest

from ds_tree.cli import (
    bench,
    bench_attention,
    bench_kernel,
    bench_sweep,
    convert,
    make_synthetic,
    plan,
    plot_multiturn,
    plot_online,
    sample,
    stats,
    verify,
)

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def usage_error(capsys, command, argv: list[str]) -> str:
    """The stderr of a command that must stop with a usage error (exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        command.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err
    return err


def test_make_synthetic_output_into_a_missing_folder_or_onto_a_directory(tmp_path, capsys):
    base = ["--groups", "2", "--por", "0.5"]
    err = usage_error(capsys, make_synthetic, ["--output", str(tmp_path / "missing" / "x.jsonl"), *base])
    assert f"--output {tmp_path / 'missing' / 'x.jsonl'}: no such directory" in err and ".partial" not in err
    err = usage_error(capsys, make_synthetic, ["--output", str(tmp_path), *base])
    assert f"--output {tmp_path}: is a directory" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("memory", ["inf", "nan", "-1", "0"])
def test_plan_memory_must_be_a_finite_positive_number(memory, capsys):
    err = usage_error(capsys, plan, [str(ROOT / "configs/tiny_cpu.yaml"), "--memory-gib", memory])
    assert "--memory-gib a finite number > 0" in err


def test_bench_needs_a_mode_and_a_measured_step(tmp_path, capsys):
    base = ["--data", str(tmp_path / "data.jsonl"), "--model", "configs/models/tiny_llama.json"]
    assert "--modes '' names no mode" in usage_error(capsys, bench, [*base, "--modes", ""])
    assert "--modes ' , ' names no mode" in usage_error(capsys, bench, [*base, "--modes", " , "])
    assert "--steps: must be >= 1, got 0" in usage_error(capsys, bench, [*base, "--steps", "0"])


def test_sample_checks_its_output_folder_before_loading_anything(tmp_path, capsys):
    """The model and tokenizer do not exist: the output folder is named first, before any sampling."""
    output = tmp_path / "missing_dir" / "o.jsonl"
    argv = ["--model", str(tmp_path / "no_model"), "--tokenizer", str(tmp_path / "no_tokenizer")]
    err = usage_error(capsys, sample, [*argv, "--prompts", str(tmp_path / "p.jsonl"), "--output", str(output)])
    assert f"--output {output}: no such directory" in err


def test_sample_never_writes_over_its_input_and_replaces_an_output_only_when_asked(tmp_path, capsys):
    """Issue 42 #2: ``sample --prompts P --output P`` overwrote its own input. The output may not be an
    input (also through a symlink), and an existing output needs --overwrite; all before any loading."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    link = tmp_path / "link.jsonl"
    link.symlink_to(prompts)
    argv = ["--model", str(tmp_path / "no_model"), "--tokenizer", str(tmp_path / "no_tokenizer")]
    for output in (prompts, link):
        err = usage_error(capsys, sample, [*argv, "--prompts", str(prompts), "--output", str(output), "--overwrite"])
        assert f"--output {output}: is the input {prompts}" in err
    existing = tmp_path / "old.jsonl"
    existing.write_text("kept\n")
    err = usage_error(capsys, sample, [*argv, "--prompts", str(prompts), "--output", str(existing)])
    assert f"--output {existing}: exists (pass --overwrite to replace it)" in err
    assert prompts.read_text() == '{"prompt_ids": [1, 2]}\n' and existing.read_text() == "kept\n"


def test_no_command_writes_over_its_input(tmp_path, capsys):
    """Issue 42 #2, the neighbours of ``sample``: every output option that could name an input is refused."""
    data = tmp_path / "tokens.jsonl"
    content = json.dumps({"group_id": "a", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}) + "\n"
    data.write_text(content)
    run = write_run(tmp_path / "run", [json.dumps(RECORD)])
    metrics = run / "metrics.jsonl"
    model = str(ROOT / "configs/models/tiny_llama.json")
    cases = [
        (stats, [str(data), "--plot", str(data)], f"--plot {data}: is the input"),
        (plot_online, [f"tree={run}", "--output", str(metrics)], f"--output {metrics}: is the input"),
        (plot_multiturn, [str(run), "--output", str(metrics)], f"--output {metrics}: is the input"),
        (bench, ["--data", str(data), "--model", model, "--json", str(data)], f"--json {data}: is the input"),
        (bench, ["--data", str(data), "--model", model, "--json", model], f"--json {model}: is the input"),
        (bench, ["--data", str(data), "--model", model, "--profile", str(data)], f"--profile {data}: is the input"),
        (bench_attention, ["--data", str(data), "--json", str(data)], f"--json {data}: is the input"),
    ]
    before = metrics.read_text()
    for command, argv, message in cases:
        assert message in usage_error(capsys, command, argv), (command, argv)
    assert data.read_text() == content and metrics.read_text() == before


def test_convert_names_an_input_directory(tmp_path, capsys):
    folder = tmp_path / "inputs"
    folder.mkdir()
    argv = ["--input", str(folder), "--output", str(tmp_path / "out"), "--tokenizer", str(tmp_path)]
    err = usage_error(capsys, convert, argv)
    assert f"--input {folder}: is a directory" in err and "no such file" not in err


# ------------------------------------------------------------------- plot-online
RECORD = {"step": 1, "rollout/reward_mean": 0.5, "rollout/sampled_tokens": 8, "rollout/forward_tokens": 10}


def write_run(directory: Path, lines: list[str]) -> Path:
    directory.mkdir()
    (directory / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return directory


@pytest.mark.parametrize(
    "second, expected",
    [
        ({**RECORD, "rollout/forward_tokens": None}, ":2: rollout/forward_tokens is null: the run logged a value that"),
        ({k: v for k, v in RECORD.items() if "reward" not in k}, ":2: the record has no 'rollout/reward_mean'"),
        ({k: v for k, v in RECORD.items() if k != "step"}, ":2: the record has no 'step'"),
        ({**RECORD, "step": "two"}, ":2: step must be a number, got 'two'"),
        ('{"step": 2, "rollout/rew', ":2: malformed JSON"),
    ],
)
def test_plot_online_names_the_file_and_line_of_a_bad_record(second, expected, tmp_path, capsys):
    line = second if isinstance(second, str) else json.dumps(second)
    run = write_run(tmp_path / "run", [json.dumps(RECORD), line])
    output = tmp_path / "curves.png"
    assert plot_online.main([f"tree={run}", "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert f"error: {run / 'metrics.jsonl'}{expected}" in err, err
    assert not output.exists()


def test_plot_online_writes_the_path_given(tmp_path, capsys):
    run = write_run(tmp_path / "run", [json.dumps({**RECORD, "step": step}) for step in (1, 2, 3)])
    for output in (tmp_path / "plots" / "plot", tmp_path / "curves.v2"):
        assert plot_online.main([f"tree={run}", "--output", str(output), "--window", "2"]) == 0
        assert capsys.readouterr().out.endswith(f"wrote {output}\n")
        assert output.read_bytes()[:8] == PNG
    assert not (tmp_path / "plots" / "plot.png").exists() and not (tmp_path / "curves.v2.png").exists()
    svg = tmp_path / "curves.svg"
    assert plot_online.main([f"tree={run}", "--output", str(svg)]) == 0
    assert svg.read_text().lstrip().startswith("<?xml")
    err = usage_error(capsys, plot_online, [f"tree={run}", "--output", str(tmp_path)])
    assert f"--output {tmp_path}: is a directory" in err


def test_stats_plot_writes_the_path_given(tmp_path, capsys):
    data = tmp_path / "tokens.jsonl"
    data.write_text(json.dumps({"group_id": "a", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}) + "\n")
    plot = tmp_path / "histograms"
    assert stats.main([str(data), "--json", "--plot", str(plot)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["n_trajectories"] == 1 and f"wrote {plot}" in err
    assert plot.read_bytes()[:8] == PNG and not (tmp_path / "histograms.png").exists()
    assert f"--plot {tmp_path}: is a directory" in usage_error(capsys, stats, [str(data), "--plot", str(tmp_path)])


DATA_MODEL = ["--data", "missing.jsonl", "--model", "configs/models/tiny_llama.json"]


@pytest.mark.parametrize(
    "command, argv, message",
    [  # issue 42 #9, #21, #31: numbers are never reinterpreted (-1 a slice end, 0 a default, inf a loss)
        (verify, ["--limit", "-1"], "argument --limit: must be >= 1, got -1"),
        (verify, ["--dfs-chunk", "0"], "argument --dfs-chunk: must be >= 1, got 0"),
        (verify, ["--dfs-recompute"], "--dfs-recompute: only with --dfs-chunk C"),
        (verify, ["--sequence-parallel", "0"], "argument --sequence-parallel: must be >= 1, got 0"),
        (verify, ["--budget", "-1"], "argument --budget: must be >= 1, got -1"),
        (verify, ["--objective", "grpo", "--kl-coef", "inf"], "argument --kl-coef: must be a finite number"),
        (verify, ["--objective", "grpo", "--perturbation", "nan"], "argument --perturbation: must be a finite"),
        (bench, ["--limit", "-1"], "argument --limit: must be >= 1, got -1"),
        (bench, ["--groups-per-step", "0"], "argument --groups-per-step: must be >= 1, got 0"),
        (bench, ["--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (bench, ["--threads", "-1"], "argument --threads: must be >= 1, got -1"),
        (bench, ["--json", "/proc/ds_tree_x.json"], "--json /proc/ds_tree_x.json: cannot write in /proc"),
    ],
)
def test_numbers_and_outputs_are_checked_before_any_work(command, argv, message, capsys):
    assert message in usage_error(capsys, command, [*DATA_MODEL, *argv])


@pytest.mark.parametrize(
    "argv, message",
    [
        *[([option, "0"], f"argument {option}: must be >= 1, got 0") for option in
          ("--trees", "--depth", "--branching", "--node-len", "--head-dim", "--heads", "--kv-heads")],
        (["--heads", "4", "--kv-heads", "3"], "--heads 4 must be a multiple of --kv-heads 3"),
        (["--json", "/proc/ds_tree_x.json"], "--json /proc/ds_tree_x.json: cannot write in /proc"),
    ],
)  # fmt: skip
def test_bench_kernel_refuses_impossible_shapes_before_any_work(argv, message, capsys):
    assert message in usage_error(capsys, bench_kernel, argv)


def test_plots_to_unwritable_paths_are_refused_before_any_work(tmp_path, capsys):
    data = tmp_path / "tokens.jsonl"
    data.write_text(json.dumps({"group_id": "a", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}) + "\n")
    err = usage_error(capsys, stats, [str(data), "--plot", "/proc/ds_tree_x/plot.png"])
    assert "--plot /proc/ds_tree_x/plot.png: cannot write in /proc" in err
    run = write_run(tmp_path / "run", [json.dumps({**RECORD, "step": 1})])
    err = usage_error(capsys, plot_online, [f"tree={run}", "--output", "/proc/ds_tree_x.png"])
    assert "--output /proc/ds_tree_x.png: cannot write in /proc" in err
    afile = tmp_path / "afile"
    afile.write_text("")
    err = usage_error(capsys, stats, [str(data), "--plot", str(afile / "sub" / "plot.png")])
    assert f"{afile} is not a directory" in err


@pytest.mark.parametrize(
    "command, argv, message",
    [  # the same rule for the neighbouring commands
        (bench_attention, ["--data", "x.jsonl", "--threads", "0"], "argument --threads: must be >= 1, got 0"),
        (bench_attention, ["--data", "x.jsonl", "--heads", "-1"], "argument --heads: must be >= 1, got -1"),
        (bench_attention, ["--data", "x.jsonl", "--json", "/proc/ds_tree_x"], "--json /proc/ds_tree_x: cannot write"),
        (bench_sweep, ["--out", "x", "--groups", "0"], "argument --groups: must be >= 1, got 0"),
        (verify, [*DATA_MODEL, "--router-aux-loss-coef", "inf"], "argument --router-aux-loss-coef: must be a finite"),
    ],
)
def test_neighbouring_commands_check_numbers_and_outputs_first(command, argv, message, capsys):
    assert message in usage_error(capsys, command, argv)
