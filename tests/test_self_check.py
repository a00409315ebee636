"""The training-time tree-vs-flat self-check (``objective.self_check``): which steps it runs on, its
sample, a passing check (loss, log-probs, gradients) in float32/bf16 and dfs mode, on every model family
of the matrix, with the RL objective, and a broken restoration weight (a test-only fault injection)
stopping it with an error naming the step, the failing quantity and the parameter.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.data import load_trajectories
from ds_tree.engine import self_check
from ds_tree.engine.dfs import DfsSettings
from ds_tree.engine.self_check import CheckSettings
from ds_tree.models.loading import load_model
from ds_tree.objectives import sft
from ds_tree.objectives.policy_gradient import PolicyGradientCheck
from ds_tree.objectives.sft import SFTCheck
from ds_tree.packing.plan import PlanSettings
from ds_tree.trees.random_trees import TreeShape, random_forest
from tests.helpers.data import write_forest

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "configs/models/tiny_llama.json")


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory):
    return load_trajectories(write_forest(tmp_path_factory.mktemp("self_check") / "forest.jsonl"))


def test_due_steps():
    assert [s for s in range(8) if self_check.is_due("first", s, 3)] == [3]
    assert [s for s in range(8) if self_check.is_due("every:3", s, 1)] == [0, 3, 6]
    assert not any(self_check.is_due("off", s, 0) for s in range(8))


def test_sample_is_whole_groups_under_the_cap(trajectories):
    sample = self_check.sample_groups(trajectories, cap=1000)
    groups = {t.group_id for t in sample}
    assert len(groups) >= 2 and all(sum(t.group_id == g for t in sample) == 4 for g in groups)  # whole groups of 4
    assert sum(len(t) for t in sample) <= 1000
    smallest = min(self_check.group_trajectories(trajectories), key=lambda g: sum(len(t) for t in g))
    assert self_check.sample_groups(trajectories, cap=10) == smallest[:2]  # no group fits the cap


@pytest.mark.parametrize(
    "dtype, dfs",
    [(torch.float32, None), (torch.float32, DfsSettings(24, True)), (torch.bfloat16, DfsSettings(24, False))],
)
def test_check_passes_within_the_dtype_tolerance(trajectories, dtype, dfs):
    model = load_model(MODEL, dtype=dtype, seed=3)
    sample = self_check.sample_groups(trajectories)
    plan = PlanSettings(mode="dfs", budget=400, dfs_chunk=24) if dfs else PlanSettings(budget=400)
    rng = torch.random.get_rng_state()
    result = self_check.check_sample(model, SFTCheck(sample), CheckSettings(plan, dfs))
    self_check.verdict(result, 1, dtype)
    tolerance = self_check.TOLERANCES[dtype]
    assert 0 < result.tokens and result.max_abs_logprob_err < tolerance and result.max_grad_rel_err < tolerance
    assert result.items == {"walked" if dfs else "packed": 1}  # the run's kind, by its runner
    # every weight's gradient compared, nothing left behind: no .grad, the RNG where it was
    assert result.parameters == sum(1 for p in model.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)


@pytest.fixture(scope="module")
def matrix_sources(tmp_path_factory) -> dict[str, str]:
    from tests.test_model_matrix import BASE, MODELS

    directory = tmp_path_factory.mktemp("matrix")
    for name, fields in MODELS.items():
        (directory / f"{name}.json").write_text(json.dumps({**BASE, **fields}))
    return {name: str(directory / f"{name}.json") for name in MODELS}


@pytest.mark.parametrize("name", ["llama", "qwen2_sliding", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "mistral",
                                  "gemma", "gemma2", "gemma3", "phi3", "qwen3_5", "qwen3_5_moe", "bamba", "qwen2",
                                  "qwen3_next", "falcon_h1", "nemotron_h"])  # fmt: skip
def test_check_passes_on_every_model_family_of_the_matrix(matrix_sources, name):
    """docs/MODELS.md's matrix (dense, MoE, sliding windows, soft-caps, hybrids) in float32, as training runs."""
    from tests.test_model_matrix import BASE, MODELS

    assert len(MODELS) == 18 and set(MODELS) == set(matrix_sources)  # a new family joins the list above
    shape = TreeShape(trees=2, depth=3, children=(2, 3), node_tokens=(2, 6), alphabet=(3, BASE["vocab_size"] - 1))
    forest = random_forest(random.Random(1), shape)
    model = load_model(matrix_sources[name], attention="torch", dtype=torch.float32, seed=7)
    result = self_check.check_sample(model, SFTCheck(forest), CheckSettings(PlanSettings(budget=4096)))
    self_check.verdict(result, 1, torch.float32)
    assert result.parameters >= 10 and result.trajectories == len(forest)


