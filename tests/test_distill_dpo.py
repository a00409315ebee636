"""On-policy distillation and DPO (``objective.kind: distill`` / ``dpo``; issue 53): exact on trees against
flat oracles that write each loss out on whole logits, through ``ds-tree verify`` (packed rows split into parts,
dfs walks, LoRA; S = 2 spawned ranks, marked distributed), their pieces (divergences, pair derivatives, sibling
pairs, the preference format), and the settings refused before any model is built.

float64, tolerance 1e-10 (the report's own). Teachers are another architecture (``tiny_qwen2``: tied
embeddings, one key/value head) than the student (``tiny_llama``), so their hidden states, head and heads under
Ulysses are the teacher's own. Every case also asserts that its loss and gradient are not trivially zero.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.cli.verify import main as verify
from ds_tree.config import ConfigError, DPOSettings, ObjectiveConfig, load_config
from ds_tree.data.convert import ConvertOptions, convert
from ds_tree.data.jsonl import write_jsonl
from ds_tree.errors import DataError
from ds_tree.losses.distill import divergence
from ds_tree.losses.dpo import DPOLoss, pair_statistics
from ds_tree.models.loading import load_model
from ds_tree.models.logprobs import target_logprobs
from ds_tree.packing.modes import pack_trajectories
from ds_tree.trees.pairs import preference_pairs, sibling_pairs
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_trees
from tests.helpers.configs import online_config
from tests.helpers.launch import resumed_runs
from tests.helpers.rollouts import RolloutShape, rl_records
from tests.helpers.runs import prepare

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "configs/models/tiny_llama.json")
TEACHER = str(ROOT / "configs/models/tiny_qwen2.json")
SHAPE = RolloutShape(stem=24, fork=(2, 24), min_tail=4, longest=54, vocab=1000, untrained=6, rewards="mixed")
"""A 24-token stem per group forking at random depths: sibling leaves with different rewards, and parts at
budget 56 (every tree is split)."""
BUDGET = ["--budget", "56"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return str(write_jsonl(tmp_path_factory.mktemp("distill_dpo") / "rl.jsonl", rl_records(4, 4, 6, SHAPE)))


def run_verify(argv: list[str], capsys) -> tuple[int, dict | None, str]:
    code = verify(argv)
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out else None, captured.err


def assert_exact(report: dict, sides: tuple[str, ...], value: str) -> None:
    assert report["passed"], report
    assert report["loss_flat"] != 0 and report[f"{value}_compared"] > 0, report
    for side in sides:
        prefix = "" if side == "tree" else f"{side}_"
        for name in ("loss_rel_err", "max_rel_grad_err", f"max_abs_{value}_err"):
            assert report[prefix + name] <= 1e-10, (side, name, report[prefix + name])


DISTILL = {
    "reverse_kl_sampled": ["--eps-low", "0.05", "--dual-clip", "3"],
    "kl": [],
    "jsd": ["--distill-beta", "0.3"],
    "reverse_kl": ["--aggregation", "seq_mean_token_mean"],
}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("loss", DISTILL)
def test_distill_tree_and_dfs_equal_the_flat_oracle(data, capsys, loss, lora):
    argv = ["--data", data, "--model", MODEL, "--objective", "distill", "--teacher", TEACHER, *BUDGET]
    argv += ["--distill-loss", loss, *DISTILL[loss], "--dfs-chunk", "16"] + (["--lora", "4"] if lora else [])
    code, report, err = run_verify(argv, capsys)
    assert code == 0, err
    assert_exact(report, ("tree", "dfs"), "teacher_logprob")
    assert report["lora_rank"] == (4 if lora else 0)


DPO = {"sigmoid": ["--dpo-beta", "0.5"], "ipo": ["--dpo-loss", "ipo"], "smoothed": ["--dpo-label-smoothing", "0.2"]}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("variant", DPO)
def test_dpo_tree_and_dfs_equal_the_flat_oracle_pair_by_pair(data, capsys, variant, lora):
    argv = ["--data", data, "--model", MODEL, "--objective", "dpo", *BUDGET, *DPO[variant], "--dfs-chunk", "16"]
    code, report, err = run_verify(argv + (["--lora", "4"] if lora else []), capsys)
    assert code == 0, err
    assert_exact(report, ("tree", "dfs"), "margin")
    assert report["pairs"] >= 5 and report["pairs_from"] == "siblings", report


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "objective",
    [
        ["--objective", "distill", "--teacher", TEACHER, "--distill-loss", "kl"],
        ["--objective", "distill", "--teacher", TEACHER, "--dfs-chunk", "16"],
        ["--objective", "dpo", "--dpo-beta", "0.5"],
        ["--objective", "dpo", "--dpo-loss", "ipo", "--dfs-chunk", "16"],
    ],
    ids=["distill-kl-sharded", "distill-sampled-dfs", "dpo-sharded", "dpo-ipo-dfs"],
)
def test_two_sequence_parallel_ranks_equal_the_flat_oracle(data, capsys, objective):
    """S = 2: rows over the 32-token budget sharded over the ranks (or every tree walked by both), the
    teacher's heads (1 key/value head) not the student's: its own Ulysses exchange on the same group."""
    argv = ["--data", data, "--model", MODEL, "--budget", "32", "--sequence-parallel", "2", *objective]
    code, report, err = run_verify(argv, capsys)
    assert code == 0, err
    value = "teacher_logprob" if "distill" in objective else "margin"
    assert_exact(report, ("tree",), value)
    assert report["shared_items"] > 0 and report["sequence_parallel_size"] == 2, report


# ------------------------------------------------------------------------------------------ pieces
def flat_divergence(samples: list, seed: int) -> float:
    """The student's sampled reverse KL to the teacher, ``log q - log p`` per (trajectory, trained token), of
    the sampled ``[ids, reward, loss mask]`` with both models at their initial weights, each path alone, float64."""
    student, teacher = (load_model(m, dtype=torch.float64, seed=seed).eval() for m in (MODEL, TEACHER))
    total, tokens = 0.0, 0
    with torch.no_grad():
        for ids, _, mask in samples:
            row = pack_trajectories([Trajectory(np.array(ids), np.array(mask, dtype=float))], "flat", len(ids))[0]
            targets = np.flatnonzero(np.array(mask[1:]) != 0) + 1
            gap = target_logprobs(student, row, targets) - target_logprobs(teacher, row, targets)
            total, tokens = total + gap.sum().item(), tokens + targets.size
    return total / tokens


@pytest.mark.distributed
@pytest.mark.slow
def test_online_distillation_scores_the_students_own_trees_with_the_teacher(tmp_path, tokenizer_dir):
    """``kind: distill`` with ``rollout.enabled``: the student samples trees (the HF engine), the teacher scores
    them; 2 ranks, ZeRO-3, each rank training its own rollouts (the step's mini-batches, normalisers and reward
    statistics over both), resumed after step 1 to step 2's figures to the bit (tests/distributed/resume_check.py).
    Step 1's ``distill/divergence`` is the sampled reverse KL of the initial student to the teacher that each
    sampled path alone gives: it fails if the teacher's log-probs are not the teacher's."""
    config = online_config(
        tmp_path,
        tokenizer_dir,
        max_steps=2,
        objective={"kind": "distill", "teacher": TEACHER},
        optimizer={"lr": 2e-2, "schedule": "constant"},
        checkpoint={"every": 1, "keep_last": 2, "export_hf": False},
    )
    first, resumed = resumed_runs(config, 1)
    records = {record["step"]: record for record in first["metrics"]}
    assert sorted(records) == [1, 2] and [record["step"] for record in resumed["metrics"]] == [2]
    for step, record in records.items():
        samples = first["samples"][str(step)]
        assert len(samples) == 8 and record["rollout/leaves"] == 4, record  # 2 prompts x 4 leaves
        assert record["distill/reward_mean"] == pytest.approx(np.mean([reward for _, reward, _ in samples]))
        assert record["distill/reward_mean"] == pytest.approx(record["rollout/reward_mean"])
        assert math.isfinite(record["distill/divergence"]) and record["optim/grad_norm"] > 0, record
    expected = flat_divergence(first["samples"]["1"], seed=3)  # write_config's model.seed
    # float32 trees against the float64 paths: 4e-7 relative measured; another teacher's seed is 0.004 off 0.056
    assert expected != 0 and records[1]["distill/divergence"] == pytest.approx(expected, rel=1e-5)
    again = resumed["metrics"][0]
    assert resumed["samples"]["2"] == first["samples"]["2"]
    for key in ("loss/train", "optim/grad_norm", "distill/divergence", "distill/reward_mean"):
        assert again[key] == records[2][key], key


def test_divergences_match_their_definitions():
    generator = torch.Generator().manual_seed(0)
    student = torch.log_softmax(torch.randn(5, 11, generator=generator, dtype=torch.float64), -1)
    teacher = torch.log_softmax(torch.randn(5, 11, generator=generator, dtype=torch.float64), -1)
    kl = torch.nn.functional.kl_div(student, teacher, reduction="none", log_target=True).sum(-1)  # KL(p || q)
    torch.testing.assert_close(divergence(student, teacher, "kl"), kl)
    reverse = torch.nn.functional.kl_div(teacher, student, reduction="none", log_target=True).sum(-1)
    torch.testing.assert_close(divergence(student, teacher, "reverse_kl"), reverse)
    beta = 0.3
    mixture = torch.log(beta * teacher.exp() + (1 - beta) * student.exp())
    expected = beta * (teacher.exp() * (teacher - mixture)).sum(-1) + (1 - beta) * (
        student.exp() * (student - mixture)
    ).sum(-1)
    torch.testing.assert_close(divergence(student, teacher, "jsd", beta), expected)
    assert torch.all(divergence(student, student, "jsd", beta).abs() < 1e-12)


def test_pair_derivatives_are_the_losses_gradient():
    """``g = dL/dz`` from the sums: at ``x = 0`` DPO's loss is log 2 and ``dL/dx = -beta / 2``; a sequence in
    two pairs adds both; IPO's is ``2 (x - 1/(2 beta))``."""
    policy = np.array([0.0, 0.0, 0.0])
    statistics = pair_statistics(policy, policy, [(0, 1), (0, 2)], DPOLoss(beta=0.4))
    assert math.isclose(statistics.loss, math.log(2))
    np.testing.assert_allclose(statistics.derivatives, [-0.2, 0.1, 0.1])
    ipo = pair_statistics(np.array([1.0, 0.0]), np.zeros(2), [(0, 1)], DPOLoss(beta=0.5, loss="ipo"))
    assert math.isclose(ipo.loss, 0.0) and np.allclose(ipo.derivatives, [0.0, 0.0])
    assert ipo.scalars()["dpo/accuracy"] == 1.0 and ipo.scalars()["dpo/margin"] == 0.5


