"""No silent wrong results, no silent loss of checkpoints, bad configs caught before training.

Config values are checked from their types (finite floats, numeric strings, choices, list
lengths); the dry run (``train.main --dry-run`` in-process) refuses what used to crash after the
model was built; models whose layers mix tokens outside the tree attention are refused; a
non-finite loss stops a 2-rank run without saving, and ``optimizer.non_finite=skip`` discards
exactly that step; a full disk during a checkpoint is named and keeps the earlier checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import typing
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree import config as config_module
from ds_tree import train
from ds_tree.config import ConfigError, load_config
from ds_tree.data.sampler import StepSampler
from ds_tree.errors import DataError, RolloutError
from ds_tree.losses.sft import NORMALISATIONS, POLICIES
from ds_tree.models.loading import load_model
from ds_tree.models.token_mixing import UnsupportedModelError, check_branch_isolation, check_layer_types
from ds_tree.packing.modes import MODES
from ds_tree.registries import ATTENTION_ENGINES
from ds_tree.run import checkpoint
from ds_tree.sampling.interface import EngineError
from ds_tree.scans.fla_scan import RECURRENT_KERNELS
from tests.helpers import ROOT
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import PYTHON, environment, launch_training
from tests.helpers.runs import dry_run

TINY_CPU = ROOT / "configs" / "tiny_cpu.yaml"


# --------------------------------------------------------------- config values
def float_fields(cls: type = config_module.Config, prefix: str = "") -> list[str]:
    """Dotted names of every float field of the config, list elements as ``name[i]``."""
    names = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            names += float_fields(hint, f"{prefix}{field.name}.")
        elif hint is float:
            names.append(prefix + field.name)
        elif typing.get_origin(hint) is tuple:
            names += [f"{prefix}{field.name}[{i}]" for i, t in enumerate(typing.get_args(hint)) if t is float]
    return names


def override_for(key: str, value: str) -> str:
    if "[" not in key:
        return f"{key}={value}"
    name, index = key[:-1].split("[")
    values = ["0.5", "0.5"]
    values[int(index)] = value
    return f"{name}=[{', '.join(values)}]"


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "inf", "nan"])
@pytest.mark.parametrize("key", float_fields())
def test_every_float_field_rejects_non_finite_values(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"tiny_cpu.yaml: {re.escape(key)} must be a finite number"):
        load_config(TINY_CPU, [override_for(key, value)])


def test_float_fields_take_numeric_strings(tmp_path: Path) -> None:
    text = TINY_CPU.read_text().replace("lr: 2.0e-3", "lr: 3e-4")
    assert "lr: 3e-4" in text
    path = tmp_path / "config.yaml"
    path.write_text(text)
    config = load_config(path, ["optimizer.eps=1e-6", "optimizer.betas=[9e-1, 95e-2]"])
    assert (config.optimizer.lr, config.optimizer.eps, config.optimizer.betas) == (3e-4, 1e-6, (0.9, 0.95))


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.dtype=float16", r"model.dtype must be one of float32, bfloat16; got 'float16'"),
        (
            "model.attention=flash",
            r"model.attention must be one of auto, reference, torch, triton, flex, varlen; got 'flash'",
        ),
        ("checkpoint.resume=true", r"checkpoint.resume must be one of auto, latest, newest_complete, never; got True"),
        ("optimizer.non_finite=ignore", r"optimizer.non_finite must be one of stop, skip; got 'ignore'"),
        ("optimizer.betas=[0.9]", r"optimizer.betas must be a list of 2 values, got \[0.9\]"),
        ("optimizer.betas=[0.9, 1.0]", r"optimizer.betas must both be in \[0, 1\)"),
        ("optimizer.min_lr_ratio=2", r"optimizer.min_lr_ratio must be in \[0, 1\]"),
        ("distributed.timeout_s=0", r"distributed.timeout_s must be > 0"),
    ],
)
def test_values_are_checked_against_their_types(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"tiny_cpu.yaml: {message}"):
        load_config(TINY_CPU, [override])


def test_choices_are_the_library_registries() -> None:
    assert typing.get_args(config_module.AttentionEngine)[1].names() == ("auto", *ATTENTION_ENGINES.names())
    assert typing.get_args(config_module.PackingMode) == MODES
    assert typing.get_args(config_module.Normalisation) == NORMALISATIONS
    assert typing.get_args(config_module.WeightPolicy) == POLICIES
    assert typing.get_args(config_module.RecurrentKernels) == RECURRENT_KERNELS


# ------------------------------------------------------------------- dry run
@pytest.fixture
def forest_config(tmp_path: Path) -> Path:
    return write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("logging.every=0", "logging.every must be >= 1"),
        ("optimizer.betas=[0.9]", "optimizer.betas must be a list of 2 values"),
        ("optimizer.eps=-1", "optimizer.lr and optimizer.eps must be > 0"),
        ("optimizer.lr=.inf", "optimizer.lr must be a finite number"),
        ("optimizer.lr=.nan", "optimizer.lr must be a finite number"),
        ("output_dir=FILE", "exists and is not a directory"),
        ("output_dir=FILE/run", "is not a directory"),
        ("output_dir=/proc/ds_tree_run", "/proc/ds_tree_run cannot be written"),
        ("optimizer.non_finite=skip deepspeed=STAGE0", "optimizer.non_finite=skip needs ZeRO stage 1-3 or bf16"),
    ],
)
def test_dry_run_refuses_what_would_crash_later(monkeypatch, capsys, tmp_path, forest_config, override, message):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    stage0 = tmp_path / "stage0.json"
    stage0.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    overrides = override.replace("FILE", str(afile)).replace("STAGE0", str(stage0)).split()
    code, err = dry_run(monkeypatch, capsys, forest_config, *overrides)
    assert code == 2
    assert "config error: " in err and message in err, err


def failing_run(monkeypatch, capsys, config: Path, error: Exception, world_size: int = 1) -> tuple[int, str]:
    """``train.main`` on ``config`` whose training raises ``error`` mid-run (no engine is built)."""
    monkeypatch.chdir(ROOT)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(train.Trainer, "setup", lambda self: None)
    monkeypatch.setattr(train.PreemptionHandler, "before_first_step", lambda self, trainer: None)

    def fail(self):
        raise error

    monkeypatch.setattr(train.Trainer, "train", fail)
    code = train.main(["--config", str(config)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "error",
    [
        DataError("rollouts.jsonl:3: a turn reward is nan"),
        EngineError("the vLLM server exited with code 1: out of memory"),
        ConfigError("rollout.env.path: the constructor failed"),
        RolloutError("step 3: only 1 task(s) kept a leaf, fewer than objective.mini_batches=2; ..."),
    ],
    ids=lambda error: type(error).__name__,
)
def test_explained_mid_run_errors_are_one_message_without_a_traceback(monkeypatch, capsys, forest_config, error):
    """Issue 42 #26: errors the project raises on purpose say everything in their message."""
    code, err = failing_run(monkeypatch, capsys, forest_config, error)
    assert code == 1 and f"error: {error}" in err and "Traceback" not in err, err


def test_a_timeout_blames_another_rank_only_when_there_is_one(monkeypatch, capsys, forest_config):
    """Issue 42 #24: a one-process run has no other rank a collective could have waited for."""
    code, err = failing_run(monkeypatch, capsys, forest_config, TimeoutError("the request timed out"))
    assert code == 1 and "timed out" in err and "for another rank" not in err, err
    code, err = failing_run(monkeypatch, capsys, forest_config, TimeoutError("the request timed out"), world_size=2)
    assert code == 1 and "a collective waited distributed.timeout_s=1800 s for another rank" in err, err


def test_dry_run_accepts_exponents_without_a_dot(monkeypatch, capsys, forest_config):
    code, err = dry_run(monkeypatch, capsys, forest_config, "optimizer.lr=1e-3", "optimizer.weight_decay=1e-2")
    assert code == 0, err


