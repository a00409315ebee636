"""The central test: tree mode gives what every trajectory gives alone.

For hypothesis forests and each tiny architecture (Llama, Qwen2, Qwen3), tree mode and the flat
baseline run from the same weights: loss, every trajectory's log-probabilities and every
parameter's gradient must agree (float64: 1e-10 relative, float32: round-off), for every
normalisation, with budgets that force splits and without. The loss is also checked against the
flat objective written out by hand from the flat log-probs, and those log-probs against a plain
Hugging Face forward of each trajectory with transformers' own attention.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from ds_tree.comparison import gradient_errors
from ds_tree.models.loading import keep_norms_in_float64, load_model
from ds_tree.models.logprobs import target_logprobs
from ds_tree.packing.parts import whole_tree
from ds_tree.packing.rows import assemble_row
from ds_tree.trees import trie
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_trees
from ds_tree.verify.tree_vs_flat import compare, run_mode
from tests.helpers.strategies import flat_coefficients, forests, longest, prefix_key

MODELS = {name: f"configs/models/tiny_{name}.json" for name in ("llama", "qwen2", "qwen3")}
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5}
# Absolute slack, as a fraction of the whole gradient's norm, for parameters whose exact gradient
# is ~0 (layer-0 q_proj of a sequence of equal tokens: equal values make dq vanish), where both
# modes only hold round-off of the whole backward.
GRADIENT_SLACK = {torch.float64: 1e-13, torch.float32: 1e-6}
NORMALISATIONS = ("token_mean", "sequence_mean", "sum")


@functools.cache
def _model(name: str, dtype: torch.dtype):
    return load_model(MODELS[name], attention="torch", dtype=dtype, seed=1234)


def _flat_objective(trajectories, logprobs, normalisation) -> float:
    """``sum_i sum_t c_it * -log p_it`` written out per trajectory."""
    coefficients = flat_coefficients(trajectories, normalisation)
    pairs = zip(trajectories, coefficients, strict=True)
    return float(sum(-(c[1:] * logprobs[id(t)]).sum() for t, c in pairs if len(t) > 1))


def _check_tree_equals_flat(model, trajectories, dtype, budget, block, normalisation):
    tolerance = TOLERANCES[dtype]
    flat = run_mode(model, trajectories, "flat", budget, block, normalisation, "exact")
    tree = run_mode(model, trajectories, "tree", budget, block, normalisation, "exact")

    # 1-token trajectories have no predicted token; whether they get an (empty) entry is checked by
    # test_one_token_trajectory_beside_its_extension, so that this test keeps checking the rest
    assert set(flat.logprobs) | set(tree.logprobs) <= {id(t) for t in trajectories}
    for trajectory in trajectories:
        if len(trajectory) == 1:
            continue
        lp_flat, lp_tree = flat.logprobs[id(trajectory)], tree.logprobs[id(trajectory)]
        assert lp_flat.shape == lp_tree.shape == (len(trajectory) - 1,)
        assert np.all(np.isfinite(lp_flat)) and np.all(lp_flat <= 0)
        np.testing.assert_allclose(lp_tree, lp_flat, rtol=0, atol=tolerance, err_msg=trajectory.source)

    expected = _flat_objective(trajectories, flat.logprobs, normalisation)
    scale = max(abs(expected), 1e-30)
    assert abs(flat.loss - expected) <= tolerance * scale, (flat.loss, expected)
    assert abs(tree.loss - expected) <= tolerance * scale, (tree.loss, expected)

    names = {name for name, _ in model.named_parameters()}
    assert set(flat.gradients) == set(tree.gradients) == names
    _assert_gradients_equal(flat.gradients, tree.gradients, dtype)
    return flat, tree


def _assert_gradients_equal(flat: dict, tree: dict, dtype: torch.dtype) -> None:
    """Per parameter, the norm of the difference within the dtype's tolerance of the parameter's norm."""
    tolerance = TOLERANCES[dtype]
    total = torch.sqrt(sum(g.double().pow(2).sum() for g in flat.values())).item()
    for name, g_flat in flat.items():
        error = (tree[name].double() - g_flat.double()).norm().item()
        bound = tolerance * g_flat.double().norm().item() + GRADIENT_SLACK[dtype] * total
        assert error <= bound, f"{name}: gradient error {error:.3e} > {bound:.3e} (norm {g_flat.norm():.3e})"


def test_wrong_restoration_weight_fails_the_gradient_check(monkeypatch):
    """The float64 check is not blind to a restoration defect: one shared, trained prompt token whose
    weight counts one trajectory fewer (``mask_sum`` 2 instead of 3) fails it, and ``verify``'s
    per-parameter error is orders of magnitude above its 1e-10 tolerance."""
    model = _model("llama", torch.float64)
    prompt, mask = [5, 9, 17, 33, 65, 129, 257, 513], [0.0] * 4 + [1.0] * 4  # the prompt's tail is trained
    trajectories = [
        Trajectory(prompt + tail, mask + [1.0] * len(tail), group_id="g", source=f"t{i}")
        for i, tail in enumerate([[7, 8], [11, 12, 13], [19]])
    ]
    real = trie.restoration_sums

    def off_by_one(own, paths, n):
        sums = real(own, paths, n)
        if len(own) == 3:
            sums["mask_sum"][paths[0][5]] -= 1.0  # a trained prompt token on all three paths
        return sums

    flat = run_mode(model, trajectories, "flat", 4096, 1, "sum", "exact")
    _assert_gradients_equal(flat.gradients, run_mode(model, trajectories, "tree", 4096, 1, "sum", "exact").gradients,
                            torch.float64)  # fmt: skip
    monkeypatch.setattr(trie, "restoration_sums", off_by_one)
    tree = run_mode(model, trajectories, "tree", 4096, 1, "sum", "exact")
    with pytest.raises(AssertionError, match="gradient error"):
        _assert_gradients_equal(flat.gradients, tree.gradients, torch.float64)
    assert max(gradient_errors(flat.gradients, tree.gradients).values()) > 1e-4


@settings(max_examples=50, deadline=None)
@given(forests(), st.sampled_from(["split", "whole"]), st.sampled_from([1, 16]))
@pytest.mark.parametrize("normalisation", NORMALISATIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tree_equals_flat(name, dtype, normalisation, trajectories, budget_kind, block):
    budget = longest(trajectories) if budget_kind == "split" else 4096
    _check_tree_equals_flat(_model(name, dtype), trajectories, dtype, budget, block, normalisation)


@settings(max_examples=80, deadline=None)
@given(forests(), st.sampled_from(NORMALISATIONS), st.data())
def test_tree_equals_flat_qwen3_float64_random_budget(trajectories, normalisation, data):
    """Budgets anywhere between the longest trajectory and everything: splits of every shape."""
    budget = data.draw(st.integers(longest(trajectories), max(longest(trajectories), 300)), "budget")
    _check_tree_equals_flat(_model("qwen3", torch.float64), trajectories, torch.float64, budget, 1, normalisation)


@settings(max_examples=40, deadline=None)
@given(forests(), st.sampled_from(["token_mean", "sum"]), st.sampled_from(["split", "whole"]))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_dedup_counts_each_distinct_token_once(name, trajectories, normalisation, budget_kind):
    model = _model(name, torch.float64)
    budget = longest(trajectories) if budget_kind == "split" else 4096
    flat = run_mode(model, trajectories, "flat", budget, 1, normalisation, "exact")
    tree = run_mode(model, trajectories, "tree", budget, 1, normalisation, "dedup")

    # brute force: every distinct (group, prefix) once, with its largest coefficient
    distinct: dict[tuple, tuple[float, float]] = {}
    for trajectory in trajectories:
        for t in range(1, len(trajectory)):
            logprobs = flat.logprobs[id(trajectory)]
            key = prefix_key(trajectory, t + 1)
            coefficient = float(trajectory.loss_mask[t])
            if key in distinct:
                np.testing.assert_allclose(distinct[key][1], logprobs[t - 1], rtol=0, atol=1e-10)
                coefficient = max(coefficient, distinct[key][0])
            distinct[key] = (coefficient, float(logprobs[t - 1]))
    loss = -sum(c * lp for c, lp in distinct.values())
    if normalisation == "token_mean":
        denominator = sum(c for c, _ in distinct.values())
        loss = loss / denominator if denominator > 0 else 0.0
    assert tree.loss == pytest.approx(loss, rel=1e-10, abs=1e-300)


@settings(max_examples=8, deadline=None)
@given(forests(max_groups=2))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_compare_report(name, trajectories):
    """The verification report of ``compare`` agrees with the checks above and with the data.

    1-token trajectories are left out here: ``compare`` fails on some of them (see
    test_one_token_trajectory_beside_its_extension). ``passed`` is checked last: it also fails
    when some parameter's exact gradient is 0 (see test_compare_passes_when_attention_gradients_vanish).
    """
    trajectories = [t for t in trajectories if len(t) > 1]
    assume(trajectories)
    report = compare(trajectories, MODELS[name], dtype="float64", seed=3, budget=longest(trajectories))
    assert report["n_trajectories"] == len(trajectories)
    assert report["flat_tokens"] == sum(len(t) for t in trajectories)
    prefixes = {prefix_key(t, n) for t in trajectories for n in range(1, len(t) + 1)}
    assert report["tree_tokens"] == len(prefixes)
    assert report["ideal_speedup"] == pytest.approx(report["flat_tokens"] / len(prefixes))
    assert report["loss_tree"] == pytest.approx(report["loss_flat"], rel=1e-10, abs=1e-300)
    assert report["max_abs_logprob_err"] <= 1e-10
    assert report["passed"] is True, (report["worst_parameter"], report["max_rel_grad_err"])


def test_one_token_trajectory_beside_its_extension():
    """A 1-token trajectory is a trajectory too: both modes report its (empty) log-probs.

    With budget 2 the flat baseline puts [3] alone in a row that has no predicted token, while
    tree mode merges it into [3, 4]; the two modes must still agree on which trajectories exist.
    """
    trajectories = [Trajectory([3], [1.0], "g", source="a:1"), Trajectory([3, 4], [1.0, 1.0], "g", source="a:2")]
    model = _model("llama", torch.float64)
    for mode in ("flat", "tree"):
        result = run_mode(model, trajectories, mode, 2, 1, "token_mean", "exact")
        assert set(result.logprobs) == {id(t) for t in trajectories}, mode
        assert result.logprobs[id(trajectories[0])].shape == (0,)
    report = compare(trajectories, MODELS["llama"], dtype="float64", budget=2)
    assert report["passed"] is True


@pytest.mark.parametrize("name", sorted(MODELS))
def test_compare_passes_when_attention_gradients_vanish(name):
    """Repeated equal tokens: every position holds the same hidden state, so the exact q/k
    projection gradients are 0 and both modes hold only round-off there. The report must judge
    those against the scale of the whole gradient, not their own (round-off / round-off).
    (Likewise when only position 0, a softmax over one key, predicts trained tokens.)"""
    trajectories = [Trajectory([3, 3], [1.0, 1.0], "g"), Trajectory([3, 3], [1.0, 0.5], "g")]
    report = compare(trajectories, MODELS[name], dtype="float64", budget=2)
    assert report["passed"] is True, (report["worst_parameter"], report["max_rel_grad_err"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_target_logprobs_match_hugging_face(name, dtype):
    """Gather-before-head on a plain sequence == log_softmax of HF logits, with tree attention
    (kv_end = N) and with transformers' own SDPA attention on the same weights."""
    model = _model(name, dtype)
    ids = np.random.default_rng(random.randrange(2**63)).integers(3, 1024, size=45)
    (tree,) = build_trees([Trajectory(ids, np.ones(ids.size))])
    row = assemble_row([whole_tree(tree)])
    targets = np.arange(1, ids.size)
    with torch.no_grad():
        ours = target_logprobs(model, row, targets).double()
        input_ids = torch.as_tensor(ids)[None]
        logits = model(input_ids=input_ids, kv_end=torch.full((1, ids.size), ids.size)).logits[0]
        hf_tree = torch.log_softmax(logits.double(), -1)[:-1].gather(1, input_ids[0, 1:, None])[:, 0]

        sdpa_model = AutoModelForCausalLM.from_config(model.config, attn_implementation="sdpa").to(dtype)
        sdpa_model.load_state_dict(model.state_dict())
        if dtype == torch.float64:
            keep_norms_in_float64(sdpa_model)
        sdpa_model.eval()
        hf_logits = sdpa_model(input_ids=input_ids, use_cache=False).logits[0]
        hf_sdpa = torch.log_softmax(hf_logits.double(), -1)[:-1].gather(1, input_ids[0, 1:, None])[:, 0]
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(ours, hf_tree, rtol=0, atol=tolerance)
    torch.testing.assert_close(ours, hf_sdpa, rtol=0, atol=tolerance)
