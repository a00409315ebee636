"""Evaluation (docs/EVAL.md): pass@k against brute force, the eval scalars, the held-out loss against the flat
baseline in float64, the config's checks, the best checkpoint through rotation and a resume, ``ds-tree eval``;
and, with 2 ranks, runs with an eval section that train exactly as without it, split the tasks without losing
or repeating one, and keep the best checkpoint across rotation and a resume."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ds_tree.cli import main as cli_main
from ds_tree.config import ConfigError, load_config
from ds_tree.data import load_trajectories
from ds_tree.data.tree_dataset import save_tree_dataset
from ds_tree.engine.layout import StepLayout
from ds_tree.engine.runners import RunContext
from ds_tree.errors import DataError
from ds_tree.evaluation.evaluator import in_task_order, preserved_random_state
from ds_tree.evaluation.heldout import LossRun, heldout_loss
from ds_tree.evaluation.scores import TaskOutcome, pass_at_k, tagged_scalars
from ds_tree.evaluation.tasks import eval_generator
from ds_tree.losses.sft import Normalisers
from ds_tree.models.loading import load_model
from ds_tree.objectives.sft import run_rows
from ds_tree.packing.modes import pack_trajectories
from ds_tree.rollout.loop import slot_generator
from ds_tree.run import checkpoint
from ds_tree.run.best import BEST, BestCheckpoint
from ds_tree.sampling.prompts import read_prompts
from tests.helpers import ROOT
from tests.helpers.configs import online_config, write_config
from tests.helpers.data import write_forest
from tests.helpers.launch import torchrun
from tests.helpers.processes import one_rank_group
from tests.helpers.runs import dry_run, prepare

TINY = ROOT / "configs/models/tiny_llama.json"


@pytest.fixture(name="one_rank_group")
def one_rank_group_fixture():
    """A 1-rank gloo process group in this process (the evaluation's all-reduces)."""
    with one_rank_group():
        yield


# ------------------------------------------------------------------- pass@k
def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (c of them successes) that hold a success."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(sample < c for sample in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_success(n: int) -> None:
    for c, k in itertools.product(range(n + 1), range(1, n + 1)):
        assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
    assert pass_at_k(n, 0, 1) == 0.0 and pass_at_k(n, n, 1) == 1.0
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, 0, n + 1)


def test_pass_at_k_of_many_samples_needs_no_huge_binomials() -> None:
    assert pass_at_k(1000, 1, 1) == pytest.approx(1e-3)
    assert pass_at_k(1000, 10, 100) == pytest.approx(1 - math.comb(990, 100) / math.comb(1000, 100), rel=1e-9)