@pytest.mark.parametrize("content", ["step_00000x6", "", "../..", "/tmp"])
def test_dry_run_refuses_a_damaged_latest(monkeypatch, capsys, tmp_path, forest_config, content):
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in (1, 2):
        tag = checkpoints / checkpoint.tag_for(step)
        tag.mkdir(parents=True)
        for rank in range(2):
            (tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_bytes(b"weights %d" % rank)
        files = checkpoint.describe_files(tag, checkpoint.listing(tag))  # complete: every listed file there
        record = {"step": step, "world_size": 2, "config": {}, "files": files}
        (tag / checkpoint.RECORD).write_text(json.dumps(record))
    (checkpoints / "latest").write_text(content)
    code, err = dry_run(monkeypatch, capsys, forest_config)
    assert code == 2
    assert f"checkpoint error: {checkpoints / 'latest'}: names {content!r}" in err
    assert "complete checkpoints there: step_0000001, step_0000002" in err
    code, err = dry_run(monkeypatch, capsys, forest_config, "checkpoint.resume=newest_complete", "max_steps=1")
    assert code == 2 and "max_steps (1) is below the step of" in err and "step_0000002 (2)" in err


def fake_checkpoint(run: Path, step: int, config: dict, *extra: str) -> Path:
    """A complete checkpoint of ``step`` (2 ranks) whose record holds ``config``, with ``extra`` files."""
    tag = run / "checkpoints" / checkpoint.tag_for(step)
    tag.mkdir(parents=True)
    for name in [f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" for rank in range(2)] + list(extra):
        (tag / name).write_bytes(b"weights")
    files = checkpoint.describe_files(tag, checkpoint.listing(tag))
    (tag / checkpoint.RECORD).write_text(json.dumps({"step": step, "world_size": 2, "config": config, "files": files}))
    (run / "checkpoints" / "latest").write_text(tag.name)
    return tag


@pytest.mark.parametrize(
    "saved, now, message",
    [
        (["model.lora.rank=4"], ["model.lora.rank=8"], "model.lora.rank changed from 4 to 8"),
        (
            ["model.lora.rank=4"],
            ["model.lora.rank=4", "model.lora.target_modules=[q_proj]"],
            "model.lora.target_modules changed from ['all-linear'] to ['q_proj']",
        ),
    ],
)
def test_dry_run_refuses_a_resume_with_other_trained_parameters(
    monkeypatch, capsys, tmp_path, forest_config, saved, now, message
):
    """Issue 42 #19: a changed LoRA rank or target_modules failed on a tensor size after the model was built."""
    config = config_module.config_to_dict(load_config(forest_config, saved))
    fake_checkpoint(tmp_path / "run", 1, config)
    code, err = dry_run(monkeypatch, capsys, forest_config, *now)
    assert code == 2 and "config error: " in err and message in err and "start a new output_dir" in err, err
    code, err = dry_run(monkeypatch, capsys, forest_config, *saved, "model.lora.alpha=8")
    assert code == 0, err  # alpha scales the adapters: a change the weights still fit


def test_dry_run_refuses_a_resume_whose_checkpoint_lacks_the_reference_copy(
    monkeypatch, capsys, tmp_path, forest_config
):
    """Issue 42 #27: found after the model was built, exit 1; now at the dry run, exit 2."""
    forest = tmp_path / "forest.jsonl"
    records = [json.loads(line) for line in forest.read_text().splitlines()]
    forest.write_text("".join(json.dumps({**r, "reward": float(i % 2)}) + "\n" for i, r in enumerate(records)))
    rl = ["objective.kind=grpo", "objective.kl_coef=0.1", "objective.reference_step=1", "max_steps=3"]
    tag = fake_checkpoint(tmp_path / "run", 2, config_module.config_to_dict(load_config(forest_config, rl)))
    code, err = dry_run(monkeypatch, capsys, forest_config, *rl)
    assert code == 2 and f"checkpoint error: {tag} holds no reference_policy.pt" in err, err


# --------------------------------------------------------- unsupported models
# (the qwen3_5, qwen3_next, bamba, nemotron_h and falcon_h1 hybrids run their recurrent layers per tree node:
# tests/test_hybrid_models.py)
@pytest.mark.parametrize("model_type", ["mamba", "jamba", "recurrent_gemma"])
def test_layer_types_outside_the_attention_interface_are_refused(model_type: str) -> None:
    from transformers import AutoConfig

    with pytest.raises(UnsupportedModelError, match=r"layer_types has (linear_attention|hybrid)"):
        check_layer_types(AutoConfig.for_model(model_type))


def test_dry_run_refuses_a_mamba_config(monkeypatch, capsys, tmp_path, forest_config):
    source = tmp_path / "tiny_mamba.json"
    source.write_text(
        json.dumps({"model_type": "mamba", "vocab_size": 1024, "hidden_size": 32, "num_hidden_layers": 2})
    )
    code, err = dry_run(monkeypatch, capsys, forest_config, f"model.source={source}")
    assert code == 2
    assert "config error: MambaConfig (mamba): layer_types has linear_attention (layers 0, 1)" in err


def test_probe_refuses_a_layer_that_mixes_tokens_by_itself() -> None:
    """A Mamba model built past the static check: its mixer runs along the packed row."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_tree.attention.registry import register_tree_attention

    register_tree_attention()
    config = AutoConfig.for_model("mamba", vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="tree_torch")
    with pytest.raises(UnsupportedModelError, match=r"layer 0 \(MambaBlock: MambaMixer, MambaRMSNorm\) lets the"):
        check_branch_isolation(model)
    assert model.training  # left as it was


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_probe_passes_models_that_mix_tokens_through_attention(name: str, dtype: str) -> None:
    check_branch_isolation(load_model(ROOT / "configs" / "models" / f"{name}.json", dtype=dtype))


# ------------------------------------------------------- non-finite, 2 ranks
NAN_TOKEN = 1000


def write_step_data(path: Path, nan_group: int, untrained_group: int) -> None:
    """Four groups of three trajectories; one holds a token whose embedding is NaN, one trains nothing."""
    rng = np.random.default_rng(1)
    with open(path, "w") as handle:
        for group in range(4):
            stem = rng.integers(3, 900, 40).tolist()
            for _ in range(3):
                ids = stem + rng.integers(3, 900, int(rng.integers(5, 40))).tolist()
                mask = [0] * 10 + [1] * (len(ids) - 10)
                if group == nan_group:
                    ids[20] = NAN_TOKEN
                if group == untrained_group:
                    mask = [0] * len(ids)
                handle.write(json.dumps({"group_id": f"g{group}", "input_ids": ids, "loss_mask": mask}) + "\n")


def fp32_weights(checkpoints: Path, step: int) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoints), tag=checkpoint.tag_for(step))


@pytest.mark.distributed
def test_non_finite_loss_stops_without_saving_and_skip_discards_only_that_step(tmp_path: Path) -> None:
    model_dir = tmp_path / "nan_model"
    model = load_model(ROOT / "configs" / "models" / "tiny_llama.json", seed=3)
    with torch.no_grad():
        model.get_input_embeddings().weight[NAN_TOKEN] = float("nan")
    model.save_pretrained(model_dir)
    order = [StepSampler(4, 1, seed=0).groups_for_step(step)[0] for step in range(4)]
    data = tmp_path / "steps.jsonl"
    write_step_data(data, nan_group=order[1], untrained_group=order[2])  # steps 2 and 3
    config = write_config(
        tmp_path,
        data,
        model={"source": str(model_dir)},
        max_steps=4,
        checkpoint={"every": 1, "keep_last": 4, "export_hf": True},
    )
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"

    process = launch_training(config, "data.groups_per_step=1", "optimizer.non_finite=stop")
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0, output[-4000:]
    for rank in (0, 1):
        assert f"[rank {rank}] error: step 2: the loss is nan; stopped without applying its update" in output
    assert "Nothing was saved: step_0000001 stays the newest checkpoint" in output
    assert checkpoint.complete_tags(checkpoints) == ["step_0000001"]
    assert (checkpoints / "latest").read_text() == "step_0000001"
    assert not (run / "hf").exists()

    process = launch_training(config, "data.groups_per_step=1", "optimizer.non_finite=skip")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    assert "resuming from step_0000001 with a changed config: optimizer.non_finite: 'stop' -> 'skip'" in output
    assert "step 2: the loss is nan; its update is discarded (optimizer.non_finite=skip; 1 step(s) skipped)" in output
    assert "warning: step 3 has no trained token" in output
    assert "warning: 1 of 4 steps had no trained token" in output
    assert "warning: 1 of 4 steps were discarded (non-finite)" in output
    assert (run / "config.yaml").is_file() and (run / "config.1.yaml").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[1]["loss/train"] is None and records[2]["loss/train"] == 0.0  # NaN is written as null
    assert [r["optim/skipped_steps"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert checkpoint.complete_tags(checkpoints) == [checkpoint.tag_for(step) for step in range(1, 5)]
    before, skipped, last = fp32_weights(checkpoints, 1), fp32_weights(checkpoints, 2), fp32_weights(checkpoints, 4)
    for name, value in before.items():
        torch.testing.assert_close(skipped[name], value, rtol=0, atol=0, equal_nan=True)
    assert any(not torch.equal(last[name], value) for name, value in before.items())
    assert (run / "hf" / "model.safetensors").is_file()


# ------------------------------------------------------------------- full disk
def mount_tmpfs(path: Path) -> bool:
    path.mkdir(parents=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(path)], capture_output=True)
    return result.returncode == 0


@pytest.mark.distributed
def test_full_disk_during_a_checkpoint_is_named_and_keeps_the_earlier_one(tmp_path: Path) -> None:
    """On a small tmpfs filled to the last byte where one can be mounted, else with DeepSpeed's save raising ENOSPC."""
    disk = tmp_path / "disk"
    mounted = mount_tmpfs(disk)
    try:
        config = write_config(
            tmp_path,
            write_forest(tmp_path / "forest.jsonl"),
            output_dir=str(disk / "run"),
            deepspeed=str(ROOT / "configs" / "ds" / "zero2.json"),
            logging={"progress_bar": False, "report_to": []},
        )
        out = tmp_path / "report.json"
        command = [PYTHON, str(ROOT / "tests/distributed/checkpoint_write_check.py"), "--config", str(config)]
        command += ["--out", str(out), "--mode", "fill" if mounted else "simulate"]
        result = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        report = json.loads(out.read_text())
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)
    checkpoints = disk / "run" / "checkpoints"
    assert report["message"].startswith(
        f"checkpoint step_0000002 could not be written to {checkpoints}: no space left on device"
    )
    assert "the last complete checkpoint, step_0000001, is kept" in report["message"]
    assert report["latest"] == "step_0000001" and report["complete"] == ["step_0000001"]


# ------------------------------------------------- options that cannot apply, caught at config time
def test_groups_per_step_above_the_groups_is_refused(monkeypatch, capsys, forest_config) -> None:
    code, err = dry_run(monkeypatch, capsys, forest_config, "data.groups_per_step=7")  # the forest has 6 groups
    assert code == 2
    assert "data.groups_per_step (7) is more than the 6 groups in data.path" in err and "at most 6" in err
    assert dry_run(monkeypatch, capsys, forest_config, "data.groups_per_step=6")[0] == 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["objective.kl_coef=0.1"], r"objective.kl_coef: only with objective.kind grpo or ppo \(kind is sft\)"),
        (["objective.entropy_coef=0.01", "objective.ppo_epochs=2"], r"objective.entropy_coef, objective.ppo_epochs: "),
        (["objective.mini_batches=2"], r"objective.mini_batches: only with objective.kind grpo or ppo"),
        (["objective.old_logprobs=data"], r"objective.old_logprobs: only with objective.kind grpo or ppo"),
        (["objective.estimator=rloo"], r"objective.estimator: only with"),
        (["objective.reference=x.json"], r"objective.reference: only with"),
        (["objective.kind=grpo", "objective.normalisation=sum"], r"objective.normalisation: only with .*kind sft"),
        (
            ["objective.kind=grpo", "objective.aggregation_constant=64"],
            r"objective.aggregation_constant \(64.0\) applies to aggregation token_sum_norm only",
        ),
        (
            ["objective.kind=grpo", "objective.estimator=tempo", "objective.tempo_coef=1e300"],
            r"objective.tempo_coef \(1e\+300\) scales the value differences .* at most 1e\+06",
        ),
        (["rollout.width=100"], r"rollout: sampler width 100 exceeds branching\*\*max_depth"),
        (["rollout.prompts_per_step=0"], r"rollout.prompts_per_step must be >= 1"),
        (["rollout.logprob_floor=0.5"], r"rollout.logprob_floor must be <= 0"),
        (["rollout.top_p=0"], r"rollout: sampler top_p must be in \(0, 1\]"),
    ],
)
def test_options_that_cannot_apply_are_refused(overrides: list[str], message: str) -> None:
    """As ``verify`` refuses ``--kl-coef`` with ``--objective sft`` (objective_strays, one rule), and
    rollout values out of range are errors while rollout is disabled."""
    with pytest.raises(ConfigError, match=rf"tiny_cpu.yaml: {message}"):
        load_config(TINY_CPU, overrides)


