"""The flex engine (PyTorch's FlexAttention on the ``kv_end`` mask) on the CPU: forward only.

torch 2.13 has no FlexAttention backward on the CPU (pinned below, so that the day it gains one
these tests say so). The forward is checked against the dense float64 reference on the same
hypothesis forests as the block-sparse engine (several trees and split parts per row, padding,
windows down to 1 token, soft caps, GQA), with and without the padding to a length bucket that the
compiled GPU path uses; models through transformers (dense, sliding-window, soft-capped) give the
flat baseline's loss and log-probs in tree mode and the ``torch`` engine's flat loss; training and
verification say plainly what they cannot do. The compiled kernel and the backward are for a GPU
(docs/KERNEL.md).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_tree.attention.flex import FlexBackwardUnavailable, flex_tree_attention, length_bucket
from ds_tree.attention.reference import tree_attention_reference
from ds_tree.attention.registry import has_backward, tree_attention
from ds_tree.cli import verify
from ds_tree.verify.tree_vs_flat import compare
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest
from tests.helpers.runs import dry_run
from tests.helpers.strategies import forests, longest
from tests.test_attention import GQA, TOLERANCES, _assert_close, _random_inputs, _rows_kv_end
from tests.test_sliding_window import _forest
from tests.test_sliding_window import model_configs as model_configs  # noqa: F401 - the fixture

LLAMA = "configs/models/tiny_llama.json"


@settings(max_examples=20, deadline=None)
@given(forests(), st.data(), st.sampled_from([torch.float64, torch.float32]), st.sampled_from(GQA), st.booleans())
def test_forward_matches_reference(trajectories, data, dtype, heads, bucketed):
    budget = data.draw(st.integers(longest(trajectories), max(longest(trajectories), 300)), "budget")
    pad_block = data.draw(st.sampled_from([1, 8, 16]), "pad_block")
    batch = data.draw(st.integers(1, 2), "batch")
    head_dim = data.draw(st.sampled_from([8, 16]), "head_dim")
    kv_end, positions = _rows_kv_end(trajectories, budget, pad_block, batch)
    depth = int(positions.max()) + 1
    window = data.draw(st.one_of(st.none(), st.integers(1, max(1, depth - 1))), "window")
    softcap = data.draw(st.sampled_from([None, None, 0.5, 30.0]), "softcap")
    options = {"positions": positions, "window": window, "softcap": softcap}
    heads_q, heads_kv = heads
    seed = random.randrange(2**31)
    (q, k, v), _ = _random_inputs(seed, kv_end.shape[0], heads_q, heads_kv, kv_end.shape[1], head_dim, dtype)
    with torch.no_grad():
        expected = tree_attention_reference(q, k, v, kv_end, **options)
        actual = flex_tree_attention(q, k, v, kv_end, bucketed=bucketed, **options)
    assert actual.shape == expected.shape and actual.dtype == dtype
    _assert_close("out", actual, expected, TOLERANCES[dtype], seed)


@pytest.mark.parametrize("n", [1, 2, 37, 128, 129])
def test_one_token_rows_and_bucket_edges(n):
    """A chain of 1-token nodes (the deepest tree of n tokens), at and around a bucket edge."""
    assert length_bucket(n) >= max(n, 128) and length_bucket(n) < 2 * max(n, 128)
    kv_end = torch.full((1, n), n)
    (q, k, v), _ = _random_inputs(0, 1, 4, 2, n, 8, torch.float64)
    with torch.no_grad():
        expected = tree_attention_reference(q, k, v, kv_end)
        _assert_close("registry", tree_attention(q, k, v, kv_end, engine="flex"), expected, 1e-12, 0)
        _assert_close("bucketed", flex_tree_attention(q, k, v, kv_end, bucketed=True), expected, 1e-12, 0)


def test_no_backward_on_the_cpu():
    """torch itself refuses (the fact the engine's refusal rests on); the engine names what to do."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        flex_attention(q, q, q)
    with pytest.raises(FlexBackwardUnavailable, match="train on the CPU with attention: torch"):
        flex_tree_attention(q, q, q, torch.full((1, 4), 4))
    assert not has_backward("flex", "cpu") and has_backward("flex", "cuda") and has_backward("torch", "cpu")


@pytest.mark.parametrize("name", ["llama", "gemma2"])  # dense; sliding and full layers with a soft cap
def test_verify_checks_loss_and_logprobs_not_gradients(name, model_configs):  # noqa: F811
    """Tree equals flat in float64 on loss and every log-prob through real transformers models
    (Gemma2: sliding-window layers and a soft cap), and flex's flat loss is the torch engine's."""
    source = LLAMA if name == "llama" else model_configs[name]
    report = compare(_forest(1), source, dtype="float64", budget=128, block=8, attention="flex")
    assert report["gradients_checked"] is False and report["max_rel_grad_err"] is None
    assert "gradients were NOT" in report["gradients_not_checked_because"]
    assert report["tree_tokens"] < report["flat_tokens"]
    assert report["loss_rel_err"] <= 1e-10 and report["max_abs_logprob_err"] <= 1e-10, report
    assert report["passed"] is True
    torch_report = compare(_forest(1), source, dtype="float64", budget=128, block=8, attention="torch")
    assert torch_report["gradients_checked"] is True
    assert abs(report["loss_flat"] - torch_report["loss_flat"]) <= 1e-10 * abs(torch_report["loss_flat"])


def test_verify_cli_reports_gradients_not_checked(tmp_path, capsys):
    data = write_forest(tmp_path / "forest.jsonl")
    argv = ["--data", str(data), "--model", LLAMA, "--attention", "flex", "--budget", "256", "--limit", "6"]
    assert verify.main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["gradients_checked"] is False and report["attention"] == "flex" and report["passed"] is True
    assert "warning: attention 'flex' has no backward on the CPU" in captured.err
    for refused in (["--objective", "grpo"], ["--sequence-parallel", "2"]):
        with pytest.raises(SystemExit) as exit_info:
            verify.main([*argv, *refused])
        assert exit_info.value.code == 2
        assert "--attention flex has no backward on the CPU" in capsys.readouterr().err
    assert verify.main([*argv, "--dfs-chunk", "8"]) == 2
    assert "dfs mode cannot be checked" in capsys.readouterr().err


def test_training_with_flex_on_a_cpu_is_refused_at_dry_run(monkeypatch, capsys, tmp_path):
    config = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = dry_run(monkeypatch, capsys, config, "model.attention=flex")
    assert code == 2 and "model.attention: flex cannot train on the CPU" in err, err
    assert "FlexAttention does not support backward on CPU" in err and "use torch on the CPU" in err


def test_benchmarks_time_the_flex_forward_and_say_so(tmp_path, capsys):
    """bench-attention --engine flex and bench-kernel --flex on the CPU: forward only, labelled."""
    from ds_tree.cli.bench import main as bench_main
    from ds_tree.cli.bench_attention import main as attention_main
    from ds_tree.cli.bench_kernel import main as kernel_main

    data = write_forest(tmp_path / "forest.jsonl")
    with pytest.raises(SystemExit) as exit_info:  # training steps: no backward on the CPU
        bench_main(["--data", str(data), "--model", LLAMA, "--attention", "flex"])
    assert exit_info.value.code == 2 and "use --device cuda" in capsys.readouterr().err
    argv = ["--data", str(data), "--budget", "256", "--repeats", "2", "--heads", "2", "--head-dim", "8"]
    assert attention_main([*argv, "--engine", "flex"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["engine"] == "flex"
    for mode in ("flat", "tree"):
        assert report["modes"][mode]["timed"] == "forward only" and report["modes"][mode]["computed_scores"] is None
        assert report["modes"][mode]["min_ms"] > 0 and report["modes"][mode]["visible_pairs"] > 0
    argv = ["--trees", "2", "--depth", "2", "--branching", "2", "--node-len", "4", "--heads", "2", "--kv-heads", "1"]
    assert kernel_main([*argv, "--head-dim", "16", "--dtype", "float32", "--flex"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tree"]["timed"] == "forward+backward"
    for layout in ("tree", "flat"):
        assert report[f"flex_{layout}"]["timed"] == "forward only"
        assert report[f"flex_{layout}"]["tokens"] == report[layout]["tokens"]
