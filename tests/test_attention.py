"""Block-sparse tree attention against the dense reference, forward and dq/dk/dv.

Masks come from real packed rows of hypothesis forests (several trees and parts per row, padding
to a block multiple); the block size of the attention engine is drawn independently, including
sizes that do not divide the row. Half the examples add a sliding window shorter than the
deepest token (on the rows' own depths) and some a soft cap on the scores. q/k/v and the output
gradient come from a seed that tests/conftest.py fixes per test (fresh every run under
HYPOTHESIS_PROFILE=explore); a failure message carries the seed to replay it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_tree.attention.blocksparse import block_plan, blocksparse_tree_attention
from ds_tree.attention.reference import tree_attention_reference, visibility_mask
from ds_tree.attention.registry import tree_attention
from ds_tree.models.loading import load_model
from ds_tree.packing.modes import pack_trajectories
from tests.helpers.strategies import forests, longest

# float64 round-off of a softmax over <= 300 keys stays ~1e-15; float32 ~1e-7.
TOLERANCES = {torch.float64: 1e-12, torch.float32: 1e-5}
GQA = [(2, 2), (4, 2), (4, 1)]  # (query heads, kv heads): ratios 1, 2, 4


def _run(function, inputs, kv_end, grad_out, **options):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = function(*leaves, kv_end, **options)
    out.backward(grad_out)
    return [out.detach()] + [x.grad for x in leaves]


def _random_inputs(seed, batch, heads_q, heads_kv, n, head_dim, dtype):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads_q, n, head_dim), (batch, heads_kv, n, head_dim), (batch, heads_kv, n, head_dim)]
    inputs = [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in shapes]
    grad_out = torch.randn(batch, n, heads_q, head_dim, generator=generator, dtype=torch.float64).to(dtype)
    return inputs, grad_out


def _rows_kv_end(trajectories, budget, pad_block, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_end and positions of up to ``batch`` packed rows, padded alike (padding sees only itself,
    depth 0) to one length."""
    rows = pack_trajectories(trajectories, "tree", budget, pad_block)[:batch]
    n = max(row.n_tokens for row in rows)
    ends = [np.concatenate([row.kv_end, np.arange(row.n_tokens, n) + 1]) for row in rows]
    positions = [np.concatenate([row.position_ids, np.zeros(n - row.n_tokens, dtype=np.int64)]) for row in rows]
    return torch.as_tensor(np.stack(ends)), torch.as_tensor(np.stack(positions))


def _assert_close(name, actual, expected, tolerance, seed):
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= tolerance * max(scale, 1.0), f"{name}: max error {error:.3e} (scale {scale:.3e}, seed {seed})"


@settings(max_examples=200, deadline=None)
@given(
    forests(),
    st.data(),
    st.sampled_from([torch.float64, torch.float32]),
    st.sampled_from(GQA),
    st.sampled_from([1, 3, 7, 16, 33, 64, 128, 512]),
)
def test_blocksparse_matches_reference(trajectories, data, dtype, heads, block):
    budget = data.draw(st.integers(longest(trajectories), max(longest(trajectories), 300)), "budget")
    pad_block = data.draw(st.sampled_from([1, 8, 16]), "pad_block")
    batch = data.draw(st.integers(1, 2), "batch")
    head_dim = data.draw(st.sampled_from([8, 16]), "head_dim")
    # small hub thresholds put shared runs on the hub path in most forests; the defaults in some
    hub_min_keys = data.draw(st.sampled_from([1, 2, 5, 64]), "hub_min_keys")
    hub_min_queries = data.draw(st.sampled_from([1, 3, 128]), "hub_min_queries")
    kv_end, positions = _rows_kv_end(trajectories, budget, pad_block, batch)
    # windows shorter than the deepest path, down to 1 (each token sees only itself)
    depth = int(positions.max()) + 1
    window = data.draw(st.one_of(st.none(), st.integers(1, max(1, depth - 1))), "window")
    softcap = data.draw(st.sampled_from([None, None, 0.5, 30.0]), "softcap")
    options = {"positions": positions, "window": window, "softcap": softcap}
    heads_q, heads_kv = heads
    seed = random.randrange(2**31)
    inputs, grad_out = _random_inputs(seed, kv_end.shape[0], heads_q, heads_kv, kv_end.shape[1], head_dim, dtype)

    expected = _run(tree_attention_reference, inputs, kv_end, grad_out, **options)
    actual = _run(
        lambda q, k, v, e, **options: blocksparse_tree_attention(
            q, k, v, e, block=block, hub_min_keys=hub_min_keys, hub_min_queries=hub_min_queries, **options
        ),
        inputs,
        kv_end,
        grad_out,
        **options,
    )
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == dtype
        _assert_close(name, a, e, TOLERANCES[dtype], seed)


def test_hubs_take_shared_runs_out_of_the_blocks():
    """A 100-token prompt under four 60-token branches: one hub, whose keys no later block gathers,
    and the result still equals the reference."""
    prompt, branch = 100, 60
    n = prompt + 4 * branch
    kv_end = np.full(n, n)
    for i in range(4):
        start = prompt + i * branch
        kv_end[start : start + branch] = start + branch
    plan = block_plan(kv_end, 16, hub_min_keys=64, hub_min_queries=128)
    assert [(h.keys, h.query) for h in plan.hubs] == [(slice(0, 100), slice(112, n))]
    for task in plan.tasks:
        keys = np.arange(n)[task.keys]
        if task.query.start >= 112:
            assert keys.min() >= prompt
        else:
            assert keys.min() == 0
    seed = random.randrange(2**31)
    inputs, grad_out = _random_inputs(seed, 1, 4, 2, n, 8, torch.float64)
    kv_end = torch.as_tensor(kv_end)[None]
    expected = _run(tree_attention_reference, inputs, kv_end, grad_out)
    actual = _run(lambda q, k, v, e: blocksparse_tree_attention(q, k, v, e, block=16), inputs, kv_end, grad_out)
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected, strict=True):
        _assert_close(name, a, e, TOLERANCES[torch.float64], seed)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("engine", ["reference", "torch"])