def test_saved_sft_configs_still_load(tmp_path: Path) -> None:
    """The estimator an SFT config.yaml records (the resolved default, grpo) is not an RL option given."""
    from ds_tree.config import config_to_dict

    saved = tmp_path / "config.yaml"
    saved.write_text(yaml_dump(config_to_dict(load_config(TINY_CPU))))
    assert load_config(saved).objective.estimator == "grpo"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.lora.alpha=8"], r"model.lora.alpha: only with LoRA adapters; set model.lora.rank > 0"),
        (["model.lora.modules_to_save=[lm_head]"], r"model.lora.modules_to_save: only with LoRA adapters"),
        (["model.lora.target_modules=[q_proj]", "model.lora.dropout=0.1"], r"model.lora.dropout, model.lora."),
        (
            ["model.lora.rank=4", "checkpoint.merge=true", "checkpoint.export_hf=false"],
            r"checkpoint.merge writes the merged model in the export: it needs checkpoint.export_hf: true",
        ),
        (["packing.dfs_chunk=64"], r"packing.dfs_chunk: only with dfs walks; set packing.mode: dfs"),
        (["packing.dfs_recompute=true", "packing.mode=flat"], r"packing.dfs_recompute: only with dfs walks"),
        (["rollout.engine=vllm"], r"rollout.engine: only with online RL; set rollout.enabled: true"),
        (["rollout.max_staleness=1"], r"rollout.max_staleness: only with online RL"),
        (["rollout.vllm.timeout_s=10", "rollout.vllm.url=http://x"], r"rollout.vllm.url, rollout.vllm.timeout_s: "),
        (["rollout.env.path=a.b:C"], r"rollout.env.path: only with online RL"),
        (["rollout.prompts=p.jsonl", "rollout.width=4"], r"rollout.width, rollout.prompts: only with online RL"),
    ],
)
def test_settings_that_cannot_apply_are_refused(overrides: list[str], message: str) -> None:
    """Issue 42 #10: a setting nothing would read is refused at config time, naming it and what would
    make it apply; its default value, written out, is not."""
    with pytest.raises(ConfigError, match=rf"tiny_cpu.yaml: {message}"):
        load_config(TINY_CPU, overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.lora.alpha=16", "model.lora.target_modules=[all-linear]", "checkpoint.merge=false"],
        ["packing.dfs_chunk=0", "packing.dfs_recompute=false", "rollout.engine=hf", "rollout.vllm.retries=2"],
        ["model.lora.rank=4", "model.lora.alpha=8", "checkpoint.merge=true"],
        ["packing.mode=dfs", "packing.dfs_chunk=64", "packing.dfs_recompute=true"],
        ["packing.over_budget=dfs", "packing.dfs_chunk=64"],
    ],
)
def test_settings_that_apply_or_are_defaults_are_accepted(overrides: list[str]) -> None:
    load_config(TINY_CPU, overrides)