def test_eval_scalars_per_tag_with_lost_samples() -> None:
    outcomes = [
        TaskOutcome(0, "a", "even", [1.0, 0.0, 1.0, None]),  # one lost sample: a failure, out of the mean
        TaskOutcome(1, "b", "odd", [0.0, 0.0, 0.5, 0.25]),
        TaskOutcome(2, "c", "even", [1.0, 1.0, 1.0, 1.0]),
    ]
    scalars = tagged_scalars(outcomes, k=2, threshold=1.0)
    assert scalars["eval/reward_mean"] == pytest.approx(np.mean([1, 0, 1, 0, 0, 0.5, 0.25, 1, 1, 1, 1]))
    assert scalars["eval/pass@1"] == pytest.approx((2 / 4 + 0 + 1) / 3)
    assert scalars["eval/pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + 0 + 1) / 3)
    assert scalars["eval/lost_samples"] == 1 and scalars["eval/tasks"] == 3
    assert scalars["eval/even/pass@1"] == pytest.approx((2 / 4 + 1) / 2) and scalars["eval/even/tasks"] == 2
    assert scalars["eval/odd/reward_mean"] == pytest.approx(0.1875) and scalars["eval/odd/pass@2"] == 0
    assert tagged_scalars(outcomes, k=2, threshold=0.5)["eval/odd/pass@1"] == pytest.approx(1 / 4)


def test_tasks_gathered_in_order_each_once() -> None:
    outcomes = [TaskOutcome(index, str(index), "", [1.0]) for index in (2, 0, 1)]
    assert [o.index for o in in_task_order(outcomes, 3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match=r"missing \[2\], twice \[1\]"):
        in_task_order([TaskOutcome(i, "", "", []) for i in (0, 1, 1)], 3)


def test_eval_generators_are_their_own_streams() -> None:
    draw = lambda generator: torch.randint(0, 2**31, (4,), generator=generator).tolist()  # noqa: E731
    assert draw(eval_generator(0, 5, 2)) == draw(eval_generator(0, 5, 2))
    assert draw(eval_generator(0, 5, 2)) != draw(eval_generator(0, 5, 3)) != draw(eval_generator(0, 6, 2))
    assert draw(eval_generator(0, 5, 2)) != draw(slot_generator(0, 5, 2))  # never a training slot's
    torch.manual_seed(1)
    before = torch.rand(3)
    torch.manual_seed(1)
    with preserved_random_state():
        torch.rand(100), np.random.rand(5)
    assert torch.equal(torch.rand(3), before)


# ------------------------------------------------------------------- held-out loss
@pytest.mark.parametrize("normalisation", ["token_mean", "sequence_mean", "sum"])
def test_heldout_loss_equals_the_flat_baseline_in_float64(tmp_path, one_rank_group, normalisation) -> None:
    """The tree-packed held-out loss, a tree split over rows and walked trees all give the flat objective."""
    data = write_forest(tmp_path / "heldout.jsonl", groups=4, seed=5)
    trajectories = load_trajectories(data)
    model = load_model(TINY, attention="reference", dtype=torch.float64, seed=1).eval()
    flat_rows = pack_trajectories(trajectories, "flat", max(len(t) for t in trajectories))
    with torch.no_grad():
        flat = run_rows(model, flat_rows, Normalisers.from_rows(flat_rows), normalisation).loss
    longest = max(len(t) for t in trajectories)
    layouts = {
        "tree": [],
        "tree, split parts": [f"packing.budget={longest + 20}"],
        "dfs": ["packing.mode=dfs", "packing.dfs_chunk=37"],
    }
    for name, overrides in layouts.items():
        path = write_config(tmp_path, data, objective={"normalisation": normalisation})
        config = load_config(path, ["packing.budget=2048", *overrides])
        layout = StepLayout(config, {}, 0, 1)
        plan = lambda batch, layout=layout: layout.plan(batch, 0)  # noqa: E731
        run = LossRun(model, plan, RunContext("cpu", 0, layout.dfs_settings()))
        loss = heldout_loss(run, run.plan(trajectories).rows, normalisation, "exact")
        assert loss == pytest.approx(flat, rel=1e-10), name


# ------------------------------------------------------------------- config checks
@pytest.mark.parametrize(
    ("section", "overrides", "message"),
    [
        ({"data": "DATA", "samples": 0}, [], "eval.samples must be >= 1"),
        ({"every_steps": 5}, [], r"eval.every_steps: only with eval.data or eval.prompts"),
        ({"data": "DATA", "temperature": 0.5}, [], r"eval.temperature: only with eval.prompts"),
        ({"data": "DATA", "samples": 2, "pass_k": 3}, [], r"eval.pass_k must be in \[1, eval.samples\]"),
        ({"prompts": "DATA"}, [], "eval.prompts needs rollout.enabled"),
        ({"data": "DATA"}, ["checkpoint.keep_best=eval/reward_mean"], "no evaluation produces 'eval/reward_mean'"),
        ({}, ["checkpoint.keep_best=eval/loss"], r"checkpoint.keep_best \(eval/loss\) needs an eval section"),
        ({"data": "DATA", "every_steps": 4}, ["checkpoint.keep_best=eval/loss", "checkpoint.every=6"], "multiple"),
        ({"data": "DATA"}, ["checkpoint.best_mode=max"], "checkpoint.best_mode .* is keep_best's"),
    ],
)
def test_eval_config_errors_name_the_field(tmp_path, section, overrides, message) -> None:
    data = write_forest(tmp_path / "data.jsonl")
    section = {key: str(data) if value == "DATA" else value for key, value in section.items()}
    with pytest.raises(ConfigError, match=message):
        load_config(write_config(tmp_path, data, eval=section), overrides)


def test_eval_prompts_need_the_current_weights_in_the_engine(tmp_path, tokenizer_dir) -> None:
    prompts = tmp_path / "held_out.jsonl"
    prompts.write_text(json.dumps({"prompt": "odd:", "metadata": {"parity": "odd"}}) + "\n")
    config = online_config(tmp_path, tokenizer_dir, eval={"prompts": str(prompts)})
    with pytest.raises(ConfigError, match=r"rollout.sync_every \(2\) keep older"):
        load_config(config, ["rollout.sync_every=2", "objective.old_logprobs=data"])
    assert load_config(config).eval.metrics() == ["eval/reward_mean", "eval/pass@1", "eval/pass@4"]
    assert load_config(config, ["eval.pass_k=1"]).eval.metrics() == ["eval/reward_mean", "eval/pass@1"]


def test_eval_data_of_another_tokenizer_is_refused(tmp_path, tokenizer_dir) -> None:
    data = write_forest(tmp_path / "data.jsonl")
    other = tmp_path / "other_tokenizer_dataset"
    identity = {"name_or_path": "someone/else", "vocab_size": 1024, "serialised_sha256": "f" * 64}
    save_tree_dataset(load_trajectories(data), other, {"tokenizer": identity})
    config = write_config(tmp_path, data, model={"tokenizer": str(tokenizer_dir)}, eval={"data": str(other)})
    with pytest.raises(ConfigError, match=r"eval.data .* with the tokenizer 'someone/else' .*model.tokenizer"):
        prepare(config)


def test_eval_data_with_a_path_over_the_row_budget_is_refused_unless_dfs_walks_it(tmp_path) -> None:
    """Held-out paths obey the training data's rule (packing.budget), named at eval.data; dfs walks any length."""
    data = write_forest(tmp_path / "data.jsonl")  # paths of at most 179 tokens
    heldout = tmp_path / "heldout.jsonl"
    record = {"group_id": "long", "input_ids": list(range(3, 303)), "loss_mask": [0] * 10 + [1] * 290}
    heldout.write_text(json.dumps(record) + "\n")
    config = write_config(tmp_path, data, eval={"data": str(heldout)})
    with pytest.raises(ConfigError, match=r"eval.data: .* has 300 tokens, more than packing.budget \(256\)"):
        prepare(config, "packing.budget=256")
    assert prepare(config, "packing.budget=256", "packing.mode=dfs").evaluator is not None


def test_dry_run_checks_the_eval_section(monkeypatch, capsys, tmp_path, tokenizer_dir) -> None:
    data = write_forest(tmp_path / "data.jsonl")
    config = write_config(tmp_path, data, eval={"data": str(tmp_path / "missing.jsonl")})
    code, err = dry_run(monkeypatch, capsys, config)
    assert code == 2 and "eval.data:" in err and "missing.jsonl" in err
    prompts = tmp_path / "held_out.jsonl"
    prompts.write_text(json.dumps({"prompt": "odd:", "metadata": {"parity": "odd"}, "tag": "a/b"}) + "\n")
    online = online_config(tmp_path, tokenizer_dir, eval={"prompts": str(prompts)})
    code, err = dry_run(monkeypatch, capsys, online)
    assert code == 2 and "eval.prompts:" in err and "held_out.jsonl:1: 'tag' must be" in err
    prompts.write_text(json.dumps({"prompt": "odd:", "metadata": {"parity": "odd"}, "tag": "odd"}) + "\n")
    code, err = dry_run(monkeypatch, capsys, online, "checkpoint.keep_best=eval/even/pass@1")
    assert code == 2 and "no evaluation produces 'eval/even/pass@1'" in err and "eval/odd/pass@1" in err
    code, err = dry_run(monkeypatch, capsys, online, "checkpoint.keep_best=eval/odd/pass@1")
    assert code == 0, err


def test_an_environment_that_cannot_load_is_a_config_error(tmp_path, tokenizer_dir) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"secret": 3}) + "\n")
    config = online_config(
        tmp_path, tokenizer_dir, rollout={"prompts": str(tasks), "reward": "", "env": {"path": "no_such.module:Env"}}
    )
    data = yaml.safe_load(config.read_text())
    data["eval"] = {"prompts": str(tasks)}
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="no_such"):
        load_config(config)


