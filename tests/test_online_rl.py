"""Online RL (rollout.enabled): config checks, the prompt source, the rollout metrics, and a 2-rank
run that samples, trains and resumes from a checkpoint to the same next-step samples, rewards and loss."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from ds_tree.config import ConfigError, load_config
from ds_tree.envs import digit_parity, game24
from ds_tree.errors import DataError
from ds_tree.registries import REWARDS
from ds_tree.rollout.loop import rank_slots, slot_generator
from ds_tree.rollout.online import SlotFigures, SlotResult, kept_trajectories, rollout_scalars
from ds_tree.rollout.rewards import RewardRequest, exact_match_reward
from ds_tree.sampling.prompts import read_prompts
from ds_tree.trees.trajectory import Trajectory
from tests.helpers import ROOT
from tests.helpers.configs import PARITY, online_config, without_data, write_config
from tests.helpers.data import write_prompts
from tests.helpers.launch import resumed_runs, torchrun
from tests.helpers.runs import dry_run

ROLLOUT_KEYS = {
    "rollout/reward_mean",
    "rollout/leaves",
    "rollout/depth",
    "rollout/por",
    "rollout/sampled_tokens",
    "rollout/forward_tokens",
    "rollout/tokens_saved",
    "rollout/reward_failures",
    "rollout/time_s",
}


# ------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "override, message",
    [
        (
            "rollout.reward=nope",
            r"unknown reward 'nope' \(rollout.reward\); choose one of game24, exact_match or 'packa",
        ),
        ("rollout.reward=ds_tree.nowhere:f", r"rollout.reward 'ds_tree.nowhere:f' cannot be imported"),
        ("rollout.prompts=", r"rollout.prompts is required with rollout.enabled"),
        ("rollout.width=5", r"rollout: sampler width 5 exceeds branching\*\*max_depth"),
        ("rollout.logprob_floor=0.5", r"rollout.logprob_floor must be <= 0 \(0: off\), got 0.5"),
        ("rollout.prompts_per_step=0", r"rollout.prompts_per_step must be >= 1, got 0"),
        ("data.path=somewhere.jsonl", r"data.path must be empty with rollout.enabled"),
        # the config's RL options are refused with kind sft first (config.objective_strays)
        ("objective.kind=sft", r"objective.normalise_advantages, objective.eps_high: only with objective.kind grpo"),
        ("objective.mini_batches=3", r"objective.mini_batches \(3\) is more than rollout.prompts_per_step \(2\)"),
        ("model.tokenizer=", r"rollout.enabled needs model.tokenizer"),
    ],
)
def test_rollout_config_errors_name_the_key(tmp_path: Path, override: str, message: str) -> None:
    config = online_config(tmp_path, tmp_path / "tokenizer")
    assert load_config(config).rollout.enabled
    with pytest.raises(ConfigError, match=rf"config.yaml: {message}"):
        load_config(config, [override])


def test_without_rollout_data_path_is_required(tmp_path: Path) -> None:
    config = without_data(write_config(tmp_path, Path("")))
    with pytest.raises(ConfigError, match="config.yaml: data.path is required"):
        load_config(config)


def test_dry_run_names_a_missing_prompts_file_and_tokenizer(monkeypatch, capsys, tmp_path, tokenizer_dir) -> None:
    config = online_config(tmp_path, tokenizer_dir)
    assert dry_run(monkeypatch, capsys, config)[0] == 0
    shipped = ROOT / "configs/online_parity_cpu.yaml"  # the demo's config and prompts
    assert dry_run(monkeypatch, capsys, shipped, f"model.tokenizer={tokenizer_dir}", f"output_dir={tmp_path}")[0] == 0
    absent = tmp_path / "absent.jsonl"
    code, err = dry_run(monkeypatch, capsys, config, f"rollout.prompts={absent}")
    assert code == 2 and f"config error: rollout.prompts: {absent}: no such file" in err, err
    code, err = dry_run(monkeypatch, capsys, config, f"model.tokenizer={tmp_path}")
    assert code == 2 and f"config error: model.tokenizer: {tmp_path}: not a loadable tokenizer directory" in err, err
    code, err = dry_run(monkeypatch, capsys, config, "packing.budget=8")
    assert code == 2 and "packing.budget (8) is below the longest prompt" in err, err


# ------------------------------------------------------------ prompt source
def test_prompts_from_text_and_ids(tmp_path: Path, tokenizer) -> None:
    prompts = read_prompts(write_prompts(tmp_path / "prompts.jsonl"), tokenizer, vocab_size=1024)
    assert [p.metadata["parity"] for p in prompts] == ["even", "odd", "even", "odd"]
    assert prompts[0].ids.tolist() == tokenizer.encode("Write even digits:", add_special_tokens=False)
    assert prompts[0].text == "Write even digits:" and prompts[0].source.endswith("prompts.jsonl:1")
    assert prompts[3].ids.tolist() == [300, 301, 302] and prompts[3].text == tokenizer.decode([300, 301, 302])
    assert [p.label for p in prompts] == ["prompt-0", "prompt-1", "prompt-2", "prompt-3"]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"group_id": "q7", "messages": [{"role": "user", "content": "odd:"}]}) + "\n")
    (prompt,) = read_prompts(chat, tokenizer, vocab_size=1024)
    assert prompt.text == "<|im_start|>user\nodd:<|im_end|>\n<|im_start|>assistant\n" and prompt.label == "q7"
    assert prompt.metadata == {} and prompt.ids.tolist() == tokenizer.encode(prompt.text, add_special_tokens=False)


@pytest.mark.parametrize(
    "line, message",
    [
        ({"metadata": {}}, "a prompt line needs exactly one of 'prompt', 'messages', 'prompt_ids'"),
        ({"prompt": "a", "prompt_ids": [5]}, "a prompt line needs exactly one of"),
        ({"prompt_ids": [5, 2000]}, "prompt token id 2000 is >= the model's vocab size 1024"),
        ({"prompt_ids": []}, "'prompt_ids' must be a non-empty list of token ids"),
        ({"prompt": "a", "metadata": [1]}, "'metadata' must be an object"),
        ({"prompt": "a", "answer": "b"}, "unknown key 'answer'"),
    ],
)
def test_bad_prompt_lines_name_file_and_line(tmp_path: Path, tokenizer, line: dict, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(DataError, match=rf"prompts.jsonl:2: {message}"):
        read_prompts(path, tokenizer, vocab_size=1024)


def test_slots_and_generators_depend_on_seed_step_and_slot_only() -> None:
    assert sorted(rank_slots(5, 0, 2) + rank_slots(5, 1, 2)) == [0, 1, 2, 3, 4]
    assert rank_slots(5, 1, 2) == [1, 3]

    def draw(seed, step, slot):
        return slot_generator(seed, step, slot).initial_seed()

    assert draw(0, 3, 1) == draw(0, 3, 1)
    assert len({draw(0, 3, 1), draw(0, 4, 1), draw(0, 3, 2), draw(1, 3, 1)}) == 4


def test_engine_capabilities_decide_what_a_config_may_ask(tmp_path, tokenizer_dir) -> None:
    """A registered sampling engine is a config choice; what it declares it cannot do is refused, with its
    reason and the engines that can (no engine name is compared anywhere)."""
    from ds_tree.registries import SAMPLING_ENGINES
    from ds_tree.sampling.hf_engine import HFEngine

    class TextOnly(HFEngine):
        logprobs = False
        why_not = {"logprobs": "it returns text only"}

    SAMPLING_ENGINES.register("test_text_only", TextOnly)
    try:
        path = online_config(tmp_path, tokenizer_dir)
        assert load_config(path, ["rollout.engine=test_text_only"]).rollout.engine == "test_text_only"
        message = r"rollout.engine: test_text_only returns none: it returns text only; use rollout.engine: hf or vllm$"
        with pytest.raises(ConfigError, match=message):
            load_config(path, ["rollout.engine=test_text_only", "objective.old_logprobs=data"])
    finally:
        SAMPLING_ENGINES.unregister("test_text_only")


def test_hf_engine_builds_a_generation_copy_and_syncs_the_policy_into_it(tmp_path, tokenizer_dir) -> None:
    """The hf engine of a run: the policy's architecture with its own weights, frozen and in eval mode; each
    sync copies the policy's current weights in exactly and counts the version."""
    import torch

    from ds_tree.models.loading import load_config as load_model_config
    from ds_tree.models.loading import load_model
    from ds_tree.registries import SAMPLING_ENGINES

    config = load_config(online_config(tmp_path, tokenizer_dir))
    engine = SAMPLING_ENGINES.get("hf").for_run(config, load_model_config(config.model.source), None)
    policy = load_model(config.model.source, dtype="float32", seed=1)
    pairs = list(zip(policy.parameters(), engine.model.parameters(), strict=True))
    assert not engine.model.training and not any(p.requires_grad for _, p in pairs)
    assert not all(torch.equal(a, b) for a, b in pairs)
    for version in (1, 2):
        with torch.no_grad():
            next(policy.parameters()).add_(1.0)  # an optimizer step
        assert engine.sync_weights(policy) >= 0 and engine.version == version
        assert all(torch.equal(a, b) for a, b in pairs) and engine.generator_device == torch.device("cpu")
    engine.close()