MULTITURN_CPU = ROOT / "configs" / "multiturn_cpu.yaml"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.env.warmup_steps=0"], r"rollout.env.warmup_lr \(0.01\) is the learning rate of the warm-up steps"),
        (["rollout.independent=true"], r"rollout.env.turn_branching: rollout.independent forks every episode at"),
        (["rollout.env.fork=none"], r"rollout.env.turn_branching: rollout.env.fork none forks at the prompt only"),
        (  # issue 42 #6: the 4-way fork after turn 2 never happens: one leaf a task
            ["rollout.env.turn_branching=[1,1,4]", "rollout.width=4", "rollout.env.max_turns=2"],
            r"rollout.env.turn_branching \[1, 1, 4\] forks 4 ways at turn boundary 2, but .*max_turns \(2\) ends",
        ),
        (
            ["rollout.enabled=false", "data.path=x.jsonl"],
            r"rollout.branching, .*rollout.env.path, .*: only with online RL",
        ),
    ],
)
def test_episode_settings_that_cannot_apply_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=rf"multiturn_cpu.yaml: {message}"):
        load_config(MULTITURN_CPU, ["objective.reference_step=0", "objective.kl_coef=0", *overrides])


def test_turn_branching_replaces_the_quota_rule_width_check() -> None:
    """Issue 42 #31: ``turn_branching: [1, 16]`` makes 16 leaves; ``branching**max_depth`` (2**3) does
    not apply to it, and its sampler settings are built without that check."""
    overrides = ["rollout.branching=2", "rollout.max_depth=3", "rollout.env.turn_branching=[1,16]"]
    config = load_config(MULTITURN_CPU, overrides)
    assert config.rollout.sampler_settings().width == 16
    with pytest.raises(ConfigError, match=r"sampler width 16 exceeds branching\*\*max_depth = 2\*\*3"):
        load_config(MULTITURN_CPU, [*overrides, "rollout.env.turn_branching=[]", "rollout.env.path="])


def test_verify_options_share_the_config_rule() -> None:
    from ds_tree.cli.objective_options import RL_FIELDS
    from ds_tree.config import KIND_ONLY_FIELDS, RL_ONLY_FIELDS, SFT_ONLY_FIELDS, ObjectiveConfig

    assert set(RL_FIELDS) <= set(RL_ONLY_FIELDS)
    fields = {f.name for f in dataclasses.fields(ObjectiveConfig)}
    every_kind = {"kind", "self_check"}
    assert set(RL_ONLY_FIELDS) | set(SFT_ONLY_FIELDS) | set(KIND_ONLY_FIELDS) == fields - every_kind


def test_warmup_longer_than_the_run_warns(monkeypatch, capsys, forest_config) -> None:
    code, err = dry_run(monkeypatch, capsys, forest_config, "optimizer.warmup_steps=10", "max_steps=4")
    assert code == 0
    assert "optimizer.warmup_steps (10) is more than max_steps (4): the whole run trains in the warm-up" in err
    assert "warm-up" not in dry_run(monkeypatch, capsys, forest_config, "optimizer.warmup_steps=4", "max_steps=4")[1]


def yaml_dump(tree: dict) -> str:
    import yaml

    return yaml.safe_dump(tree)


# ---------------------------------------- model settings caught at dry-run time, naming the field
def model_json(tmp_path: Path, **changes) -> Path:
    fields = {**json.loads((ROOT / "configs/models/tiny_llama.json").read_text()), **changes}
    path = tmp_path / "model.json"
    path.write_text(json.dumps(fields))
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
        ({"vocab_size": -5}, "vocab_size must be a positive integer, got -5"),
        ({"num_attention_heads": 5}, r"hidden_size \(64\) is not a multiple of num_attention_heads \(5\)"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
        ({"num_hidden_layers": 1.5}, "num_hidden_layers must be a positive integer, got 1.5"),
    ],
)
def test_impossible_model_sizes_are_config_errors(monkeypatch, capsys, forest_config, tmp_path, changes, message):
    source = model_json(tmp_path, **changes)
    code, err = dry_run(monkeypatch, capsys, forest_config, f"model.source={source}")
    assert code == 2 and re.search(rf"config error: {re.escape(str(source))}: {message}", err), err
    assert "Traceback" not in err
    from ds_tree.cli.plan import main as plan_main

    assert plan_main([str(forest_config), f"model.source={source}"]) == 2  # plan: no ZeroDivisionError
    assert re.search(message, capsys.readouterr().err)


def test_reference_and_triton_are_checked_at_dry_run(monkeypatch, capsys, forest_config, tmp_path) -> None:
    rl = ("objective.kind=grpo", "objective.kl_coef=0.1")
    code, err = dry_run(monkeypatch, capsys, forest_config, *rl, "objective.reference=/missing.json")
    assert code == 2 and "objective.reference: /missing.json: no such model config file" in err, err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code, err = dry_run(monkeypatch, capsys, forest_config, "model.attention=triton")
    assert code == 2 and "model.attention: triton needs a CUDA GPU and none is visible" in err, err
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's CPU interpreter, as the tests run it
    assert dry_run(monkeypatch, capsys, forest_config, "model.attention=triton")[0] == 0


