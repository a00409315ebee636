"""gpu-check's section "the real trainer" (ds_tree/gpu_check/trainer.py) in its smoke mode: 2 gloo
ranks on the CPU through launch/train.sh, SFT preempted by SIGTERM and resumed to the uninterrupted
run's losses, GRPO, the export in plain transformers; and a failing launch reported, not raised."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from ds_tree.gpu_check import trainer


@pytest.mark.distributed
@pytest.mark.slow
def test_smoke_trains_preempts_resumes_and_exports(tmp_path):
    result = trainer.trainer_check(tmp_path, smoke=True, progress=lambda message: None)
    assert result["passed"], result["errors"]
    json.dumps(result)  # JSON-able as it is
    sft = result["sft"]
    assert sft["resume_identical"] and sft["max_abs_loss_difference"] == 0.0, sft
    assert 0 < sft["resumed_from_step"] < sft["steps"] == len(sft["losses_resumed"])
    assert sft["self_check"]["steps"] == [1, 6] and sft["self_check"]["max_grad_rel_err"] < 1e-5
    assert [launch["exit_code"] for launch in result["launches"]] == [0, 75, 0, 0]
    grpo = result["grpo"]
    assert grpo["steps"] == trainer.SMOKE.grpo_steps and len(grpo["rl"]["rl/reward_mean"]) == grpo["steps"]
    assert result["export"]["loaded"] and result["export"]["finite_logits"]
    assert result["attention_engine"] == "torch"
    assert (tmp_path / "logs" / "sft_preempted.log").read_text().count("stopped by SIGTERM after step") == 1


def test_a_failing_launch_is_reported_with_its_log(tmp_path, monkeypatch):
    # A budget below every trajectory is a config error; the dry run finds it without starting ranks.
    monkeypatch.setattr(trainer, "SMOKE", dataclasses.replace(trainer.SMOKE, budget=8))
    monkeypatch.setenv("DRY_RUN", "1")
    result = trainer.trainer_check(tmp_path, smoke=True, progress=lambda message: None)
    assert not result["passed"] and result["launches"] == []
    [error] = result["errors"]
    assert error.startswith("sft_uninterrupted: exit code 2, expected 0;"), error
    assert "packing.budget (8) is below the longest trajectory" in error
    assert (tmp_path / "logs" / "sft_uninterrupted.log").is_file()


def test_a_launch_past_its_timeout_is_killed_with_its_ranks(tmp_path, monkeypatch):
    import psutil

    killed = []

    def kill_tree(process):  # what the kill reaches: the launcher runs in a session of its own
        killed.extend(" ".join(p.cmdline()) for p in psutil.Process(process.pid).children(recursive=True))
        original(process)

    original = trainer.kill_tree
    monkeypatch.setattr(trainer, "kill_tree", kill_tree)
    monkeypatch.setattr(trainer, "SMOKE", dataclasses.replace(trainer.SMOKE, timeout_s=6))
    result = trainer.trainer_check(tmp_path, smoke=True, progress=lambda message: None)
    assert not result["passed"]
    [error] = result["errors"]
    assert error.startswith("sft_uninterrupted: ran past its 6 s timeout and was killed;"), error
    assert any("deepspeed" in command for command in killed), killed
    time.sleep(1)  # SIGKILL is asynchronous
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not left, left