def test_reward_functions_by_name_or_import_path() -> None:
    assert REWARDS.get("exact_match") is exact_match_reward
    assert REWARDS.get("game24") is game24.reward
    assert REWARDS.get(PARITY) is digit_parity.reward
    request = RewardRequest(prompt="even:", completion=" 24 8x", metadata={"parity": "even"})
    assert digit_parity.reward(request) == pytest.approx(3 / 4)
    assert digit_parity.reward(RewardRequest("odd:", " ", {"parity": "odd"})) == 0.0
    with pytest.raises(ValueError, match="metadata\\['parity'\\]"):
        digit_parity.reward(RewardRequest("?", "1", {}))


def test_parity_preference_records_prefer_the_asked_parity() -> None:
    """Each record's chosen answer scores 1 under the task's reward and its rejected one 0, as many digits each;
    the same seed gives the same records, another seed others; a prompt without a parity is refused."""
    prompts = [{"prompt": "even:", "metadata": {"parity": "even"}}, {"prompt": "odd:", "metadata": {"parity": "odd"}}]
    records = digit_parity.preference_records(prompts, pairs_per_prompt=3, seed=7)
    assert [r["prompt"] for r in records] == ["even:"] * 3 + ["odd:"] * 3
    for record, prompt in zip(records, [prompts[0]] * 3 + [prompts[1]] * 3, strict=True):
        score = {
            side: digit_parity.reward(RewardRequest(prompt["prompt"], record[side], prompt["metadata"]))
            for side in ("chosen", "rejected")
        }
        assert score == {"chosen": 1.0, "rejected": 0.0}
        assert len(record["chosen"].split()) == len(record["rejected"].split()) in range(3, 9)
    assert records == digit_parity.preference_records(prompts, pairs_per_prompt=3, seed=7)
    assert records != digit_parity.preference_records(prompts, pairs_per_prompt=3, seed=8)
    with pytest.raises(ValueError, match="metadata\\['parity'\\]"):
        digit_parity.preference_records([{"prompt": "?", "metadata": {"parity": "both"}}], pairs_per_prompt=1)