def test_config_paths_resolve_outside_the_repository(monkeypatch, capsys, tmp_path) -> None:
    """configs/tiny_cpu.yaml names configs/ds/zero3.json and configs/models/...: found from anywhere."""
    from ds_tree.cli.plan import main as plan_main

    monkeypatch.chdir(tmp_path)
    config = load_config(TINY_CPU)
    assert Path(config.deepspeed) == ROOT / "configs/ds/zero3.json"
    assert Path(config.model.source) == ROOT / "configs/models/tiny_llama.json"
    assert plan_main([str(TINY_CPU)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    (tmp_path / "configs" / "ds").mkdir(parents=True)  # a file beside the caller wins, as before
    (tmp_path / "configs/ds/zero3.json").write_text("{}")
    assert load_config(TINY_CPU).deepspeed == "configs/ds/zero3.json"


def test_plan_applies_the_dry_runs_sequence_parallel_check(capsys) -> None:
    from ds_tree.cli.plan import main as plan_main

    assert plan_main([str(TINY_CPU), "parallel.sequence_parallel_size=3", "--world-size", "2"]) == 2
    assert "parallel.sequence_parallel_size (3) does not divide the world size (2)" in capsys.readouterr().err


def test_dry_run_says_what_plan_predicts_for_a_model_too_large(monkeypatch, capsys, forest_config, tmp_path) -> None:
    big = model_json(tmp_path, hidden_size=8192, intermediate_size=28672, num_hidden_layers=48, num_attention_heads=64)
    code, err = dry_run(monkeypatch, capsys, forest_config, f"model.source={big}")
    assert code == 0  # a warning: the dry run also checks configs meant for another machine
    predicted = r"warning: ds-tree plan predicts (2 ranks x )?[\d.]+ GiB per rank \([\d.]+ B parameters, ZeRO-3 over 2"
    assert re.search(predicted, err), err
    assert re.search(r"GiB in all, against [\d.]+ GiB of (this machine's|the GPU's) memory", err), err
    assert "ds-tree plan predicts" not in dry_run(monkeypatch, capsys, forest_config)[1]


# --------------------------------------------------------------- a failing rank tells the others why
def test_failure_messages_are_read_from_other_ranks_of_this_launch_only(tmp_path: Path) -> None:
    """Issue 42 #22: ``run/failures`` hands one rank's failure to the others, never an earlier launch's."""
    import os
    import time

    from ds_tree.run import failures

    failures.record(tmp_path, 2, "an earlier launch's failure")
    os.utime(failures.path_for(tmp_path, 2), (1.0, 1.0))
    started = time.time() - 1
    failures.record(tmp_path, 0, "this rank's own")
    assert failures.others(tmp_path, 0, started, wait_s=0) == []
    failures.record(tmp_path, 1, "DataError: x.jsonl:3: bad")
    assert failures.others(tmp_path, 0, started, wait_s=0) == [(1, "DataError: x.jsonl:3: bad")]
    failures.clear(tmp_path, 1)
    assert failures.others(tmp_path, 0, started, wait_s=0) == []
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer.")
    assert failures.is_broken_collective(gloo) and failures.is_broken_collective(TimeoutError())
    assert not failures.is_broken_collective(ValueError("step 3: bad")) and not failures.is_broken_collective(
        RuntimeError("CUDA out of memory")
    )


def test_a_broken_collective_reports_the_rank_that_failed(monkeypatch, capsys, tmp_path, forest_config):
    import os
    import time

    from ds_tree.run import failures

    (tmp_path / "run").mkdir()
    failures.record(tmp_path / "run", 1, "DataError: rollouts.jsonl:3: a turn reward is nan")
    later = time.time() + 60  # written during the run that train.main below starts
    os.utime(failures.path_for(tmp_path / "run", 1), (later, later))
    reset = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:18818: Connection reset by peer. This is typically")
    code, err = failing_run(monkeypatch, capsys, forest_config, reset, world_size=2)
    assert code == 1 and "error: rank 1 failed: DataError: rollouts.jsonl:3: a turn reward is nan" in err, err
    assert "Traceback" not in err and "collective waiting for it: [pair.cc:537]" in err, err
    assert not failures.path_for(tmp_path / "run", 0).exists()  # a consequence is not recorded as a cause


def test_a_rank_records_its_own_failure_for_the_others(monkeypatch, capsys, tmp_path, forest_config):
    from ds_tree.run import failures

    code, err = failing_run(monkeypatch, capsys, forest_config, DataError("x.jsonl:3: bad"), world_size=2)
    assert code == 1 and "error: x.jsonl:3: bad" in err
    assert failures.path_for(tmp_path / "run", 0).read_text() == "x.jsonl:3: bad\n"
    code, err = failing_run(monkeypatch, capsys, forest_config, DataError("x.jsonl:3: bad"), world_size=1)
    assert not failures.path_for(tmp_path / "run", 1).exists()


@pytest.mark.distributed
def test_two_ranks_the_survivor_names_the_failed_ranks_error(tmp_path: Path) -> None:
    """Rank 1 fails at step 2 (a ValueError injected through sitecustomize); rank 0, waiting in the step's
    first collective, reports rank 1's error instead of gloo's "Connection reset by peer"."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import ds_tree.engine.trainer as t\n"
        "    step_once = t.Trainer.train_step\n"
        "    def train_step(self, step):\n"
        "        if step == 2:\n"
        "            raise ValueError('injected on rank 1 at step 2')\n"
        "        return step_once(self, step)\n"
        "    t.Trainer.train_step = train_step\n"
    )
    config = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"), max_steps=3)
    process = launch_training(config, "logging.report_to=[]", env={"PYTHONPATH": f"{hook}:{ROOT}"})
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0, output[-4000:]
    assert "[rank 1] error: ValueError: injected on rank 1 at step 2" in output, output[-4000:]
    assert "[rank 0] error: rank 1 failed: ValueError: injected on rank 1 at step 2" in output, output[-4000:]


# ================================================================ round 4 (issue 55): images, formats, commands
def cli_error(capsys) -> str:
    """The one error line a command printed (its stderr), checked to be one line without a traceback."""
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> Path:
    """A qwen2_5_vl processor folder (``make-tokenizer --vision``)."""
    from ds_tree.cli.make_tokenizer import main as make_tokenizer_main

    folder = tmp_path_factory.mktemp("processor") / "proc"
    assert make_tokenizer_main(["--output", str(folder), "--vision", "qwen2_5_vl"]) == 0
    return folder


def snapshot_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------- 1: make-tokenizer writes only where it may
def test_make_tokenizer_never_writes_into_a_model_a_dataset_or_another_tokenizer(tmp_path, capsys, processor):
    """Issue 55 #1: it replaced an exported model's tokenizer.json, wrote into a converted dataset and turned a
    qwen2_5_vl processor folder into a qwen3_vl one without a word."""
    import shutil

    from ds_tree.cli.convert import main as convert_main
    from ds_tree.cli.make_tokenizer import main as make_tokenizer_main
    from ds_tree.run.export import save_hf

    model = load_model(ROOT / "configs/models/tiny_llama.json")
    save_hf(model, model.state_dict(), tmp_path / "export", str(processor))
    forest = write_forest(tmp_path / "forest.jsonl", groups=2)
    dataset = tmp_path / "dataset"
    assert (
        convert_main(
            ["--input", str(forest), "--output", str(dataset), "--tokenizer", str(processor), "--format", "tokens"]
        )
        == 0
    )
    capsys.readouterr()
    vl = tmp_path / "vl"
    shutil.copytree(processor, vl)
    for folder in (tmp_path / "export", dataset, vl):
        before = snapshot_of(folder)
        for overwrite in ([], ["--overwrite"]) if folder != vl else ([],):
            assert make_tokenizer_main(["--output", str(folder), "--vision", "qwen3_vl", *overwrite]) == 2
            err = cli_error(capsys)
            assert err.startswith(f"error: {folder}: exists"), err
        assert snapshot_of(folder) == before, folder
    assert "pass --overwrite" in err
    assert make_tokenizer_main(["--output", str(vl), "--vision", "qwen3_vl", "--overwrite"]) == 0  # its own: replaced
    assert json.loads((vl / "ds_tree_vision.json").read_text())["family"] == "qwen3_vl"
    assert not list(tmp_path.glob(".vl*"))  # the temporary folder is gone


def test_make_tokenizer_into_an_unwritable_folder_is_one_error(capsys):
    """Issue 55 #10: ``make-tokenizer --output /proc/x`` raised a traceback."""
    from ds_tree.cli.make_tokenizer import main as make_tokenizer_main

    assert make_tokenizer_main(["--output", "/proc/ds_tree_tokenizer"]) == 2
    assert "/proc/ds_tree_tokenizer: cannot write in /proc" in cli_error(capsys)


# --------------------------------------------- 2, 9, 15, note 3: reading images
def image_reader(processor: Path, max_pixels: int | None = None):
    from ds_tree.data.chat_images import ImageReader
    from ds_tree.vocab.vision_processor import load_vision_processor

    vision = load_vision_processor(processor)
    extra = {} if max_pixels is None else {"max_pixels": max_pixels}
    return ImageReader(vision.image_processor, vision.family.merge_size, **extra), vision


@pytest.mark.parametrize("height", [1, 3])
def test_images_keep_their_orientation_whatever_their_size(tmp_path, processor, height):
    """Issue 55 #2: an image 1 or 3 pixels high was taken for channels-first: its grid transposed, its pixels
    garbled, in convert and in environment observations alike."""
    from PIL import Image

    from ds_tree.rollout.images import ObservationImages, with_pil_images

    pixels = (np.random.default_rng(0).random((height, 200, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "strip.png")
    reader, vision = image_reader(processor)
    expected = vision.image_processor(images=[pixels], return_tensors="np", input_data_format="channels_last")
    from_file = reader.read(f"{tmp_path / 'x.jsonl'}:1", "part", {"type": "image", "image": "strip.png"})
    observation = with_pil_images("step", [{"role": "tool", "content": [{"type": "image", "image": pixels}]}])
    observed = ObservationImages(vision).of(observation)
    for image in (from_file, observed[0]):
        t, h, w = image.grid_thw
        assert h < w and (t, h, w) == tuple(expected["image_grid_thw"][0]), image.grid_thw
        assert np.array_equal(image.pixel_values, expected["pixel_values"])


def png_declaring(width: int, height: int) -> bytes:
    """A few hundred bytes of PNG whose header declares ``width`` x ``height`` pixels (the data is not there)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def gui_chat(folder: Path, images: list[str]) -> Path:
    """One chat record per image, the image in its user message."""
    records = [
        {
            "group_id": f"g{index}",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Look."}, {"type": "image", "image": name}]},
                {"role": "assistant", "content": "ok"},
            ],
        }
        for index, name in enumerate(images)
    ]
    path = folder / "gui.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_over_limit_images_are_refused_from_their_header_and_skipped(tmp_path, processor, capsys):
    """Issue 55 #9: a 5 KB PNG declaring 100000 x 100000 died with a DecompressionBombError traceback (exit 1,
    --skip-bad did not skip it); one declaring 12000 x 12000 was decoded in full. Both now are one file:line
    error before decoding, under a pixel limit that --max-image-pixels sets."""
    from PIL import Image

    from ds_tree.cli.convert import main as convert_main

    (tmp_path / "bomb.png").write_bytes(png_declaring(100_000, 100_000))
    (tmp_path / "big.png").write_bytes(png_declaring(12_000, 12_000))
    Image.fromarray(np.zeros((28, 56, 3), np.uint8)).save(tmp_path / "ok.png")
    data = gui_chat(tmp_path, ["ok.png", "bomb.png", "big.png"])
    common = ["--input", str(data), "--tokenizer", str(processor), "--format", "chat"]
    assert convert_main([*common, "--output", str(tmp_path / "out")]) == 2
    err = cli_error(capsys)
    assert f"{data}:2: message 0: content part 1: the image declares more than" in err, err
    assert "more than --max-image-pixels (40000000); refused before decoding it" in err, err
    assert convert_main([*common, "--output", str(tmp_path / "out"), "--skip-bad"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["skipped"] == {"bad_image": 2} and summary["counts"]["trajectories"] == 1
    gui_chat(tmp_path, ["big.png"])
    assert convert_main([*common, "--output", str(tmp_path / "out2")]) == 2
    assert "gui.jsonl:1: message 0: content part 1: the image is 12000 x 12000 = 144000000 pixels" in cli_error(capsys)
    gui_chat(tmp_path, ["ok.png"])  # 1568 pixels
    assert convert_main([*common, "--output", str(tmp_path / "out3"), "--max-image-pixels", "1000"]) == 2
    assert "the image is 56 x 28 = 1568 pixels, more than --max-image-pixels (1000)" in cli_error(capsys)


def test_unreadable_images_name_the_part_not_a_python_object(tmp_path, processor):
    """Issue 55, note: "unreadable image" printed a BytesIO object's repr."""
    (tmp_path / "garbage.png").write_bytes(b"not a png")
    reader, _ = image_reader(processor)
    with pytest.raises(DataError, match=r"part: unreadable image \(UnidentifiedImageError: not an image") as caught:
        reader.read(f"{tmp_path / 'x.jsonl'}:1", "part", {"type": "image", "image": "garbage.png"})
    assert "BytesIO" not in str(caught.value) and " at 0x" not in str(caught.value)


@pytest.mark.parametrize(
    "image, message",
    [
        (np.zeros((0, 0, 3), np.uint8), r"content part 0: the image has no pixels \(0 x 0\)"),
        (np.zeros((0, 7, 3), np.uint8), r"content part 0: the image has no pixels \(7 x 0\)"),
    ],
)
def test_observation_images_without_pixels_are_environment_errors(processor, image, message):
    """Issue 55 #15: a [0, 0, 3] array ended the leaf with "EnvFailure: division by zero"."""
    from ds_tree.rollout.images import ImageFailure, ObservationImages, with_pil_images
    from ds_tree.vocab.vision_processor import load_vision_processor

    images = ObservationImages(load_vision_processor(processor))
    with pytest.raises(ImageFailure, match=message):
        images.of(with_pil_images("step", [{"role": "tool", "content": [{"type": "image", "image": image}]}]))


def test_observation_images_over_the_limit_are_environment_errors(processor):
    """Issue 55 #9: observations have the pixel limit too (rollout.env.max_image_pixels), checked before the image
    is hashed or processed; its default is convert's."""
    from ds_tree.cli.choices import CONVERT_DEFAULTS
    from ds_tree.data.chat_images import MAX_IMAGE_PIXELS
    from ds_tree.rollout.images import ImageFailure, ObservationImages, with_pil_images
    from ds_tree.sampling.settings import EnvSettings
    from ds_tree.vocab.vision_processor import load_vision_processor

    assert EnvSettings().max_image_pixels == CONVERT_DEFAULTS["max_image_pixels"] == MAX_IMAGE_PIXELS
    images = ObservationImages(load_vision_processor(processor), max_pixels=3000)
    message = r"content part 0: the image is 50 x 80 = 4000 pixels, more than rollout.env.max_image_pixels \(3000\)"
    with pytest.raises(ImageFailure, match=message):
        part = {"type": "image", "image": np.zeros((80, 50, 3), np.uint8)}
        images.of(with_pil_images("step", [{"role": "tool", "content": [part]}]))


# --------------------------------------------- 3, 4, 13, 14: converting data with images
VISION_IDS = [1024, 1025, 1026, 1027]


def tokens_record(pixel_values, loss_mask=None) -> dict:
    ids = [3, 10, 1024, 1026, 1026, 1025, 11, 12, 4]
    return {
        "group_id": "g",
        "input_ids": ids,
        "loss_mask": loss_mask or [1] * len(ids),
        "images": [{"pixel_values": pixel_values, "grid_thw": [1, 2, 4]}],
    }


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_image_placeholders_are_never_trained(tmp_path, processor):
    """Issue 55 #3: with --train-on all, or a tokens record whose loss_mask marks them, the placeholders were
    trained; docs/DATA.md says they never are."""
    from PIL import Image

    from ds_tree.data import load_trajectories
    from ds_tree.data.convert import ConvertOptions, convert

    Image.fromarray(np.zeros((28, 56, 3), np.uint8)).save(tmp_path / "shot.png")
    chat = gui_chat(tmp_path, ["shot.png"])
    tokens = write_records(tmp_path / "tokens.jsonl", [tokens_record([[0.5] * 1176] * 8)])
    for path, options in ((chat, ConvertOptions(train_on="all")), (tokens, ConvertOptions(format="tokens"))):
        convert([path], tmp_path / path.stem, processor, options)
        (trajectory,) = load_trajectories(tmp_path / path.stem)
        placeholders = np.isin(trajectory.input_ids, VISION_IDS)
        assert placeholders.sum() >= 4 and not trajectory.loss_mask[placeholders].any(), path
        assert trajectory.loss_mask[~placeholders][1:].all(), path  # everything else still trained


@pytest.mark.parametrize(
    "pixels, message",
    [
        ([[float("nan")] + [0.5] * 1175] + [[0.5] * 1176] * 7, r"images\[0\]: pixel_values has a value that is not a"),
        ([[0.5] * 1176] * 7 + [[1e300] * 1176], r"images\[0\]: pixel_values has a value .* in row 7"),
        ("inf.npy", r"images\[0\]: pixel_values has a value that is not a finite float32 number"),
        ("complex.npy", r"images\[0\]: 'complex.npy' holds complex numbers \(complex128\)"),
    ],
)
def test_non_finite_or_complex_pixels_are_one_file_line_error_and_skipped(tmp_path, processor, pixels, message):
    """Issue 55 #4: NaN or inf pixels (a list or a .npy) were stored, and a complex .npy lost its imaginary
    part; verify then exited 1 with null losses and training stopped at step 1 ("the loss is nan")."""
    from ds_tree.data.convert import ConvertOptions, convert

    values = np.full((8, 1176), 0.5)
    np.save(tmp_path / "inf.npy", np.where(np.arange(8)[:, None] == 3, np.inf, values))
    np.save(tmp_path / "complex.npy", values + 0.5j)
    good = tokens_record([[0.5] * 1176] * 8)
    path = write_records(tmp_path / "tokens.jsonl", [good, tokens_record(pixels)])
    with pytest.raises(DataError, match=rf"tokens\.jsonl:2: {message}"):
        convert([path], tmp_path / "out", processor, ConvertOptions(format="tokens"))
    summary = convert([path], tmp_path / "out", processor, ConvertOptions(format="tokens", skip_bad=True))
    assert summary["skipped"] == {"bad_image": 1} and summary["counts"]["trajectories"] == 1


def test_a_converted_dataset_with_non_finite_pixels_is_refused_naming_its_file(tmp_path):
    """Issue 55 #4: a dataset converted before the check (NaN pixels, stored under their own key) was read,
    and verify then exited 1 with null losses and no message."""
    import hashlib

    from ds_tree.data import load_trajectories
    from ds_tree.data.tree_dataset import IMAGES_FILE, save_tree_dataset
    from ds_tree.trees.images import TrajectoryImage
    from ds_tree.trees.trajectory import Trajectory

    pixels = np.full((8, 1176), 0.5, np.float32)
    pixels[2, 5] = np.nan
    digest = hashlib.sha256(repr(((1, 2, 4), 2, pixels.shape, "float32")).encode() + pixels.tobytes())
    image = TrajectoryImage(pixels, (1, 2, 4), 2, digest.hexdigest())  # as a convert before the check stored it
    ids = tokens_record(None)["input_ids"]
    index = [-1, -1, -1, 0, 0, -1, -1, -1, -1]
    trajectory = Trajectory(np.array(ids), np.ones(len(ids)), group_id="g", images=(image,), image_index=index)
    save_tree_dataset([trajectory], tmp_path / "d", {})
    with pytest.raises(DataError, match=rf"{IMAGES_FILE}: image 0: pixel_values has a value that is not a finite"):
        load_trajectories(tmp_path / "d")


def test_explicit_trees_with_image_parts_say_so(tmp_path, processor, tokenizer_dir):
    """Issue 55 #14: "more image placeholders than image parts" (or, without a processor folder, "use one")
    where the reason is that explicit trees do not carry images yet."""
    from ds_tree.data.convert import ConvertOptions, convert

    image = {"type": "image", "image": "shot.png"}
    tree = {
        "group_id": "t",
        "nodes": [
            {
                "id": 0,
                "parent": None,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, image]}],
            },
            {"id": 1, "parent": 0, "messages": [{"role": "assistant", "content": "ok"}]},
        ],
    }
    path = write_records(tmp_path / "tree.jsonl", [tree])
    for folder in (processor, tokenizer_dir):
        with pytest.raises(DataError, match=r"tree\.jsonl:1: a node's messages hold image parts; explicit trees do "):
            convert([path], tmp_path / "out", folder, ConvertOptions(format="tree"))