def _vision_sample(family: str):
    """``tests/test_vision.py``'s agent trees (shared screenshots, different images behind identical
    placeholders, a repeated image, a text-only trial) with the family's rotary positions, and its tiny model."""
    from ds_tree.models.vision import attach_rope_positions
    from tests.test_model_matrix import VISION_MODELS
    from tests.test_vision import agent_trees

    model = load_model(str(ROOT / VISION_MODELS[family]), dtype=torch.float32, seed=7)
    trajectories = agent_trees(family)
    attach_rope_positions(model.config, trajectories)
    return model, trajectories


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_check_passes_on_vision_language_models_with_each_trajectorys_images(family):
    """The matrix's vision-language entries: the flat side encodes every trajectory's own images, the tree
    side each tree's distinct images once (counted at the tower), and every parameter, the tower's
    included, is compared."""
    from tests.test_model_matrix import VISION_MODELS

    assert set(VISION_MODELS) == {"qwen2_5_vl", "qwen3_vl"}  # a new family joins the list above
    model, trajectories = _vision_sample(family)
    encoded = []  # images per tower call
    model.model.visual.register_forward_hook(
        lambda _module, _args, kwargs, _out: encoded.append(len(kwargs["grid_thw"])), with_kwargs=True
    )
    result = self_check.check_sample(model, SFTCheck(trajectories), CheckSettings(PlanSettings(budget=4096)))
    self_check.verdict(result, 1, torch.float32)
    per_trajectory = sum(len({image.key for image in t.images}) for t in trajectories)
    per_tree = len({image.key for t in trajectories[:5] for image in t.images}) + 1  # 4 in task g, 1 in h
    assert encoded == [per_trajectory, per_tree] == [10, 5]  # flat (one row), then tree (one row)
    assert result.trajectories == len(trajectories)
    assert result.parameters == sum(1 for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_vision_language_checks_walk_and_take_the_rl_objective(family, objective):
    """The same sample walked in chunks of 5 tokens (images cut between chunks), SFT and GRPO, and GRPO on
    packed rows, with the step's old log-probs and an update between them (ratios off 1)."""
    from ds_tree.losses.advantages import estimate
    from ds_tree.losses.rl import RLSettings

    model, trajectories = _vision_sample(family)
    walk = PlanSettings(mode="dfs", budget=4096, dfs_chunk=5)
    runs = {"walked": (walk, DfsSettings(5))}
    if objective == "grpo":
        runs["packed"] = (PlanSettings(budget=4096), None)
    for kind, (plan, dfs) in runs.items():
        rl = None
        if objective == "grpo":
            advantages = estimate(trajectories, "grpo", False).by_trajectory()
            rl = PolicyGradientCheck.of(model, trajectories, advantages, RLSettings(), CheckSettings(plan, dfs))
            with torch.no_grad():  # the step's update
                for parameter in model.parameters():
                    parameter.add_(0.02 * torch.randn_like(parameter))
        result = self_check.check_sample(model, rl or SFTCheck(trajectories), CheckSettings(plan, dfs))
        self_check.verdict(result, 1, torch.float32)
        assert result.items == {kind: 2 if kind == "walked" else 1}, result.items  # one walk per tree
        assert result.parameters == sum(1 for p in model.parameters() if p.requires_grad)


def _faulty_pixels(fault: str, pixel_values, grids) -> list[np.ndarray]:
    """Images' pixels with a fault: those of one grid all the first one's (``merged``), or blank (``dropped``)."""
    first: dict[tuple[int, ...], np.ndarray] = {}
    return [
        np.zeros_like(pixels) if fault == "dropped" else first.setdefault(tuple(grid), pixels)
        for pixels, grid in zip(pixel_values, grids, strict=True)
    ]


@pytest.mark.parametrize("fault", ["merged", "dropped"])
@pytest.mark.parametrize("dfs", [None, DfsSettings(16)], ids=["packed", "walked"])
def test_a_merged_or_dropped_image_in_the_tree_stops_the_check(monkeypatch, fault, dfs):
    """Fault injection on the tree side only (the flat rows stay exact): a packed tree row's images, or a
    walked row's (the walk encodes each once, :mod:`ds_tree.packing.dfs_images`), with one grid all encoded
    from the first one's pixels (different screenshots merged, as a trie keyed on placeholder ids would), or
    every one blank (dropped): the check stops the run."""
    import dataclasses

    from ds_tree.packing import dfs_images
    from ds_tree.packing.rows import PackedRow, RowImages

    model, trajectories = _vision_sample("qwen2_5_vl")
    if dfs:
        exact_slots = dfs_images._slots

        def faulty_slots(row, placeholders, roots):
            slot_of, images = exact_slots(row, placeholders, roots)
            pixels = _faulty_pixels(fault, [i.pixel_values for i in images], [i.grid_thw for i in images])
            return slot_of, [dataclasses.replace(i, pixel_values=p) for i, p in zip(images, pixels, strict=True)]

        monkeypatch.setattr(dfs_images, "_slots", faulty_slots)
    else:
        exact_inputs = PackedRow.image_inputs

        def faulty_inputs(row, tokens=None):
            inputs = exact_inputs(row, tokens)
            if all(len(part.trajectory_ids) == 1 for part in row.layout_parts):  # a flat row
                return inputs
            pixels = _faulty_pixels(fault, inputs.pixel_values, inputs.grids)
            return RowImages(pixel_values=pixels, grids=inputs.grids, feature_index=inputs.feature_index)

        monkeypatch.setattr(PackedRow, "image_inputs", faulty_inputs)
    plan = PlanSettings(mode="dfs", budget=4096, dfs_chunk=16) if dfs else PlanSettings(budget=4096)
    result = self_check.check_sample(model, SFTCheck(trajectories), CheckSettings(plan, dfs))
    assert set(result.items) == {"walked" if dfs else "packed"}
    message = r"step 2: the tree result differs .* gradient relative error .*; log-prob absolute error"
    with pytest.raises(self_check.SelfCheckError, match=message):
        self_check.verdict(result, 2, torch.float32)
    assert result.max_grad_rel_err > 1e-2 and result.max_abs_logprob_err > 1e-3, result


@pytest.mark.parametrize("dfs", [None, DfsSettings(16)])
def test_rl_objective_is_checked_with_the_steps_old_logprobs(tmp_path, dfs):
    """GRPO with clipping, KL (reference: adapters disabled) and entropy on LoRA adapters: the old
    log-probs recorded before an update, the check after it (ratios off 1, both clips active); packed
    rows, and walked trees (old, reference and loss walks in chunks of 16 tokens)."""
    from ds_tree.config import LoraSettings
    from ds_tree.data.jsonl import write_jsonl
    from ds_tree.losses.advantages import estimate
    from ds_tree.losses.rl import RLSettings
    from ds_tree.models.lora import AdaptersDisabled, apply_lora
    from tests.test_verify_rl import records

    data = load_trajectories(write_jsonl(tmp_path / "rl.jsonl", records()))
    torch.manual_seed(4)
    policy = apply_lora(load_model(MODEL, seed=3), LoraSettings(rank=4), init_lora_weights=False)
    settings = RLSettings(eps_low=0.02, eps_high=0.02, kl_coef=0.1, entropy_coef=0.01)
    advantages = estimate(data, "grpo", False).by_trajectory()
    plan = PlanSettings(mode="dfs", budget=400, dfs_chunk=16) if dfs else PlanSettings(budget=400)
    reference = AdaptersDisabled(policy)
    inputs = PolicyGradientCheck.of(policy, data, advantages, settings, CheckSettings(plan, dfs), reference=reference)
    assert len({t.group_id for t in inputs.sample}) == 1 and len(inputs.sample) > 1  # a whole group
    with torch.no_grad():  # the step's update
        for parameter in policy.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn_like(parameter))
    result = self_check.check_sample(policy, inputs, CheckSettings(plan, dfs))
    self_check.verdict(result, 1, torch.float32)
    assert result.max_grad_rel_err < 1e-5 and "lora_" in result.worst_parameter
    assert result.items == {"walked" if dfs else "packed": 1}
    assert all(p.grad is None for p in policy.parameters())
    # the objective is the clipped one: the same sample without the update has ratio 1, another loss
    exact_ratio = PolicyGradientCheck.of(
        policy, data, advantages, settings, CheckSettings(plan, dfs), reference=reference
    )
    unclipped = self_check.check_sample(policy, exact_ratio, CheckSettings(plan, dfs))
    assert abs(unclipped.loss_flat - result.loss_flat) > 1e-4


