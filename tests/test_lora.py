"""LoRA adapters (``model.lora``, PEFT) on trees: tree == flat on the adapter gradients in float64
(SFT, GRPO with KL, dfs and activation checkpointing), the KL reference with the adapters disabled
equal to a separately loaded base model, config refusals, and the merged export's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.cli.verify import main
from ds_tree.config import ConfigError, LoraSettings, load_config
from ds_tree.data import load_trajectories
from ds_tree.data.jsonl import write_jsonl
from ds_tree.losses.advantages import estimate
from ds_tree.losses.rl import RLSettings
from ds_tree.models.loading import load_model
from ds_tree.models.lora import AdaptersDisabled, apply_lora, merged_state_dict
from ds_tree.objectives.rl_rows import StepNormalisers, prepare_rl_rows
from ds_tree.packing.modes import pack_trajectories
from tests.test_verify_rl import records

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "configs/models/tiny_llama.json")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return str(write_jsonl(tmp_path_factory.mktemp("lora") / "rl.jsonl", records()))


def verify(argv: list[str], capsys) -> dict:
    code = main(argv)
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    return report


def test_sft_adapter_gradients_tree_equal_flat(data, capsys):
    report = verify(["--data", data, "--model", MODEL, "--budget", "64", "--lora", "4", "--dfs-chunk", "16"], capsys)
    assert report["lora_rank"] == 4 and report["passed"]
    for error in ("loss_rel_err", "max_rel_grad_err", "max_abs_logprob_err", "dfs_max_rel_grad_err"):
        assert report[error] < 1e-10, (error, report[error])
    assert "lora_" in report["worst_parameter"]  # only adapter weights have gradients


def test_grpo_adapter_gradients_tree_equal_flat_with_kl(data, capsys):
    argv = ["--data", data, "--model", MODEL, "--objective", "grpo", "--budget", "64", "--lora", "4"]
    report = verify([*argv, "--kl-coef", "0.05", "--entropy-coef", "0.01"], capsys)
    assert report["passed"] and report["max_rel_grad_err"] < 1e-10
    metrics = report["metrics_flat"]
    assert metrics["clip_low"] > 0 and metrics["clip_high"] > 0 and metrics["kl_ref"] > 0, metrics


def lora_policy(dtype=torch.float64, seed: int = 3, **settings) -> torch.nn.Module:
    torch.manual_seed(seed + 1)
    base = load_model(MODEL, dtype=dtype, seed=seed)
    return apply_lora(base, LoraSettings(rank=4, **settings), init_lora_weights=False)


def test_a_modules_to_save_typo_is_refused_as_a_target_modules_typo_is():
    """Issue 42 #7: PEFT skips a ``modules_to_save`` name that matches nothing; the run trained without it."""
    with pytest.raises(ValueError, match=r"model.lora.modules_to_save: 'lm_haed' matches no module of this model"):
        lora_policy(modules_to_save=["lm_haed"])
    with pytest.raises(ValueError, match=r"model.lora: .*q_projj"):
        lora_policy(target_modules=["q_projj"])


def test_modules_to_save_typo_is_a_dry_run_config_error(tmp_path, monkeypatch, capsys):
    from tests.helpers.runs import dry_run

    config = tmp_path / "c.yaml"
    config.write_text(
        f"model: {{source: {MODEL}}}\ndata: {{path: {tmp_path / 'd.jsonl'}}}\noutput_dir: {tmp_path / 'run'}\n"
    )
    (tmp_path / "d.jsonl").write_text(
        json.dumps({"group_id": "a", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}) + "\n"
    )
    code, err = dry_run(
        monkeypatch,
        capsys,
        config,
        "data.groups_per_step=1",
        "model.lora.rank=4",
        "model.lora.modules_to_save=[lm_haed]",
    )
    assert code == 2 and "modules_to_save: 'lm_haed' matches no module" in err and "Traceback" not in err, err