def test_saved_rollouts_of_a_vision_language_run_are_refused_clearly(tmp_path, processor):
    """Issue 55 #13: stats and verify said "convert the file first", and convert refused the records for
    lacking pixels: the saved rollouts name images by key only, which no command can read."""
    from ds_tree.data import load_trajectories
    from ds_tree.data.convert import ConvertOptions, convert

    record = tokens_record(None)
    record["images"] = [{"key": "ab" * 32, "grid_thw": [1, 2, 4]}]
    path = write_records(tmp_path / "step_000001.jsonl", [record])
    message = r"step_000001\.jsonl:1: a saved rollout of a vision-language run: it names its images by key only"
    with pytest.raises(DataError, match=message):
        load_trajectories(path)  # what stats and verify read
    with pytest.raises(DataError, match=message):
        convert([path], tmp_path / "out", processor, ConvertOptions(format="tokens"))


# --------------------------------------------- 7, 8: vision families and the commands
def test_images_of_another_vision_family_are_refused_before_the_model_runs(tmp_path, monkeypatch, capsys, processor):
    """Issue 55 #7: data processed for Qwen2.5-VL with a Qwen3-VL model passed the dry run; verify then died
    with "The size of tensor a (294) must match", training with "shape '[-1, 3, 2, 16, 16]' is invalid", and
    the GUI config's sampler raised out of the episode runner."""
    from PIL import Image

    from ds_tree.data import load_trajectories
    from ds_tree.data.convert import ConvertOptions, convert
    from ds_tree.rollout.images import observation_images
    from ds_tree.verify.tree_vs_flat import compare

    Image.fromarray((np.random.default_rng(0).random((28, 56, 3)) * 255).astype(np.uint8)).save(tmp_path / "a.png")
    convert([gui_chat(tmp_path, ["a.png", "a.png"])], tmp_path / "data", processor, ConvertOptions())
    qwen3 = ROOT / "configs/models/tiny_qwen3_vl.json"
    message = r"has 1176 values per patch and merge size 2, but the model \(qwen3_vl\) takes 1536 .*--vision qwen3_vl"
    with pytest.raises(ValueError, match=message):
        compare(load_trajectories(tmp_path / "data"), qwen3, dtype="float64")
    config = write_config(tmp_path, tmp_path / "data", model={"source": str(qwen3)})
    code, err = dry_run(monkeypatch, capsys, config, "data.groups_per_step=2")
    assert code == 2 and re.search(rf"config error: model.source: .*{message}", err), err
    with pytest.raises(ValueError, match=r"the processor folder \(qwen2_5_vl\) has 1176 values per patch"):
        observation_images(processor, load_model_config_of(qwen3))
    gui = [f"model.source={qwen3}", f"output_dir={tmp_path / 'gui'}"]
    code, err = dry_run(
        monkeypatch, capsys, ROOT / "configs/multiturn_gui_cpu.yaml", f"model.tokenizer={processor}", *gui
    )
    assert code == 2 and "the processor folder (qwen2_5_vl) has 1176 values per patch" in err, err