def test_a_broken_restoration_weight_stops_with_a_clear_error(trajectories, monkeypatch):
    model = load_model(MODEL, seed=3)
    sample = self_check.sample_groups(trajectories, cap=1000)  # whole groups: shared trained tokens
    exact = sft.restoration_weights

    def broken(row, *args):  # fault injection: a shared token counted once, not once per trajectory
        weights = exact(row, *args)
        return np.where(row.mask_sum > row.mask_max, weights * row.mask_max / np.maximum(row.mask_sum, 1), weights)

    monkeypatch.setattr(sft, "restoration_weights", broken)
    result = self_check.check_sample(model, SFTCheck(sample), CheckSettings(PlanSettings(budget=400)))
    message = r"step 7: the tree result differs .* loss relative error .*; gradient relative error .* \(parameter model"
    with pytest.raises(self_check.SelfCheckError, match=message):
        self_check.verdict(result, 7, torch.float32)
    assert result.max_grad_rel_err > 1e-2  # far over float32's and bf16's tolerances


def test_trees_the_run_walks_are_walked_by_the_check_and_a_fault_of_the_walk_stops_it(trajectories, monkeypatch):
    """``packing.over_budget: dfs``: the sample's tree with a path over the budget is walked, as the run
    walks it, the other packed in parts (the check once sampled only trees a row holds, and packed them); a fault
    in the walk alone (the chunks below a root chunk placed one token deeper) then stops the check."""
    from ds_tree.engine.dfs import ChunkInputs

    model = load_model(MODEL, seed=3)
    sample = self_check.sample_groups(trajectories, cap=1000)
    longest = sorted(max(len(t) for t in group) for group in self_check.group_trajectories(sample))
    assert len(longest) == 2 and longest[0] < longest[1]
    plan = PlanSettings(budget=longest[0], over_budget="dfs")  # one group's tree packed, the other's walked
    dfs = DfsSettings(32)
    result = self_check.check_sample(model, SFTCheck(sample), CheckSettings(plan, dfs))
    self_check.verdict(result, 1, torch.float32)
    assert result.items["walked"] == 1 and result.items["packed"] >= 1 and result.max_grad_rel_err < 1e-5
    exact = ChunkInputs.of_chunk.__func__

    def deeper(cls, row, chunks, index, cache):  # fault injection: a walked chunk's positions off by one
        inputs = exact(cls, row, chunks, index, cache)
        if chunks.parent[index] >= 0:
            inputs.position_ids = inputs.position_ids + 1
        return inputs

    monkeypatch.setattr(ChunkInputs, "of_chunk", classmethod(deeper))
    broken = self_check.check_sample(model, SFTCheck(sample), CheckSettings(plan, dfs))
    message = r"step 3: the tree result differs .* gradient relative error .* \(parameter model.*; log-prob absolute"
    with pytest.raises(self_check.SelfCheckError, match=message):
        self_check.verdict(broken, 3, torch.float32)
    assert broken.max_grad_rel_err > 1e-2 and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("dfs", [None, DfsSettings(16)])