def test_prompt_lines_take_a_tag(tmp_path, tokenizer) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "odd:", "tag": "odd-1"}) + "\n" + json.dumps({"prompt": "even:"}) + "\n")
    assert [p.tag for p in read_prompts(path, tokenizer, 1024)] == ["odd-1", ""]
    path.write_text(json.dumps({"prompt": "odd:", "tag": 3}) + "\n")
    with pytest.raises(DataError, match=r"prompts.jsonl:1: 'tag' must be a string"):
        read_prompts(path, tokenizer, 1024)


# ------------------------------------------------------------------- the best checkpoint
def complete(directory: Path, step: int) -> None:
    """A complete checkpoint of ``step`` as ``checkpoint.save`` leaves it (a stand-in for DeepSpeed's file)."""
    path = directory / checkpoint.tag_for(step)
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_bytes(b"weights %d" % step)
    record = {"step": step, "files": checkpoint.describe_files(path, checkpoint.listing(path))}
    (path / checkpoint.RECORD).write_text(json.dumps(record))


def saved(best: BestCheckpoint, step: int, value: float, keep_last: int = 1) -> None:
    """What the trainer does: the save (its rotation sparing the best), then the score."""
    complete(best.directory, step)
    checkpoint.prune(best.directory, keep_last, step, best.kept())
    best.consider(step, value, keep_last)