def test_kl_reference_with_adapters_disabled_equals_a_separate_base_model(data):
    trajectories = load_trajectories(data)
    rows = pack_trajectories(trajectories, "tree", 64, 1)
    advantages = estimate(trajectories, "grpo", False).by_trajectory()
    settings = RLSettings(kl_coef=0.1)
    normalisers = StepNormalisers.of(trajectories)
    policy = lora_policy()
    base = load_model(MODEL, dtype=torch.float64, seed=3).requires_grad_(False)
    with torch.no_grad():
        disabled = prepare_rl_rows(policy, rows, advantages, settings, normalisers, reference=AdaptersDisabled(policy))
        separate = prepare_rl_rows(policy, rows, advantages, settings, normalisers, reference=base)
    for a, b in zip(disabled, separate, strict=True):
        np.testing.assert_array_equal(np.asarray(a.logp_ref), np.asarray(b.logp_ref))
        assert np.abs(np.asarray(a.logp_old) - np.asarray(a.logp_ref)).max() > 1e-3  # the adapters matter
    assert all(module.merged is False for module in policy.modules() if hasattr(module, "merged"))


def test_merged_weights_give_the_adapter_models_logits():
    policy = lora_policy(modules_to_save=["lm_head"]).eval()
    with torch.no_grad():
        policy.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.01)
    merged = load_model(MODEL, dtype=torch.float64, seed=99).eval()  # other weights: all are replaced
    for model in (policy, merged):  # a plain causal forward: no tree inputs
        model.config._attn_implementation = "sdpa"
    missing = merged.load_state_dict(merged_state_dict(policy, policy.state_dict()), strict=False)
    assert not missing.missing_keys and not missing.unexpected_keys
    ids = torch.tensor([[5, 9, 17, 300, 2, 44]])
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"checkpoint": {"merge": True}}, "checkpoint.merge merges LoRA adapters"),
        ({"model": {"lora": {"rank": 4, "dropout": 0.1}}}, "objective.self_check: off"),
        ({"model": {"lora": {"rank": 4, "alpha": 0}}}, "model.lora: rank must be >= 0, alpha > 0"),
        ({"objective": {"self_check": "every:0"}}, "objective.self_check must be off, first or every:N"),
        (
            {"model": {"lora": {"rank": 4}}, "objective": {"kind": "grpo", "kl_coef": 0.1, "reference": MODEL}},
            "leave objective.reference empty",
        ),
    ],
)
def test_config_refusals_name_the_field(tmp_path, sections, message):
    import yaml

    config = {"model": {"source": MODEL}, "data": {"path": str(tmp_path / "d.jsonl")}}
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(path)


