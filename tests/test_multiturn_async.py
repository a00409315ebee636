"""Multi-turn rollouts sampled ahead of training (``rollout.max_staleness``, ``sync_every`` with
``rollout.env.path``; docs/ENVIRONMENTS.md, *Sampling ahead*): the background sampler passes over SFT
steps, syncs only the versions a sampled step uses, every environment is closed on every path (a stop
mid-episode included), and a 2-rank ZeRO-3 run records each turn's version, trains, resumes and its
saved episode trees verify tree == flat in float64."""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.config import ConfigError, load_config
from ds_tree.envs.secret_tool import LoudSecretToolEnv
from ds_tree.rollout.ahead import AheadSampler, sampling_version, version_used
from ds_tree.rollout.env import ToolEnvironment
from tests.helpers import ROOT
from tests.helpers.launch import resumed_runs
from tests.test_multiturn import CALL, TASK, ScriptedSampler, runner

MULTITURN_CPU = ROOT / "configs/multiturn_cpu.yaml"


# ------------------------------------------------------------------ the schedule with SFT steps between
def test_ahead_sampler_passes_over_steps_that_sample_nothing_and_syncs_only_used_versions() -> None:
    """Warm-up steps 0-2, then RL and SFT steps alternating (the example's shape), k = 1: each RL step is
    sampled once with the version one step behind it, synced as the SFT step before it starts."""
    start, end, k = 0, 9, 1

    def samples(step: int) -> bool:
        return step >= 3 and (step - 3) % 2 == 0  # RL steps 3, 5, 7

    needed = [v for v in range(start, end) if version_used(v, start, k, 1, end, samples)]
    assert needed == [2, 4, 6]  # the steps before each RL step: warm-up step 2, then the SFT steps
    engine = {"version": None}
    sampled = []

    def sample(step, version):
        assert version == engine["version"]  # never a sync while a step is sampled
        sampled.append((step, version))
        return [step]

    ahead = AheadSampler(sample, start=start, max_staleness=k, sync_every=1, end=end, samples=samples)
    try:
        for step in range(start, end):
            if step in needed:
                assert ahead.before_sync(step) is None
                engine["version"] = step
                ahead.synced(step)
            ahead.begin(step)
            if samples(step):
                taken, error = ahead.take(step)
                assert error is None and taken.results == [step]
                assert taken.version == sampling_version(step, start, k, 1) == step - 1
        time.sleep(0.2)  # room for a step past the end, were one allowed
    finally:
        ahead.close()
    assert sampled == [(3, 2), (5, 4), (7, 6)] and not ahead.thread.is_alive()


# ------------------------------------------------------------------ environments closed on every path
class Tracked(ToolEnvironment):
    """Records which instances are open: constructed or forked, until closed."""

    open: set[int] = set()
    made = 0
    fail_fork = False

    def __init__(self):
        self.tools = [self.get_secret]
        Tracked.open.add(id(self))
        Tracked.made += 1

    def get_secret(self) -> int:
        """Returns the secret."""
        return 7

    def reset(self, task):
        return [{"role": "user", "content": "what is the secret?"}]

    def reward(self, turn):
        return float(turn.text.strip() == "7")

    def fork(self):
        if Tracked.fail_fork:
            raise RuntimeError("no fork today")
        return Tracked()

    def close(self):
        Tracked.open.discard(id(self))


class FailingSampler(ScriptedSampler):
    def sample(self, prefix_ids, n, max_new_tokens, generator):
        if self.calls:
            raise RuntimeError("the engine went away")
        return super().sample(prefix_ids, n, max_new_tokens, generator)


class StoppingSampler(ScriptedSampler):
    """Sets the run's stop as its first turns come back (as ``close()`` from the trainer's thread would)."""

    def __init__(self, tokenizer, script, stopping):
        super().__init__(tokenizer, script)
        self.stopping = stopping

    def sample(self, prefix_ids, n, max_new_tokens, generator):
        self.stopping.set()
        return super().sample(prefix_ids, n, max_new_tokens, generator)


class Diverging(Tracked):
    """A replayed instance answers the recorded call differently: the replay fork fails."""

    def get_secret(self) -> int:
        """Returns the secret."""
        return Tracked.made


@pytest.mark.parametrize("path", ["done", "fork_fails", "engine_error", "stopped", "replay_diverges"])
def test_every_environment_is_closed_on_every_path(tokenizer, path: str) -> None:
    Tracked.open.clear()
    Tracked.made, Tracked.fail_fork = 0, path == "fork_fails"
    script = [CALL, "7"]
    if path == "engine_error":
        episode = runner(tokenizer, Tracked, sampler=FailingSampler(tokenizer, script))
    elif path == "stopped":
        episode = runner(tokenizer, Tracked, sampler=StoppingSampler(tokenizer, script, threading.Event()))
        episode.stopping = episode.sampler.stopping  # as MultiTurnRollouts.close() sets it from the trainer's thread
    elif path == "replay_diverges":
        episode = runner(tokenizer, Diverging, script, fork="replay")
    else:
        episode = runner(tokenizer, Tracked, script)
    if path in ("engine_error", "stopped"):
        with pytest.raises(
            RuntimeError, match="the engine went away" if path == "engine_error" else "sampling stopped"
        ):
            episode.run(TASK, "t", 0, 3, torch.Generator().manual_seed(0))
    else:
        tree = episode.run(TASK, "t", 0, 3, torch.Generator().manual_seed(0))
        assert (tree.counts["env_errors"] == 0) == (path == "done"), tree.counts
    assert Tracked.made >= (1 if path == "fork_fails" else 2), path  # forks were made where they can be
    assert Tracked.open == set(), path  # every environment made or forked is closed
    assert episode.open == {}


# ------------------------------------------------------------------ config
def test_multiturn_staleness_config_needs_the_importance_correction(tokenizer_dir, tmp_path: Path) -> None:
    """Accepted on the hf engine with an importance correction; the rollouts' close() stops the episode
    runner the background sampler uses, and episodes render with a tokenizer of their own (the trainer's
    thread renders demonstrations meanwhile)."""
    from types import SimpleNamespace

    from ds_tree.envs.secret_tool import tasks
    from ds_tree.models.loading import load_model
    from ds_tree.rollout.multiturn import MultiTurnRollouts
    from ds_tree.sampling.hf_engine import HFEngine

    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(task) + "\n" for task in tasks(4, 0)))
    base = [f"rollout.prompts={tmp_path / 'tasks.jsonl'}", f"model.tokenizer={tokenizer_dir}"]
    base += ["eval.prompts=", "eval.every_steps=0"]  # held-out tasks sample with the current weights: not ahead
    for overrides in (["objective.importance_truncation=2.0"], ["objective.old_logprobs=data"]):
        config = load_config(MULTITURN_CPU, [*base, "rollout.max_staleness=1", "rollout.sync_every=2", *overrides])
        assert (config.rollout.max_staleness, config.rollout.engine) == (1, "hf")  # hf: environments overlap
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=1 trains on .* up to 1 step\(s\) old"):
        load_config(MULTITURN_CPU, [*base, "rollout.max_staleness=1"])
    online = MultiTurnRollouts(config, SimpleNamespace(eos_token_id=2))
    model = load_model(str(ROOT / "configs/models/tiny_llama.json"), attention="torch", dtype=torch.float32)
    online.engine = HFEngine(model)
    episodes = online.episode_runner()
    assert online.renderer.tokenizer is not online.tokenizer and not episodes.stopping.is_set()
    online.close()  # what the trainer calls at the end of every run, preempted or not
    assert episodes.stopping.is_set()


# ------------------------------------------------------------------ 2 ranks, ZeRO-3: versions, resume, tree == flat
@pytest.mark.distributed
def test_two_ranks_sample_episodes_a_step_ahead_resume_and_verify_in_float64(tokenizer_dir, tmp_path: Path) -> None:
    """Steps 1 (warm-up SFT), 2 (RL), 3 (SFT refresh), 4 (RL) with max_staleness 1 on the hf engine: step 2's
    episodes are sampled with version 0 while step 1 trains, step 4's with version 2 while step 3 trains.
    A second trainer resumed from the step-2 checkpoint samples step 4 with version 2 as well: the same
    episode trees token for token. The saved trees pass float64 verify (tree == flat)."""
    from ds_tree.envs.secret_tool import tasks

    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(task) + "\n" for task in tasks(4, 0)))
    config = yaml_config(tmp_path, tokenizer_dir)
    first, resumed = resumed_runs(config, 2)
    records = {r["step"]: r for r in first["metrics"]}
    assert sorted(first["samples"]) == ["2", "4"] and sorted(resumed["samples"]) == ["4"]
    for step, version in ((2, 0), (4, 2)):
        assert records[step]["rollout/policy_version"] == version and records[step]["rollout/staleness_max"] == 1
        assert records[step]["rollout/stale_dropped"] == 0 and records[step]["rollout/wait_s"] >= 0
        assert records[step]["optim/grad_norm"] > 0 and np.isfinite(records[step]["loss/train"])
    for step in (1, 3):  # SFT steps: the weights the next RL step samples with are synced as they start
        assert "warmup/sft_loss" in records[step] and records[step]["rollout/sync_s"] > 0, records[step]
    assert records[2]["rollout/sync_s"] == records[4]["rollout/sync_s"] == 0  # none at the RL steps
    # resumed at step 2 (0-based: the SFT step 3 starts it): step 4 sampled with version 2 in both runs
    assert resumed["start_step"] == 2 and [r["step"] for r in resumed["metrics"]] == [3, 4]
    assert resumed["samples"]["4"] == first["samples"]["4"]
    again = {r["step"]: r for r in resumed["metrics"]}[4]
    assert again["rollout/policy_version"] == 2 and again["loss/train"] == records[4]["loss/train"]
    # every sampled token carries the version that sampled it; roots and observations are context
    saved = [json.loads(line) for line in (tmp_path / "run/rollouts/step_000004.jsonl").read_text().splitlines()]
    assert saved and all(record["stop_reason"] for record in saved)
    for record in saved:
        versions, mask = np.array(record["versions"]), np.array(record["loss_mask"])
        assert set(versions[mask == 1]) == {2} and set(versions[versions != 2]) <= {-1}
    # tree == flat in float64 on the saved episode trees, the GRPO objective with the sampler's log-probs
    from ds_tree.cli.verify import main as verify

    saved_path, model = tmp_path / "run/rollouts/step_000004.jsonl", ROOT / "configs/models/tiny_llama.json"
    code = verify(["--data", str(saved_path), "--model", str(model), "--objective", "grpo"])
    assert code == 0


class BranchScored(LoudSecretToolEnv):
    """The example's environment with a score that differs between forked siblings (each fork counts one
    more), so a random-init policy's leaves, which all run out of tokens, still get different rewards."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = 0

    def fork(self):
        forked = copy.deepcopy(self)
        forked.branch = self.branch + 1
        return forked

    def score(self, messages) -> float:
        return float(self.branch)


def yaml_config(tmp_path: Path, tokenizer_dir: Path) -> Path:
    import yaml

    config = yaml.safe_load(MULTITURN_CPU.read_text())
    config["model"].update(tokenizer=str(tokenizer_dir), seed=3)
    config["output_dir"] = str(tmp_path / "run")
    config["max_steps"] = 4
    config["deepspeed"] = str(ROOT / config["deepspeed"])
    config["model"]["source"] = str(ROOT / config["model"]["source"])
    config["rollout"].update(prompts=str(tmp_path / "tasks.jsonl"), prompts_per_step=2, width=4, max_staleness=1)
    config["rollout"]["env"].update(
        path="tests.test_multiturn_async:BranchScored", turn_branching=[2, 2], warmup_steps=1, refresh_every=2
    )
    config["objective"].update(kl_coef=0.0, reference_step=0, importance_truncation=2.0)
    config["optimizer"].update(warmup_steps=0)
    config["checkpoint"] = {"every": 2, "keep_last": 3, "export_hf": False}
    config.pop("eval")  # held-out tasks sample with the current weights: not with max_staleness 1
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