def test_the_moe_router_loss_is_checked_with_the_rl_objective(dfs):
    """GRPO on a tiny Qwen3-MoE with the router load-balancing loss: both sides add it (packed rows, and
    walked trees), so the check passes and its loss moves by the coefficient times the router loss."""
    from ds_tree.losses.advantages import estimate
    from ds_tree.losses.rl import RLSettings
    from tests.helpers.rollouts import rl_trajectories

    data = rl_trajectories(groups=2)
    model = load_model(str(ROOT / "configs/models/tiny_qwen3_moe.json"), seed=3)
    settings = RLSettings(eps_low=0.02, eps_high=0.02)
    advantages = estimate(data, "grpo", False).by_trajectory()
    plan = PlanSettings(mode="dfs", budget=400, dfs_chunk=16) if dfs else PlanSettings(budget=400)
    inputs = PolicyGradientCheck.of(model, data, advantages, settings, CheckSettings(plan, dfs))
    with torch.no_grad():  # the step's update
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    results = {
        coefficient: self_check.check_sample(model, inputs, CheckSettings(plan, dfs), router_aux_loss_coef=coefficient)
        for coefficient in (0.0, 1.0)
    }
    for result in results.values():
        self_check.verdict(result, 1, torch.float32)
        assert result.max_grad_rel_err < 1e-5 and set(result.items) == {"walked" if dfs else "packed"}
    for side in ("loss_flat", "loss_tree"):  # E * sum_e f_e P_e >= K = 2 on each side
        assert getattr(results[1.0], side) - getattr(results[0.0], side) > 1.9