@pytest.mark.parametrize("heads_q,heads_kv", GQA)
@pytest.mark.parametrize("n", [1, 37, 130])
def test_causal_equals_torch_sdpa(engine, heads_q, heads_kv, n, dtype):
    """kv_end = N is a plain causal sequence: torch's own causal SDPA (k/v heads repeated)."""
    seed = random.randrange(2**31)
    inputs, grad_out = _random_inputs(seed, 2, heads_q, heads_kv, n, 16, dtype)
    kv_end = torch.full((2, n), n, dtype=torch.int64)

    def sdpa(query, key, value, _kv_end):
        group = heads_q // heads_kv
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(query, key, value, is_causal=True).transpose(1, 2)

    expected = _run(sdpa, inputs, kv_end, grad_out)
    actual = _run(lambda q, k, v, e: tree_attention(q, k, v, e, engine=engine), inputs, kv_end, grad_out)
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected, strict=True):
        _assert_close(name, a, e, TOLERANCES[dtype], seed)


def test_reference_is_softmax_over_ancestors():
    """The oracle itself, on a hand-built tree: root [0 1], children [2] and [3 4], padding 5."""
    kv_end = torch.tensor([[5, 5, 3, 5, 5, 6]])
    ancestors = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 3], 4: [0, 1, 3, 4], 5: [5]}
    seed = random.randrange(2**31)
    (query, key, value), _ = _random_inputs(seed, 1, 2, 1, 6, 4, torch.float64)
    out = tree_attention_reference(query, key, value, kv_end, scale=0.5)
    for q, visible in ancestors.items():
        scores = (query[0, :, q] @ key[0, 0, visible].T) * 0.5
        expected = torch.softmax(scores, -1) @ value[0, 0, visible]
        torch.testing.assert_close(out[0, q], expected, rtol=1e-12, atol=1e-12)


def test_rejects_heads_that_do_not_group():
    inputs, _ = _random_inputs(0, 1, 3, 2, 4, 8, torch.float64)
    kv_end = torch.full((1, 4), 4)
    for function in (tree_attention_reference, blocksparse_tree_attention):
        with pytest.raises(ValueError, match="multiple"):
            function(*inputs, kv_end)


def test_model_without_kv_end_raises_clear_error():
    model = load_model("configs/models/tiny_llama.json", attention="torch", dtype="float32")
    input_ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match=r"tree_torch.*kv_end"):
        model(input_ids=input_ids)
    # and with it the same model runs
    assert model(input_ids=input_ids, kv_end=torch.full((1, 4), 4)).logits.shape == (1, 4, 1024)


def test_reference_window_and_softcap_by_hand():
    """The oracle's window and soft cap on the hand-built tree: depths [0 1 2 2 3 0], window 2."""
    kv_end = torch.tensor([[5, 5, 3, 5, 5, 6]])
    positions = torch.tensor([[0, 1, 2, 2, 3, 0]])
    in_window = {0: [0], 1: [0, 1], 2: [1, 2], 3: [1, 3], 4: [3, 4], 5: [5]}
    seed = random.randrange(2**31)
    (query, key, value), _ = _random_inputs(seed, 1, 2, 1, 6, 4, torch.float64)
    out = tree_attention_reference(query, key, value, kv_end, scale=0.5, positions=positions, window=2, softcap=0.7)
    for q, visible in in_window.items():
        scores = 0.7 * torch.tanh((query[0, :, q] @ key[0, 0, visible].T) * 0.5 / 0.7)
        expected = torch.softmax(scores, -1) @ value[0, 0, visible]
        torch.testing.assert_close(out[0, q], expected, rtol=1e-12, atol=1e-12)


def test_window_plan_gathers_only_keys_in_the_window():
    """A 200-token chain with window 8 and 16-token blocks: each block gathers its 16 queries' keys
    and the 7 before them, nothing older; the visible pairs are the reference mask's."""
    n, window, block = 200, 8, 16
    kv_end = np.full(n, n)
    positions = np.arange(n)
    plan = block_plan(kv_end, block, hub_min_keys=1, hub_min_queries=1, positions=positions, window=window)
    assert not plan.hubs  # no run is within the window of all its later queries
    for task in plan.tasks:
        keys = np.arange(n)[task.keys]
        assert keys.min() == max(0, task.query.start - window + 1) and keys.max() == task.query.stop - 1
    mask = visibility_mask(torch.as_tensor(kv_end)[None], torch.as_tensor(positions)[None], window)
    assert plan.visible_pairs == int(mask.sum()) == n * window - window * (window - 1) // 2
    assert plan.computed_scores() < n * (block + window)


def test_window_errors_name_what_is_missing():
    inputs, _ = _random_inputs(0, 1, 2, 2, 4, 8, torch.float64)
    kv_end = torch.full((1, 4), 4)
    for function in (tree_attention_reference, blocksparse_tree_attention):
        with pytest.raises(ValueError, match="position_ids"):
            function(*inputs, kv_end, window=2)
        with pytest.raises(ValueError, match="at least 1"):
            function(*inputs, kv_end, positions=torch.arange(4)[None], window=0)