def test_lora_with_kl_and_zero_init_is_accepted(tmp_path):
    import yaml

    config = {
        "model": {"source": MODEL, "zero_init": True, "lora": {"rank": 2, "target_modules": ["q_proj", "v_proj"]}},
        "data": {"path": str(tmp_path / "d.jsonl")},
        "objective": {"kind": "grpo", "kl_coef": 0.1},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    assert load_config(path).model.lora.target_modules == ["q_proj", "v_proj"]


@pytest.mark.distributed
def test_two_rank_zero3_lora_grpo_trains_resumes_and_exports(tmp_path: Path, data) -> None:
    """GRPO with a KL term (reference: adapters disabled), activation checkpointing, 2 ranks, ZeRO-3:
    checkpoints hold adapters only; resuming step 1 repeats step 2 exactly; the adapter export loads
    with PEFT and the merged export with transformers, and both generate alike."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers.configs import write_config
    from tests.helpers.launch import launch_training

    config = write_config(
        tmp_path,
        Path(data),
        model={"lora": {"rank": 4, "alpha": 8}, "activation_checkpointing": True},
        packing={"budget": 64},
        objective={"kind": "grpo", "kl_coef": 0.1},
        optimizer={"lr": 3e-2, "schedule": "constant"},
        max_steps=2,
        checkpoint={"every": 1, "keep_last": 2, "export_hf": True, "merge": True},
    )
    import yaml

    values = yaml.safe_load(config.read_text())
    values["data"]["groups_per_step"] = 2  # of the 3 groups
    config.write_text(yaml.safe_dump(values))
    first = tmp_path / "run"
    process = launch_training(config)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    records = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["selfcheck/loss_rel_err"] < 1e-5 and "selfcheck/loss_rel_err" not in records[1]
    assert records[0]["selfcheck/max_grad_rel_err"] < 1e-5  # the RL objective's adapter gradients, ZeRO-3
    assert records[1]["rl/kl_ref"] > 0  # the adapters moved the policy off the base model

    states = torch.load(
        first / "checkpoints/step_0000002/zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False
    )
    assert states["module"] and all("lora_" in name for name in states["module"])  # no frozen base weight

    second = tmp_path / "resumed"
    shutil.copytree(first, second, ignore=shutil.ignore_patterns("adapter", "hf", "*.lock"))
    (second / "checkpoints/latest").write_text("step_0000001")
    process = launch_training(config, f"output_dir={second}", "checkpoint.export_hf=false", "checkpoint.merge=false")
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]
    assert "resumed from" in output
    resumed = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert resumed[-1]["step"] == 2 and resumed[-1]["loss/train"] == pytest.approx(records[1]["loss/train"], rel=1e-6)
    # the first run's self-check (after step 1's update) left step 2's gradient alone
    assert resumed[-1]["optim/grad_norm"] == pytest.approx(records[1]["optim/grad_norm"], rel=1e-5)

    base = load_model(MODEL, seed=3)
    base.config._attn_implementation, base.config.use_cache = "sdpa", True
    adapted = PeftModel.from_pretrained(base, first / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(first / "hf", local_files_only=True).eval()
    prompt = torch.tensor([[5, 9, 17, 300, 2, 44]])
    with torch.no_grad():
        assert torch.allclose(adapted(input_ids=prompt).logits, merged(input_ids=prompt).logits, atol=1e-5)
        greedy = dict(max_new_tokens=8, do_sample=False)
        assert torch.equal(adapted.generate(prompt, **greedy), merged.generate(prompt, **greedy))


def train_single_process(config: Path, *overrides: str) -> list[dict]:
    """``python -m ds_tree.train`` in one process (no launcher): its metrics.jsonl records."""
    import subprocess
    import sys

    import yaml

    from tests.helpers.launch import environment

    command = [sys.executable, "-m", "ds_tree.train", "--config", str(config), *overrides]
    result = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    named = dict(item.split("=", 1) for item in overrides)
    run = Path(named.get("output_dir") or yaml.safe_load(config.read_text())["output_dir"])
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_zero2_lora_trains_and_the_self_check_every_step_leaves_training_alone(tmp_path: Path, data) -> None:
    """ZeRO-2 with LoRA (single process): SFT with the self-check (gradients included) on every step
    gives the same losses and gradient norms, bit for bit, as the run without it."""
    from tests.helpers.configs import write_config

    config = write_config(
        tmp_path, Path(data), deepspeed=str(ROOT / "configs/ds/zero2.json"), model={"lora": {"rank": 4}},
        packing={"budget": 400}, optimizer={"lr": 3e-2, "schedule": "constant"}, max_steps=3,
    )  # fmt: skip
    one_group = "data.groups_per_step=1"
    checked = train_single_process(config, one_group, "objective.self_check=every:1", f"output_dir={tmp_path / 'c'}")
    plain = train_single_process(config, one_group, "objective.self_check=off", f"output_dir={tmp_path / 'p'}")
    assert [r["step"] for r in checked] == [1, 2, 3]
    for record in checked:
        assert record["selfcheck/max_grad_rel_err"] < 1e-5 and record["selfcheck/loss_rel_err"] < 1e-5, record
    assert not any(key.startswith("selfcheck/") for record in plain for key in record)
    for name in ("loss/train", "optim/grad_norm"):
        assert [r[name] for r in checked] == [r[name] for r in plain], name
    assert checked[0]["loss/train"] != checked[-1]["loss/train"]  # the adapters trained


@pytest.mark.slow
def test_zero_init_kl_lora_grpo_trains_with_the_rl_self_check(tmp_path: Path, data) -> None:
    """ZeRO-3 with the base built partitioned (model.zero_init), GRPO with a KL term whose reference is
    the policy with its adapters disabled, LoRA: trains (single process), the RL self-check passing on
    every step with the clipped objective and gradients."""
    from tests.helpers.configs import write_config

    config = write_config(
        tmp_path, Path(data), model={"lora": {"rank": 4, "alpha": 8}, "zero_init": True},
        packing={"budget": 400}, objective={"kind": "grpo", "kl_coef": 0.1, "self_check": "every:1"},
        optimizer={"lr": 3e-2, "schedule": "constant"}, max_steps=2,
    )  # fmt: skip
    records = train_single_process(config, "data.groups_per_step=2")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["selfcheck/max_grad_rel_err"] < 1e-5 and record["selfcheck/loss_rel_err"] < 1e-5, record
    assert records[1]["rl/kl_ref"] > 0 and np.isfinite(records[1]["loss/train"])
