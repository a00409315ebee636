"""The ``varlen`` engine (flat rows on flash kernels) and ``model.attention: auto``.

On the CPU: the segments (``cu_seqlens``) read off flat rows' ``kv_end`` against an independent
Python loop (hand-made rows with 1-token sequences and padding, batches of rows, and the packer's own
flat rows of hypothesis forests); tree rows refused; the CPU refused before any kernel; the
``resolve_engine`` rules, the ``auto`` default and where the config and the commands refuse varlen.
On a CUDA GPU (skipped here): forward and dq/dk/dv against the float64 reference on flat rows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_tree import train
from ds_tree.attention.reference import tree_attention_reference
from ds_tree.attention.registry import has_backward, resolve_engine, tree_attention
from ds_tree.attention.varlen import NotFlatError, VarlenUnavailable, flat_segments, kernel_name, varlen_attention
from ds_tree.config import ConfigError, ModelConfig, load_config
from ds_tree.models.loading import check_model_settings, load_model
from ds_tree.packing.modes import pack_trajectories
from ds_tree.registries import ATTENTION_ENGINES
from ds_tree.trees.trajectory import Trajectory
from tests.helpers import ROOT
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest
from tests.helpers.strategies import forests

CUDA = torch.cuda.is_available()


def segments_by_loop(kv_end: torch.Tensor) -> tuple[list[int], int]:
    """cu_seqlens and the longest segment, token by token (the independent oracle)."""
    cu, longest = [0], 0
    for row_index, row in enumerate(kv_end.tolist()):
        k = 0
        while k < len(row):
            end = row[k]
            assert k < end <= len(row) and all(row[j] == end for j in range(k, end)), (row_index, k)
            cu.append(row_index * len(row) + end)
            longest = max(longest, end - k)
            k = end
    return cu, longest


def flat_row(lengths: list[int], pad: int = 0) -> list[int]:
    """kv_end of sequences of ``lengths`` one after the other, then ``pad`` padding tokens."""
    kv_end, start = [], 0
    for length in [*lengths, *([1] * pad)]:
        kv_end += [start + length] * length
        start += length
    return kv_end


def assert_segments(kv_end: torch.Tensor) -> None:
    cu_seqlens, longest = flat_segments(kv_end)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.device == kv_end.device
    assert (cu_seqlens.tolist(), longest) == segments_by_loop(kv_end)


@pytest.mark.parametrize(
    "rows",
    [
        [[5]],  # one causal sequence
        [[1, 1, 1]],  # 1-token sequences only
        [[3, 1, 4, 1, 5]],
        [[1]],
    ],
)
@pytest.mark.parametrize("pad", [0, 1, 3])
def test_segments_of_hand_made_flat_rows(rows, pad):
    assert_segments(torch.tensor([flat_row(lengths, pad) for lengths in rows]))


def test_segments_of_two_rows_padded_alike():
    first, second = flat_row([4, 2], pad=3), flat_row([1, 7, 1])
    assert len(first) == len(second) == 9
    kv_end = torch.tensor([first, second])
    assert_segments(kv_end)
    cu_seqlens, longest = flat_segments(kv_end)
    assert cu_seqlens.tolist() == [0, 4, 6, 7, 8, 9, 10, 17, 18] and longest == 7


@given(
    st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=5), min_size=1, max_size=3),
    st.integers(0, 4),
    st.sampled_from([torch.int64, torch.int32]),
)
@settings(max_examples=60, deadline=None)
def test_segments_match_the_loop(rows, pad, dtype):
    rows = [flat_row(lengths) for lengths in rows]
    n = max(len(row) for row in rows) + pad
    padded = [row + list(range(len(row) + 1, n + 1)) for row in rows]  # padding: kv_end = k + 1
    assert_segments(torch.tensor(padded, dtype=dtype))


@given(forests(), st.sampled_from([1, 4, 16]))
@settings(max_examples=30, deadline=None)
def test_segments_of_the_packers_flat_rows(trajectories, block):
    budget = max(len(t) for t in trajectories) + 8
    for row in pack_trajectories(trajectories, "flat", budget, block):
        kv_end = torch.as_tensor(row.kv_end)[None]
        assert_segments(kv_end)
        # the window on depths is the flash window on offsets: a flat row's depths are the offsets
        assert offsets(kv_end)[0].tolist() == row.position_ids.tolist()


def shared_prefix_trajectories() -> list[Trajectory]:
    stem = [5, 6, 7, 8]
    paths = [stem + [9, 10], stem + [11, 12, 13], [20, 21, 22]]
    return [Trajectory(np.array(p), np.ones(len(p)), group_id="g" if p[0] == 5 else "h") for p in paths]


def test_tree_rows_are_refused():
    rows = pack_trajectories(shared_prefix_trajectories(), "tree", budget=64, block=5)
    assert len(rows) == 1 and rows[0].n_tokens == 15  # 9 + 3 tree tokens and 3 of padding
    kv_end = torch.as_tensor(rows[0].kv_end)[None]
    with pytest.raises(NotFlatError, match=r"runs flat rows only.*torch, flex or triton engine for tree rows"):
        flat_segments(kv_end)
    q = torch.randn(1, 2, kv_end.shape[1], 8)
    with pytest.raises(ValueError, match="flat rows only"):  # before the device is looked at
        tree_attention(q, q, q, kv_end, engine="varlen")
    flat = pack_trajectories(shared_prefix_trajectories(), "flat", budget=64, block=5)
    assert_segments(torch.as_tensor(flat[0].kv_end)[None])


@pytest.mark.parametrize(
    "kv_end",
    [
        [[3, 3, 2]],  # a key that ends before itself
        [[2, 2, 4, 5]],  # past the row
        [[3, 3, 3, 3]],  # a segment that stops early without its tokens ending there
        [[4, 2, 4, 4]],  # a 1-token child inside a root's range
    ],
)
def test_invalid_rows_are_refused(kv_end):
    with pytest.raises(NotFlatError, match="flat rows only"):
        flat_segments(torch.tensor(kv_end))


@pytest.mark.skipif(CUDA, reason="the CPU refusal")
def test_the_cpu_is_refused_before_any_kernel():
    kv_end = torch.tensor([flat_row([3, 2], pad=1)])
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    for function in (varlen_attention, lambda *a: tree_attention(*a, engine="varlen")):
        with pytest.raises(VarlenUnavailable, match="needs a CUDA GPU.*use the torch engine on the CPU"):
            function(q, k, k, kv_end)
    assert not has_backward("varlen", "cpu") and has_backward("varlen", "cuda")


def test_window_needs_offsets_counting_up():
    kv_end = torch.tensor([flat_row([3, 2])])
    q = torch.randn(1, 1, 5, 8)
    with pytest.raises(NotFlatError, match="position_ids must count up by one"):
        varlen_attention(q, q, q, kv_end, positions=torch.tensor([[0, 1, 1, 0, 1]]), window=2)
    with pytest.raises(VarlenUnavailable):  # offsets fine: refused for the CPU (or float32 on a GPU)
        varlen_attention(q, q, q, kv_end, positions=torch.tensor([[0, 1, 2, 0, 1]]), window=2)


# ------------------------------------------------------------------- auto and the config


def test_resolve_engine_rules(monkeypatch):
    assert resolve_engine("auto", "cpu") == "torch"
    assert resolve_engine("auto", "cuda") == resolve_engine("auto", torch.device("cuda", 1)) == "flex"
    for engine in ATTENTION_ENGINES.names():
        assert resolve_engine(engine, "cpu") == resolve_engine(engine, "cuda") == engine
    for available, engine in ((False, "torch"), (True, "flex")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        assert resolve_engine("auto") == engine
    with pytest.raises(ValueError, match=r"unknown attention engine 'flash'; choose one of auto, .*varlen"):
        resolve_engine("flash", "cpu")


def test_auto_is_the_default(tmp_path):
    assert ModelConfig(source="model.json").attention == "auto"
    config = load_config(write_config(tmp_path, write_forest(tmp_path / "forest.jsonl")))
    assert config.model.attention == "auto"


@pytest.fixture
def forest_config(tmp_path):
    return write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"))


def test_auto_resolves_to_torch_in_a_cpu_training_config(monkeypatch, capsys, forest_config):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(ROOT)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    assert train.main(["--config", str(forest_config), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["attention_engine"] == "torch"
    source = ROOT / "configs/models/tiny_llama.json"
    assert load_model(source, attention="auto").config._attn_implementation == "tree_torch"
    assert load_model(source, attention="auto", device="cuda").config._attn_implementation == "tree_flex"


def test_check_model_settings_refuses_varlen_where_it_cannot_run(monkeypatch, forest_config):
    def settings(*overrides):
        check_model_settings(load_config(forest_config, ["model.attention=varlen", *overrides]))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"model.attention: varlen runs flat rows only.*packing.mode is tree"):
        settings("model.dtype=bfloat16")
    with pytest.raises(ConfigError, match=r"packing.mode is dfs: set packing.mode: flat"):
        settings("model.dtype=bfloat16", "packing.mode=dfs")
    with pytest.raises(ConfigError, match=r"model.attention: varlen needs model.dtype: bfloat16.*got float32"):
        settings("packing.mode=flat")
    settings("packing.mode=flat", "model.dtype=bfloat16")  # a GPU, flat rows, bf16: accepted
    check_model_settings(load_config(forest_config))  # auto with a GPU: flex
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"model.attention: varlen needs a CUDA GPU and none is visible"):
        settings("packing.mode=flat", "model.dtype=bfloat16")
    check_model_settings(load_config(forest_config))  # auto without a GPU: torch


def test_commands_resolve_auto_and_refuse_varlen(capsys):
    from ds_tree.cli import bench, verify

    common = ["--data", "missing.jsonl", "--model", "missing.json"]
    for main, extra, message in (
        (verify.main, [], "verify compares tree rows on the CPU"),
        (bench.main, ["--device", "cuda"], "varlen runs flat rows only: use --modes flat"),
        (bench.main, ["--modes", "flat"], "varlen needs a CUDA GPU"),
    ):
        with pytest.raises(SystemExit) as stop:
            main([*common, "--attention", "varlen", *extra])
        assert stop.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------- on a CUDA GPU

ROWS = [
    [[7, 1, 30, 2], [1, 1, 1, 37]],  # B = 2: 1-token sequences, padding-like segments
    [[300, 45, 1, 1, 200]],  # long sequences, several kernel tiles
    [[64, 64, 64, 64]],
]


def padded_rows(rows: list[list[int]]) -> torch.Tensor:
    rows = [flat_row(lengths) for lengths in rows]
    n = max(len(row) for row in rows) + 3
    return torch.tensor([row + list(range(len(row) + 1, n + 1)) for row in rows])


def offsets(kv_end: torch.Tensor) -> torch.Tensor:
    """The depths of a flat row: each token's offset in its sequence."""
    index = torch.arange(kv_end.shape[1])
    starts = (kv_end == index + 1).roll(1, dims=1)
    starts[:, 0] = True
    start_of = torch.cummax(torch.where(starts, index, 0), dim=1).values
    return index - start_of