def load_model_config_of(path: Path):
    from ds_tree.models.loading import load_config as load_model_config

    return load_model_config(path)


def test_plan_and_sample_take_vision_language_configs(tmp_path, capsys, processor):
    """Issue 55 #8: plan --explain died on pad_token_id, sample on vocab_size (a VL config keeps both in its
    text_config)."""
    from ds_tree.cli import sample
    from ds_tree.cli.plan import main as plan_main

    vl = ROOT / "configs/models/tiny_qwen2_5_vl.json"
    config = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"), model={"source": str(vl)})
    assert plan_main([str(config), "--explain"]) == 0, capsys.readouterr().err
    assert "tree rows under packing.budget 400" in capsys.readouterr().out
    prompts = write_records(tmp_path / "prompts.jsonl", [{"group_id": "p", "prompt": "hi"}])
    common = ["--model", str(vl), "--tokenizer", str(processor), "--prompts", str(prompts), "--width", "2"]
    assert sample.main([*common, "--max-new-tokens", "3", "--output", str(tmp_path / "out.jsonl")]) == 0
    assert json.loads(capsys.readouterr().out)["trajectories"] == 2


def test_multiturn_reuse_takes_an_exported_vision_language_policy(tmp_path, capsys, processor):
    """Issue 55 #8: ``multiturn-reuse --model <exported VL model>`` raised "Unrecognized configuration class"
    (it loaded AutoModelForCausalLM); the policy's screenshots are now read with its processor folder."""
    from ds_tree.cli.multiturn_reuse import main as reuse_main
    from ds_tree.run.export import save_hf

    model = load_model(ROOT / "configs/models/tiny_qwen2_5_vl.json")
    save_hf(model, model.state_dict(), tmp_path / "hf", str(processor))
    config = tmp_path / "gui.yaml"
    text = (ROOT / "configs/multiturn_gui_cpu.yaml").read_text()
    config.write_text(
        text.replace("turn_branching: [1, 16]", "turn_branching: [1, 2]").replace("width: 16", "width: 2")
    )
    args = ["--model", str(tmp_path / "hf"), "--tokenizer", str(processor), "--config", str(config), "--count", "1"]
    assert reuse_main([*args, "--tasks", str(ROOT / "configs/gui_tasks.jsonl")]) == 0, capsys.readouterr().err
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith(("| tree", "| independent"))]
    assert len(rows) == 3 and all(int(row.split("|")[4]) > 0 for row in rows), table  # sampled tokens