# ------------------------------------------------------------------ metrics
def trajectory(prompt: int, completion: int, reward: float | None, source: str) -> Trajectory:
    ids = np.arange(prompt + completion) + 5
    mask = np.r_[np.zeros(prompt), np.ones(completion)]
    return Trajectory(ids, mask, group_id=source, reward=reward, source=source)


def test_rollout_scalars_and_dropped_trajectories(caplog) -> None:
    # Slot 0: a prompt of 3 tokens, two leaves of 4 completion tokens sharing 2 (6 sampled, 9 forwarded).
    # Slot 1: a prompt of 2 tokens, three leaves of 5 (independent: 15 sampled), one reward failed.
    slot0 = SlotResult(0, [trajectory(3, 4, 1.0, "a0"), trajectory(3, 4, 0.0, "a1")], 3, 2, 1, 6, 9)
    leaves1 = [trajectory(2, 5, 0.5, "b0"), trajectory(2, 5, None, "b1"), trajectory(2, 5, 0.0, "b2")]
    slot1 = SlotResult(1, leaves1, 2, 3, 1, 15, 17, failures=["b1 failed"])
    scalars = rollout_scalars([SlotFigures.of(slot1), SlotFigures.of(slot0)])  # a slot's figures: no tokens
    assert scalars == {
        "rollout/reward_mean": pytest.approx(1.5 / 4),
        "rollout/leaves": 2.5,
        "rollout/depth": 1.0,
        "rollout/por": pytest.approx(1 - (3 + 6 + 2 + 15) / (2 * 7 + 3 * 7)),
        "rollout/sampled_tokens": 21.0,
        "rollout/forward_tokens": 26.0,
        "rollout/tokens_saved": 2.0,  # 8 + 15 completion tokens for 6 + 15 sampled
        "rollout/reward_failures": 1.0,
    }
    logger = logging.getLogger("ds_tree.rollout.online")
    logger.addHandler(caplog.handler)  # the ds_tree console set-up stops propagation
    try:
        kept = kept_trajectories([slot1, slot0])
    finally:
        logger.removeHandler(caplog.handler)
    assert [t.source for t in kept] == ["a0", "a1", "b0", "b2"]  # slot order
    assert "1 trajectories without a reward (the reward function failed) are dropped: b1" in caplog.text