@pytest.mark.skipif(not CUDA, reason="flash kernels run on a CUDA GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("window", [None, 5])
def test_varlen_matches_the_reference_on_a_gpu(dtype, heads, rows, window):
    """Forward and dq/dk/dv against the float64 reference; the error is at most twice the one the
    reference engine itself makes in ``dtype`` (plus a floor), as the Triton tests bound theirs."""
    kv_end = padded_rows(rows).cuda()
    batch, n = kv_end.shape
    options = {} if window is None else {"window": window, "positions": offsets(kv_end.cpu()).cuda()}
    heads_q, heads_kv = heads
    inputs = [torch.randn(batch, h, n, 64, device="cuda", dtype=torch.float64) for h in (heads_q, heads_kv, heads_kv)]
    grad_out = torch.randn(batch, n, heads_q, 64, device="cuda", dtype=torch.float64)

    def run(function, precision):
        leaves = [x.detach().clone().to(precision).requires_grad_() for x in inputs]
        out = function(*leaves, kv_end, 0.125, **options)
        out.backward(grad_out.to(precision))
        return [out.detach().double()] + [x.grad.double() for x in leaves]

    exact = run(tree_attention_reference, torch.float64)
    low = run(tree_attention_reference, dtype)
    actual = run(varlen_attention, dtype)
    for name, e, lo, a in zip(("out", "dq", "dk", "dv"), exact, low, actual, strict=True):
        bound = 2 * (lo - e).abs().max().item() + 1e-3 * e.abs().max().item()
        assert (a - e).abs().max().item() <= bound, (name, kernel_name(), (a - e).abs().max().item(), bound)


@pytest.mark.skipif(not CUDA, reason="flash kernels run on a CUDA GPU only")
def test_varlen_refuses_float32_and_a_cap_without_flash_attn():
    kv_end = padded_rows([[5, 3]]).cuda()
    q = torch.randn(1, 2, kv_end.shape[1], 64, device="cuda")
    with pytest.raises(VarlenUnavailable, match="float16 or bfloat16"):
        varlen_attention(q, q, q, kv_end)
    if kernel_name() == "torch":
        q = q.bfloat16()
        with pytest.raises(VarlenUnavailable, match="no soft-capping"):
            varlen_attention(q, q, q, kv_end, softcap=30.0)