# --------------------------------------------- 17: observation limit counts images
def test_max_observation_tokens_counts_image_tokens(processor):
    """Issue 55 #17: 60 images (240 tokens) passed max_observation_tokens: 3."""
    from ds_tree.rollout.images import observation_images
    from ds_tree.rollout.render import Renderer

    vl = load_model_config_of(ROOT / "configs/models/tiny_qwen2_5_vl.json")
    from ds_tree.data.convert import load_tokenizer

    tokenizer = load_tokenizer(processor)
    renderer = Renderer(tokenizer, [4], 10, None, observation_images(processor, vl))
    from PIL import Image

    screen = Image.new("RGB", (56, 28))  # 2 merged patches: 4 tokens with <|vision_start|>, <|vision_end|>
    many = {"role": "tool", "content": [{"type": "image", "image": screen}] * 60}
    cut = renderer.cut(many)
    images = [part for part in cut["content"] if part["type"] == "image"]
    assert len(images) == 2 and cut["content"][-1] == {"type": "text", "text": "\n[observation cut: 232 more tokens]"}
    words = {"type": "text", "text": "one two three four five six seven eight nine ten"}
    cut = renderer.cut({"role": "tool", "content": [{"type": "image", "image": screen}, words]})
    assert [part["type"] for part in cut["content"]] == ["image", "text", "text"]
    assert (
        len(renderer.encode_content(cut["content"][1]["text"])) <= 6 and "observation cut" in cut["content"][2]["text"]
    )
    few = {"role": "tool", "content": [{"type": "image", "image": screen}, {"type": "text", "text": "ok"}]}
    assert renderer.cut(few) is few


# --------------------------------------------- 10, 15, 16: the newer commands' outputs and numbers
def test_plan_takes_any_finite_memory(capsys) -> None:
    """Issue 55 #10: --memory-gib 1e300 raised OverflowError (1e300 GiB in bytes overflows a float)."""
    from ds_tree.cli.plan import main as plan_main

    assert plan_main([str(TINY_CPU), "--memory-gib", "1e300", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["largest_budget"]["without_checkpointing"] > 10**290


def test_a_bogus_tile_schedule_is_one_error_and_the_dry_run_checks_it(monkeypatch, capsys, forest_config) -> None:
    """Issue 55 #10: DS_TREE_TRITON_TILES=bogus bench-kernel printed a traceback, and the CPU dry run never
    checked the value."""
    from ds_tree.cli.bench_kernel import main as bench_kernel_main

    monkeypatch.setenv("DS_TREE_TRITON_TILES", "bogus")
    with pytest.raises(SystemExit) as raised:
        bench_kernel_main([])
    assert raised.value.code == 2
    assert "$DS_TREE_TRITON_TILES = 'bogus': choose one of loop, list" in capsys.readouterr().err
    code, err = dry_run(monkeypatch, capsys, forest_config)
    assert code == 2 and "config error: $DS_TREE_TRITON_TILES = 'bogus': choose one of loop, list" in err, err


def test_gpu_check_into_an_unwritable_folder_is_one_error(capsys) -> None:
    """Issue 55 #10: ``gpu-check --smoke --output /proc/gc`` raised a traceback."""
    from ds_tree.cli.gpu_check import main as gpu_check_main

    with pytest.raises(SystemExit) as raised:
        gpu_check_main(["--smoke", "--sections", "hybrid", "--output", "/proc/gc"])
    assert raised.value.code == 2 and "--output /proc/gc: cannot write in /proc" in capsys.readouterr().err


def test_gpu_check_writes_only_a_new_folder_or_its_own_report(tmp_path, capsys) -> None:
    """Issue 55 #16: ``gpu-check --output configs`` wrote its report into the repository's config folder."""
    from ds_tree.cli.gpu_check import main as gpu_check_main

    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "tiny_cpu.yaml").write_text("max_steps: 1\n")
    with pytest.raises(SystemExit) as raised:
        gpu_check_main(["--smoke", "--sections", "hybrid", "--output", str(configs)])
    assert raised.value.code == 2 and "holds files that gpu-check did not write" in capsys.readouterr().err
    assert sorted(p.name for p in configs.iterdir()) == ["tiny_cpu.yaml"]
    report = tmp_path / "report"
    for _ in range(2):  # a new folder, then its own report written again
        gpu_check_main(["--smoke", "--sections", "hybrid", "--output", str(report)])
        assert (report / "gpu_check.json").is_file()


def write_multiturn_metrics(run: Path, reward=0.5) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    records = [{"step": 1, "warmup/sft_loss": 2.0, "time/step_s": 1.0}]
    for step in (2, 3):
        records.append(
            {
                "step": step,
                "rollout/reward_mean": reward,
                "rollout/sampled_tokens": 100,
                "rollout/tokens_saved": 50,
                "tree/por": 0.5,
                "rollout/parse_errors": 0,
                "rollout/env_errors": 0,
                "time/step_s": 1.0,
            }
        )
    return write_records(run / "metrics.jsonl", records)


def test_plot_multiturn_draws_a_title_as_written(tmp_path) -> None:
    """Issue 55 #10: a title with ``$\\frac{$`` raised mathtext's parse error (a traceback)."""
    from ds_tree.cli.plot_multiturn import main as plot_main

    write_multiturn_metrics(tmp_path / "run")
    output = tmp_path / "plots" / "curve.png"
    assert plot_main([str(tmp_path / "run"), "--output", str(output), "--title", r"$\frac{$"]) == 0
    assert output.read_bytes()[:4] == b"\x89PNG"


def test_plot_multiturn_replaces_a_link_never_its_target(tmp_path) -> None:
    """Issue 55 #16: --output followed a symbolic link pointing outside and overwrote its target."""
    from ds_tree.cli.plot_multiturn import main as plot_main

    write_multiturn_metrics(tmp_path / "run")
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("keep me")
    link = tmp_path / "link.png"
    link.symlink_to(outside)
    assert plot_main([str(tmp_path / "run"), "--output", str(link)]) == 0
    assert outside.read_text() == "keep me" and not link.is_symlink() and link.read_bytes()[:4] == b"\x89PNG"


def test_plot_multiturn_names_null_metrics(tmp_path, capsys) -> None:
    """Issue 55 #15: a run whose RL metrics are null was "the record has no 'rollout/reward_mean'"."""
    from ds_tree.cli.plot_multiturn import main as plot_main

    write_multiturn_metrics(tmp_path / "run", reward=None)
    assert plot_main([str(tmp_path / "run"), "--output", str(tmp_path / "curve.png")]) == 2
    message = "metrics.jsonl:2: rollout/reward_mean is null: the run logged a value that was not finite (NaN or inf)"
    assert message in cli_error(capsys)


# --------------------------------------------- notes
def test_a_model_folder_with_auto_map_runs_none_of_its_code(tmp_path) -> None:
    """Issue 55, note: docs/LAUNCH.md said such a folder "is refused"; a known model_type loads its built-in
    class (the auto_map is ignored), an unknown one is refused; its Python files never run."""
    base = json.loads((ROOT / "configs/models/tiny_llama.json").read_text())
    for model_type in ("llama", "my_custom_model"):
        folder = tmp_path / model_type
        folder.mkdir()
        auto_map = {"AutoConfig": "custom.Config", "AutoModelForCausalLM": "custom.Model"}
        (folder / "config.json").write_text(json.dumps({**base, "model_type": model_type, "auto_map": auto_map}))
        (folder / "custom.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    assert type(load_model(tmp_path / "llama")).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="contains custom code"):
        load_model(tmp_path / "my_custom_model")
    assert not (tmp_path / "ran").exists()