# -------------------------------------------------------- 2 ranks, resumed
@pytest.mark.distributed
def test_two_ranks_sample_train_and_resume_to_the_same_next_step(tmp_path: Path, tokenizer_dir: Path) -> None:
    config = online_config(
        tmp_path,
        tokenizer_dir,
        max_steps=3,
        # the KL reference is the policy after step 1 (objective.reference_step): copied, checkpointed, resumed
        objective={
            "kind": "grpo",
            "normalise_advantages": True,
            "mini_batches": 2,
            "kl_coef": 0.01,
            "reference_step": 1,
        },  # fmt: skip
        optimizer={"lr": 2e-2, "schedule": "constant"},
        checkpoint={"every": 2, "keep_last": 3, "export_hf": False},
    )
    first, resumed = resumed_runs(config, 2)
    assert first["start_step"] == 0 and resumed["start_step"] == 2
    assert sorted(first["samples"]) == ["1", "2", "3"] and sorted(resumed["samples"]) == ["3"]
    # The resumed run samples exactly what the uninterrupted one did at step 3: tokens and rewards.
    assert resumed["samples"]["3"] == first["samples"]["3"]
    assert first["samples"]["3"] != first["samples"]["2"]
    records = {r["step"]: r for r in first["metrics"]}
    assert [r["step"] for r in resumed["metrics"]] == [3]
    again = resumed["metrics"][0]
    for key in (ROLLOUT_KEYS - {"rollout/time_s"}) | {"loss/train", "optim/grad_norm", "rl/reward_mean", "rl/kl_ref"}:
        assert again[key] == records[3][key], key
    for record in records.values():
        assert ROLLOUT_KEYS <= set(record) and all(math.isfinite(record[key]) for key in ROLLOUT_KEYS), record
        assert record["rollout/leaves"] == 4 and record["rollout/reward_failures"] == 0
        assert record["rollout/sampled_tokens"] > 0 and record["rollout/tokens_saved"] > 0  # a tree, not 4 paths
        assert record["rollout/reward_mean"] == record["rl/reward_mean"]
        assert record["optim/grad_norm"] > 0  # trained
    assert records[3]["rl/kl_ref"] > 0  # the policy moved
    # the reference: the initial policy, then the policy after step 1 (copied as step 2 starts), then kept:
    # the resumed run loaded it from the checkpoint (reference_policy.pt), so steps 3 match (above)
    gaps = first["reference_gaps"]
    assert gaps["1"] == 0 and gaps["2"] == 0 and gaps["3"] > 1e-3, gaps
    assert resumed["reference_gaps"] == {"3": gaps["3"]}
    assert (tmp_path / "run/checkpoints/step_0000002/reference_policy.pt").is_file()