def test_the_best_checkpoint_survives_rotation_and_a_resume(tmp_path) -> None:
    directory = tmp_path / "checkpoints"
    best = BestCheckpoint(directory, "eval/loss", "min")
    for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 1.5)):
        saved(best, step, loss)
    assert checkpoint.complete_tags(directory) == ["step_0000002", "step_0000004"]  # the best and the newest
    assert json.loads((directory / BEST).read_text())["tag"] == "step_0000002"
    resumed = BestCheckpoint(directory, "eval/loss", "min")
    resumed.load(resume_step=4)
    saved(resumed, 5, 1.2)
    saved(resumed, 6, float("nan"))  # never the best
    assert checkpoint.complete_tags(directory) == ["step_0000002", "step_0000006"]
    saved(resumed, 7, 0.5)  # better: recorded, and the old best pruned
    assert checkpoint.complete_tags(directory) == ["step_0000007"]
    assert json.loads((directory / BEST).read_text()) == {
        "tag": "step_0000007", "step": 7, "metric": "eval/loss", "mode": "min", "value": 0.5
    }  # fmt: skip


def test_a_best_record_the_resume_cannot_continue_is_dropped(tmp_path, caplog) -> None:
    directory = tmp_path / "checkpoints"
    best = BestCheckpoint(directory, "eval/reward_mean", "max")
    saved(best, 2, 0.5, keep_last=3)
    saved(best, 4, 0.7, keep_last=3)
    for metric, mode, step, why in (
        ("eval/reward_mean", "max", 3, "after the step this run resumes from"),
        ("eval/pass@1", "max", 4, "it scores eval/reward_mean (max), this run eval/pass@1"),
    ):
        again = BestCheckpoint(directory, metric, mode)
        again.load(step)
        assert again.record is None and why in caplog.text
    (directory / BEST).write_text("{")
    again = BestCheckpoint(directory, "eval/reward_mean", "max")
    again.load(4)
    assert again.record is None and "unreadable" in caplog.text


# ------------------------------------------------------------------- ds-tree eval
def test_ds_tree_eval_scores_a_model_and_names_bad_input(tmp_path, capsys) -> None:
    data = write_forest(tmp_path / "data.jsonl")
    held_out = write_forest(tmp_path / "heldout.jsonl", groups=2, seed=9)
    config = write_config(tmp_path, data, eval={"data": str(held_out)})
    assert cli_main(["eval", str(config)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["model"].endswith("tiny_llama.json") and summary["samples"] is None
    assert summary["eval/loss"] > 0 and summary["eval/tree_tokens"] < summary["eval/flat_tokens"]
    assert cli_main(["eval", str(config), "eval.data="]) == 2
    assert "no eval section to run" in capsys.readouterr().err
    assert cli_main(["eval", str(config), "--checkpoint", str(tmp_path / "checkpoints")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err


def test_every_tracker_takes_the_eval_metric_names(tmp_path, monkeypatch) -> None:
    """MLflow refuses ``@`` in a metric name: ``eval/pass@4`` goes to it as ``eval/pass_at_4``."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from ds_tree.run.trackers import MlflowTracker, TrackerRun, mlflow_key

    assert mlflow_key("eval/odd-1/pass@4") == "eval/odd-1/pass_at_4" and mlflow_key("loss/train") == "loss/train"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tracker = MlflowTracker(TrackerRun(tmp_path, "trees", "run", {"max_steps": 2}, 0), None)
    tracker.log(2, {"eval/pass@4": 0.5, "eval/even/pass@1": 0.25})
    tracker.close()
    metrics = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}").get_run(tracker.run_id).data.metrics
    assert metrics == {"eval/pass_at_4": 0.5, "eval/even/pass_at_1": 0.25}


# ------------------------------------------------------------------- plots
def write_metrics(run: Path, records: list[dict]) -> Path:
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return run


def test_plot_online_draws_and_tables_the_eval_reward(tmp_path, capsys) -> None:
    rollout = {"rollout/sampled_tokens": 8, "rollout/forward_tokens": 10}
    records = [{"step": step, "rollout/reward_mean": step / 10, **rollout} for step in range(1, 5)]
    records[1]["eval/reward_mean"], records[3]["eval/reward_mean"] = 0.25, 0.75
    evaluated = write_metrics(tmp_path / "evaluated", records)
    plain = write_metrics(tmp_path / "plain", [{k: v for k, v in r.items() if "eval" not in k} for r in records])
    output = tmp_path / "curves.png"
    assert cli_main(["plot-online", f"a={evaluated}", f"b={plain}", "--output", str(output), "--window", "2"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].endswith("| eval reward, first | eval reward, last |")
    assert table[2].endswith("| 0.250 (step 2) | 0.750 (step 4) |") and table[3].endswith("|  |  |")
    assert output.read_bytes()[:4] == b"\x89PNG"
    assert cli_main(["plot-online", f"a={evaluated},{plain}", "--output", str(output)]) == 2
    assert "do not evaluate (eval/reward_mean) at the same steps" in capsys.readouterr().err


def test_plot_multiturn_draws_the_eval_reward_and_prints_its_line(tmp_path, capsys) -> None:
    rl = {"rollout/sampled_tokens": 100, "rollout/tokens_saved": 300, "tree/por": 0.9, "rollout/parse_errors": 0}
    rl |= {"rollout/env_errors": 0, "time/step_s": 1.0}
    records = [{"step": 1, "warmup/sft_loss": 1.0, "time/step_s": 1.0, "eval/reward_mean": 0.1, "eval/pass@1": 0.1}]
    records += [{"step": step, "rollout/reward_mean": step / 10, **rl} for step in (2, 3, 4)]
    records[-1] |= {"eval/reward_mean": 0.6, "eval/pass@1": 0.5}
    run = write_metrics(tmp_path / "run", records)
    assert cli_main(["plot-multiturn", str(run), "--output", str(tmp_path / "curve.png"), "--window", "2"]) == 0
    assert (
        "held-out eval (2 evaluations): reward 0.100 at step 1, 0.600 at step 4 (pass@1 0.100 -> 0.500); best 0.600 "
        "at step 4" in capsys.readouterr().out
    )
    broken = {"step": 2, "rollout/reward_mean": 0.2, "eval/reward_mean": 0.1, **rl}
    (run / "metrics.jsonl").write_text(json.dumps(broken) + "\n")
    assert cli_main(["plot-multiturn", str(run), "--output", str(tmp_path / "curve.png")]) == 2
    assert "metrics.jsonl:1: the record has no 'eval/pass@1'" in capsys.readouterr().err


# ------------------------------------------------------------------- 2 ranks
def metrics_by_step(run: dict) -> dict[int, dict]:
    return {record["step"]: record for record in run["metrics"]}


def trains_alike(plain: dict, evaluated: dict, keys: tuple[str, ...]) -> None:
    """The run with an eval section trained exactly as the one without: every step's ``keys`` equal."""
    plain, evaluated = metrics_by_step(plain), metrics_by_step(evaluated)
    assert sorted(plain) == sorted(evaluated)
    for step, record in plain.items():
        for key in keys:
            assert evaluated[step][key] == record[key], (step, key)


@pytest.mark.distributed
@pytest.mark.slow
def test_sft_with_eval_trains_alike_and_keeps_the_best_checkpoint_through_rotation_and_resume(tmp_path) -> None:
    data = write_forest(tmp_path / "data.jsonl")
    held_out = write_forest(tmp_path / "heldout.jsonl", groups=3, seed=4)
    config = write_config(
        tmp_path,
        data,
        max_steps=3,
        eval={"data": str(held_out), "every_steps": 1},
        # the highest loss is the best: the first step's, which rotation would delete first
        checkpoint={"every": 1, "keep_last": 1, "keep_best": "eval/loss", "best_mode": "max", "export_hf": False},
    )
    out = tmp_path / "runs.json"
    torchrun("tests/distributed/eval_check.py", "--config", str(config), "--out", str(out), "--resume-max-steps", "5")
    runs = json.loads(out.read_text())
    trains_alike(runs["plain"], runs["eval"], ("loss/train", "optim/grad_norm"))
    losses = [metrics_by_step(runs["eval"])[step]["eval/loss"] for step in (1, 2, 3)]
    assert losses == sorted(losses, reverse=True) and "eval/loss" not in runs["plain"]["metrics"][0]
    assert runs["eval"]["checkpoints"] == ["step_0000001", "step_0000003"]
    assert runs["eval"]["best"]["tag"] == "step_0000001" and runs["eval"]["best"]["value"] == losses[0]
    resumed = runs["resumed"]
    assert resumed["start_step"] == 3 and resumed["checkpoints"] == ["step_0000001", "step_0000005"]
    assert resumed["best"] == runs["eval"]["best"]
    assert [r["step"] for r in resumed["metrics"]] == [1, 2, 3, 4, 5] and "eval/loss" in resumed["metrics"][-1]


@pytest.mark.distributed
@pytest.mark.slow
def test_online_rl_with_eval_trains_alike_and_two_ranks_split_the_tasks(tmp_path, tokenizer_dir, capsys) -> None:
    """5 held-out prompts over 2 ranks (3 and 2), each sampled once per evaluation; the 2-rank evaluation equals
    ``ds-tree eval`` of the exported model in one process, with the same seeds. The reward draws from Python's
    global generator, as training's does: the evaluation must leave it as it found it."""
    prompts = tmp_path / "held_out.jsonl"
    lines = [{"prompt": f"{parity} digits {i}:", "metadata": {"parity": parity}, "tag": parity} for i, parity in
             enumerate(["even", "odd", "even", "odd", "even"])]  # fmt: skip
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = online_config(
        tmp_path,
        tokenizer_dir,
        max_steps=3,
        rollout={"reward": "tests.distributed.eval_check:noisy_parity"},  # draws from Python's generator
        eval={"prompts": str(prompts), "every_steps": 2, "samples": 3, "pass_k": 2, "success_threshold": 0.5},
        checkpoint={"export_hf": True},
        optimizer={"lr": 2e-2, "schedule": "constant"},
    )
    out = tmp_path / "runs.json"
    torchrun("tests/distributed/eval_check.py", "--config", str(config), "--out", str(out))
    runs = json.loads(out.read_text())
    trains_alike(runs["plain"], runs["eval"], ("loss/train", "optim/grad_norm", "rollout/reward_mean", "rl/kl_ref"))
    rank0, rank1 = runs["eval"]["sampled"]
    assert rank0 == [0, 2, 4] * 2 and rank1 == [1, 3] * 2  # evaluated after steps 2 and 3
    last = metrics_by_step(runs["eval"])[3]
    assert last["eval/tasks"] == 5 and last["eval/even/tasks"] == 3 and last["eval/odd/tasks"] == 2
    saved = [json.loads(line) for line in (tmp_path / "run/eval/step_000003.jsonl").read_text().splitlines()]
    assert [(r["task"], r["sample"]) for r in saved] == [(f"prompt-{i}", s) for i in range(5) for s in range(3)]
    export = tmp_path / "run/hf"
    assert cli_main(["eval", str(config), "--model", str(export), "--step", "3"]) == 0
    alone = json.loads(capsys.readouterr().out)
    for key, value in last.items():  # the same samples; the rewards' noise is this process's (< 1e-3)
        if key.startswith("eval/") and key != "eval/seconds":
            assert alone[key] == (pytest.approx(value, abs=1e-3) if "reward" in key else value), key