def trajectory(ids: list[int], reward: float | None, group: str = "g") -> Trajectory:
    return Trajectory(ids, np.ones(len(ids)), group_id=group, reward=reward)


def test_sibling_pairs_are_the_branches_one_node_past_a_fork():
    trajectories = [
        trajectory([1, 2, 3, 4], 1.0),  # fork after [1, 2]: siblings with the next two
        trajectory([1, 2, 5], 0.0),
        trajectory([1, 2, 6, 7], 0.5),
        trajectory([1, 2, 6, 7], 0.0),  # a duplicate ends in the same node: never paired with its twin
        trajectory([1, 8, 9], 0.0),  # [1] forks: its sibling node [2 ...] is no trajectory's last node
        trajectory([1, 2, 5, 9, 9], None),  # no reward: in no pair; makes [5] a node others continue below
    ]
    (tree,) = build_trees(trajectories)
    ids = [tuple(t.input_ids.tolist()) for t in tree.trajectories]
    pairs = {(ids[chosen], ids[rejected]) for chosen, rejected in sibling_pairs(tree)}
    assert pairs == {((1, 2, 3, 4), (1, 2, 5)), ((1, 2, 3, 4), (1, 2, 6, 7)), ((1, 2, 6, 7), (1, 2, 5))}
    assert len(preference_pairs(trajectories)) == 4  # the duplicate [1, 2, 6, 7] pairs with [1, 2, 3, 4] too


def test_preference_records_convert_to_sibling_pairs(tmp_path, tokenizer_dir):
    records = [
        {"prompt": "Write even digits:", "chosen": " 2 4 6", "rejected": " 1 3"},
        {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
         "rejected": [{"role": "assistant", "content": "go away"}], "group_id": "c"},
        {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "and now?"}],
         "chosen": [{"role": "assistant", "content": "let me help"}],
         "rejected": [{"role": "assistant", "content": "no"}], "group_id": "c"},
        {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a one"}],
         "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a two"}]},
    ]  # fmt: skip
    source = write_jsonl(tmp_path / "pairs.jsonl", records)
    summary = convert([source], tmp_path / "data", tokenizer_dir, ConvertOptions(format="preference"))
    assert summary["counts"]["groups"] == 3 and summary["counts"]["trajectories"] == 8
    from ds_tree.data import load_trajectories

    trajectories = load_trajectories(tmp_path / "data")
    assert [t.reward for t in trajectories] == [1.0, 0.0] * 4
    assert preference_pairs(trajectories) == [(0, 1), (2, 3), (4, 5), (6, 7)]  # each record's own pair
    for t in trajectories:  # the answer is trained, the prompt is not
        assert t.loss_mask[0] == 0 and t.loss_mask[-1] == 1
    second, third = trajectories[2], trajectories[4]  # a later turn's prompt holds the earlier chosen answer
    assert np.array_equal(third.input_ids[: len(second)], second.input_ids)
    assert not third.loss_mask[: len(second)].any()


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"prompt": "p", "chosen": " a", "rejected": " a"}, "the same tokens"),
        ({"prompt": "p", "chosen": " a", "rejected": [{"role": "assistant", "content": "b"}]}, "all strings"),
        ({"prompt": "p", "chosen": " a"}, "needs 'rejected'"),
        ({"chosen": " a", "rejected": " b"}, "needs a non-empty 'prompt'"),
    ],
)
def test_bad_preference_records_are_named(tmp_path, tokenizer_dir, record, reason):
    source = write_jsonl(tmp_path / "bad.jsonl", [record])
    with pytest.raises(DataError, match=reason) as error:
        convert([source], tmp_path / "data", tokenizer_dir, ConvertOptions(format="preference"))
    assert "bad.jsonl:1" in str(error.value)
    assert not (tmp_path / "data").exists()


# ------------------------------------------------------------------------------------------ refused
def test_fields_of_another_objective_are_refused():
    with pytest.raises(ConfigError, match="objective.teacher: only with objective.kind distill"):
        ObjectiveConfig(kind="grpo", teacher=MODEL)
    with pytest.raises(ConfigError, match="objective.dpo: only with objective.kind dpo"):
        ObjectiveConfig(kind="distill", teacher=MODEL, dpo=DPOSettings(beta=0.2))
    with pytest.raises(ConfigError, match="objective.kl_coef: only with objective.kind grpo or ppo"):
        ObjectiveConfig(kind="dpo", kl_coef=0.1)
    with pytest.raises(ConfigError, match="needs objective.teacher"):
        ObjectiveConfig(kind="distill")
    with pytest.raises(ConfigError, match="ratio clip applies to objective.distill.loss reverse_kl_sampled"):
        load_config(ROOT / "configs/tiny_cpu.yaml", ["objective.kind=distill", f"objective.teacher={MODEL}",
                                                    "objective.distill.loss=kl", "objective.eps_low=0.1"])  # fmt: skip
    with pytest.raises(ConfigError, match="label_smoothing applies to loss sigmoid only"):
        DPOSettings(loss="ipo", label_smoothing=0.1)


def test_online_dpo_is_refused(tmp_path):
    overrides = ["objective.kind=dpo", "data.path=", "rollout.enabled=true", "rollout.prompts=p.jsonl"]
    with pytest.raises(ConfigError, match="objective.kind dpo trains on preference pairs of data.path"):
        load_config(ROOT / "configs/tiny_cpu.yaml", [*overrides, "rollout.reward=exact_match"])


def teacher_directory(path: Path, tokenizer) -> str:
    """A Hugging Face teacher directory: tiny_llama's weights and ``tokenizer``'s files."""
    from ds_tree.models.loading import load_model

    load_model(MODEL, attention="torch", seed=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, tokenizer_dir):
    from ds_tree.vocab.tokenizer import build_tokenizer

    other = teacher_directory(tmp_path / "teacher", build_tokenizer(512))  # same model vocabulary (1024)
    overrides = ["objective.kind=distill", f"objective.teacher={other}", f"model.tokenizer={tokenizer_dir}"]
    with pytest.raises(ConfigError, match="objective.teacher: the tokenizer of .* is not the student's"):
        prepare(ROOT / "configs/tiny_cpu.yaml", *overrides, f"data.path={tmp_path / 'none.jsonl'}")


def test_a_teacher_of_another_vocabulary_is_refused(tmp_path):
    config = json.loads(Path(TEACHER).read_text()) | {"vocab_size": 2048}
    bigger = tmp_path / "bigger.json"
    bigger.write_text(json.dumps(config))
    overrides = ["objective.kind=distill", f"objective.teacher={bigger}", "objective.distill.loss=kl"]
    with pytest.raises(ConfigError, match="vocabulary of 2048 tokens, model.source 1024; distill.loss kl needs"):
        prepare(ROOT / "configs/tiny_cpu.yaml", *overrides, f"data.path={tmp_path / 'none.jsonl'}")


def test_dpo_data_without_pairs_is_refused(tmp_path):
    records = rl_records(0, 2, 3, replace(SHAPE, rewards="none"))
    path = write_jsonl(tmp_path / "no_rewards.jsonl", records)
    with pytest.raises(ConfigError, match="data.path: no preference pairs in 6 trajectories \\(0 with a reward\\)"):
        prepare(ROOT / "configs/tiny_cpu.yaml", "objective.kind=dpo", f"data.path={path}", "data.groups_per_step=2")


def test_console_lines_carry_each_objectives_figures():
    """A distillation step has no PPO clip fractions (its reward, where the data has one, is distill/'s) and a
    DPO step no reward: each line shows its own figures instead of failing on the RL ones."""
    from ds_tree.run.metrics import console_line

    base = {"loss/train": 0.5, "optim/lr": 1e-3, "optim/grad_norm": 1.0}
    base |= {"throughput/flat_tokens_per_s": 10.0, "throughput/unique_tokens_per_s": 5.0, "time/step_s": 1.0}
    base |= {"tree/por": 0.5, "tree/err": 2.0}
    line = console_line(3, 9, base | {"distill/divergence": 0.25, "distill/reward_mean": 0.75})
    assert "divergence 0.2500 reward 0.7500" in line and "clip" not in line
    online = base | {"distill/divergence": 0.25, "rollout/reward_mean": 0.5, "distill/reward_mean": 0.75}
    assert "reward 0.5000" in console_line(3, 9, online)
    assert "reward" not in console_line(3, 9, base | {"distill/divergence": 0.25})
    assert "margin 0.1250 accuracy 0.600" in console_line(3, 9, base | {"dpo/margin": 0.125, "dpo/accuracy": 0.6})


def test_history_pairs_make_one_tree_per_conversation(tmp_path, tokenizer_dir):
    """Preference pairs at later assistant turns of a conversation (``ds_tree.bench.preference_pairs``): each
    record's prompt is the history before its turn, chosen the turn itself, rejected another turn's text; all
    of a conversation's records merge into one tree, whose history is shared."""
    from ds_tree.bench.preference_pairs import history_pairs, write_history_pairs
    from ds_tree.data import load_trajectories

    conversation = [{"role": "system", "content": "You answer questions about digits."}]
    for turn in range(4):
        conversation += [{"role": "user", "content": f"question {turn}?"},
                         {"role": "assistant", "content": f"answer number {turn}"}]  # fmt: skip
    found = history_pairs(conversation, 2)
    assert [len(history) for history, _, _ in found] == [4, 8]  # turns 1 and 3 of 0..3
    for history, chosen, rejected in found:
        assert chosen == conversation[len(history)] and rejected["content"] != chosen["content"]
    other = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    trials = write_jsonl(tmp_path / "trials.jsonl", [{"group_id": "a", "messages": conversation},
                                                     {"group_id": "a", "messages": other},
                                                     {"group_id": "b", "messages": other}])  # fmt: skip
    assert write_history_pairs(trials, tmp_path / "pairs.jsonl", pairs=2) == {"groups": 2, "records": 2}
    summary = convert([tmp_path / "pairs.jsonl"], tmp_path / "data", tokenizer_dir, ConvertOptions(format="preference"))
    assert summary["counts"]["groups"] == 1 and summary["counts"]["trajectories"] == 4  # b: one turn, no pair
    assert summary["counts"]["tree_tokens"] < summary["counts"]["flat_tokens"]
    trajectories = load_trajectories(tmp_path / "data")
    assert preference_pairs(trajectories) == [(0, 1), (2, 3)]
    (tree,) = build_trees(trajectories)
    assert sorted(sibling_pairs(tree)) == [(0, 1), (2, 3)]