@pytest.mark.distributed
def test_online_rl_under_sequence_parallelism_trains_on_sampler_logprobs(tmp_path: Path, tokenizer_dir: Path) -> None:
    """2 ranks, one sequence-parallel group (S = 2), ``old_logprobs: data``: prompts of 10 tokens and
    completions of up to 6 over a budget of 12, so sampled trees go to sharded rows (the online path
    limit is budget x S). Each step takes one update on trajectories sampled from the current weights,
    so the ratio of the trainer's log-probs (computed on the shards) to the sampler's recorded ones is
    1 to float32 round-off: the sampler's log-probs reach every shard aligned with their tokens."""
    prompts = tmp_path / "long_prompts.jsonl"
    lines = [{"prompt_ids": list(range(300 + 10 * i, 310 + 10 * i)), "metadata": {"parity": "even"}} for i in range(4)]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = online_config(
        tmp_path,
        tokenizer_dir,
        max_steps=2,
        rollout={"prompts": str(prompts)},
        objective={"kind": "grpo", "normalise_advantages": True, "old_logprobs": "data"},
        packing={"budget": 12, "over_budget": "sequence_parallel"},
        parallel={"sequence_parallel_size": 2},
        optimizer={"lr": 2e-2, "schedule": "constant"},
    )
    out = tmp_path / "online_sp.json"
    torchrun("tests/distributed/online_sp_check.py", "--config", str(config), "--out", str(out))
    report = json.loads(out.read_text())
    assert sorted(report["steps"]) == ["1", "2"]
    for step in report["steps"].values():
        assert step["with_logprobs"] and step["longest"] > 12 and step["shards"] >= 2, step
    first = report["metrics"][0]  # its self-check: the sampled trees sharded over the group, as the step shards them
    assert first["selfcheck/shard_items"] >= 1 and first["selfcheck/max_grad_rel_err"] < 1e-5, first
    assert first["selfcheck/loss_rel_err"] < 1e-5 and first["selfcheck/max_abs_logprob_err"] < 1e-5, first
    for record in report["metrics"]:
        assert math.isfinite(record["loss/train"]) and record["optim/grad_norm"] > 0, record
        assert abs(record["rl/ratio_max"] - 1) < 1e-5 and abs(record["rl/ratio_mean"] - 1) < 1e-5, record
        assert record["rl/clip_frac_low"] == 0 and record["rl/clip_frac_high"] == 0, record


# ------------------------------------------------------------------- plot
def write_metrics(directory: Path, rewards: list[float], forward: int) -> Path:
    directory.mkdir(parents=True)
    lines = [
        {
            "step": step,
            "rollout/reward_mean": r,
            "rollout/sampled_tokens": forward - 2,
            "rollout/forward_tokens": forward,
        }
        for step, r in enumerate(rewards, start=1)
    ]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return directory


def test_plot_online_averages_seeds_and_names_bad_runs(tmp_path: Path, capsys) -> None:
    from ds_tree.cli.plot_online import main

    seed0 = write_metrics(tmp_path / "tree0", [0.0, 0.2, 0.4, 0.6], forward=10)
    seed1 = write_metrics(tmp_path / "tree1", [0.2, 0.4, 0.6, 0.8], forward=12)
    independent = write_metrics(tmp_path / "independent", [0.1, 0.1, 0.2, 0.2], forward=20)
    output = tmp_path / "curves.png"
    assert main([f"tree={seed0},{seed1}", f"independent={independent}", "--output", str(output), "--window", "2"]) == 0
    table = capsys.readouterr().out
    assert "| tree | 2 | 4 | 0.200 | 0.600 | 36 | 44 |" in table, table  # per-run means: 4 x 9 and 4 x 11
    assert "| independent | 1 | 4 | 0.100 | 0.200 | 72 | 80 |" in table, table
    assert output.stat().st_size > 0
    assert main([f"x={tmp_path / 'absent'}", "--output", str(output)]) == 2
    assert f"{tmp_path / 'absent' / 'metrics.jsonl'}: no such file" in capsys.readouterr().err
    short = write_metrics(tmp_path / "short", [0.5], forward=1)
    assert main([f"tree={seed0},{short}", "--output", str(output)]) == 2
    assert "tree: the runs do not have the same steps" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["online_parity.sh", "distill_parity.sh", "dpo_parity.sh"])
def test_demo_script_parses_and_is_shellcheck_clean(name: str) -> None:
    import subprocess

    from tests.helpers.launch import find_shellcheck

    script = ROOT / "launch" / name
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    shellcheck = find_shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck is not installed")
    lint = subprocess.run([shellcheck, str(script)], capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout
