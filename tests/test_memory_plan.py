"""The memory planner (ds_tree/memory/predict.py, ``ds-tree plan``): its arithmetic against hand-computed
cases, and its activation prediction against the peak measured on this CPU for a small model.

The measured case is deterministic (one row, the same allocations every run): the torch profiler's
allocation and free events of one forward and backward, after a warm-up step so that the parameter
gradients already exist. docs/MEMORY.md states the planner's error over a grid of budgets and modes;
``DOCUMENTED_ERROR`` is the bound written there.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from ds_tree.cli.plan import main as plan_main
from ds_tree.engine.dfs import DfsSettings
from ds_tree.losses.sft import Normalisers
from ds_tree.memory.predict import (
    ModelShape,
    RowNodes,
    activation_bytes,
    dfs_activation_bytes,
    largest_budget,
    largest_dfs_path,
    layer_bytes_per_token,
    profiled_peak_bytes,
    state_bytes,
)
from ds_tree.models.loading import load_config, load_model
from ds_tree.models.logprobs import predicted_tokens, target_logprobs
from ds_tree.objectives.sft import run_rows
from ds_tree.packing.modes import pack_trajectories
from ds_tree.trees.trajectory import Trajectory

BENCH = "configs/models/bench_llama.json"
DOCUMENTED_ERROR = 0.05
"""docs/MEMORY.md: the predicted activation peak is within 5% of the measured one."""
SHAPE = ModelShape(
    vocab=100, hidden=8, intermediate=16, layers=4, heads=2, kv_heads=1, head_dim=4, parameters=1000, largest_module=200
)


def test_parameters_counted_from_the_config():
    shape = ModelShape.of(load_config(BENCH))
    # embedding and untied head 1024 x 256 each; per layer q, k, v, o 256 x 256, MLP 3 x 256 x 688, two norms
    assert shape.parameters == 2 * 1024 * 256 + 4 * (4 * 256 * 256 + 3 * 256 * 688 + 2 * 256) + 256
    assert shape.largest_module == 1024 * 256
    assert (shape.heads, shape.kv_heads, shape.head_dim) == (4, 4, 64)
    assert not shape.qk_norm
    qwen3 = ModelShape.of(load_config("configs/models/tiny_qwen3.json"))
    assert (qwen3.kv_heads, qwen3.head_dim, qwen3.qk_norm) == (2, 32, True)  # explicit head_dim; per-head norms


@pytest.mark.parametrize(
    ("dtype", "stage", "world", "offload", "expected"),
    [
        # parameters, gradients, optimizer (fp32 master + 2 moments = 12 bytes, stage 0 fp32: 8), gathered, cpu
        ("float32", 0, 4, (), (4000, 4000, 8000, 0, 0)),
        ("bfloat16", 0, 4, (), (2000, 2000, 12000, 0, 0)),
        ("bfloat16", 1, 4, (), (2000, 2000, 3000, 0, 0)),
        ("bfloat16", 2, 4, (), (2000, 500, 3000, 0, 0)),
        ("bfloat16", 3, 4, (), (500, 500, 3000, 400, 0)),
        ("float32", 3, 4, (), (1000, 1000, 3000, 800, 0)),
        ("bfloat16", 3, 1, (), (2000, 2000, 12000, 0, 0)),
        ("bfloat16", 3, 4, ("optimizer",), (500, 0, 0, 400, 3000 + 1000)),
        ("bfloat16", 3, 4, ("optimizer", "param"), (0, 0, 0, 400, 3000 + 1000 + 500)),
        ("bfloat16", 1, 4, ("optimizer",), (2000, 2000, 0, 0, 3000 + 1000)),
    ],
)
def test_state_bytes_by_stage(dtype, stage, world, offload, expected):
    states = state_bytes(
        SHAPE, dtype, stage, world, offload_optimizer="optimizer" in offload, offload_param="param" in offload
    )
    assert (states.parameters, states.gradients, states.optimizer, states.gathered, states.cpu) == expected
    assert states.total == sum(expected[:4])


def test_state_bytes_refuse_impossible_offload():
    with pytest.raises(ValueError, match="offload_param needs ZeRO stage 3"):
        state_bytes(SHAPE, "bfloat16", 2, 2, offload_param=True)
    with pytest.raises(ValueError, match="offload_optimizer needs ZeRO stage 1-3"):
        state_bytes(SHAPE, "bfloat16", 0, 2, offload_optimizer=True)


def test_activation_arithmetic():
    # per layer and token: norms 2 x (12 h + 4), attention 4 (3 x 2 x 4 + 2 x 1 x 4) + 4 x 2, MLP 4 x 4 x 16
    per_layer = 2 * (12 * 8 + 4) + 4 * (24 + 8) + 8 + 256
    assert layer_bytes_per_token(SHAPE, "float32") == per_layer
    # per-head query and key norms: input, normalised value (4 d each) and rsqrt per head, 2 + 1 heads
    assert layer_bytes_per_token(dataclasses.replace(SHAPE, qk_norm=True), "float32") == per_layer + (8 * 4 + 4) * 3
    head = (12 * 8 + 4) * 10 + 3 * 4 * 100 * 10 + 4 * 100 * 8  # final norm, 3 logits-sized tensors, head weight grad
    plain = activation_bytes(SHAPE, "float32", 10)
    assert (plain.layers, plain.head, plain.recompute, plain.peak) == (
        4 * per_layer * 10,
        head,
        0,
        4 * per_layer * 10 + head,
    )
    # every 2nd layer: layers 0 and 2 keep their input (4 h bytes); the recompute of layer 2 holds layer 0's
    # input, layer 1's activations, its own input, its activations and its backward's 2 I + h gradients
    halves = activation_bytes(SHAPE, "float32", 10, checkpoint_every=2)
    assert halves.layers == (2 * 32 + 2 * per_layer) * 10
    assert halves.recompute == (32 + per_layer + 32 + per_layer + 4 * (2 * 16 + 8)) * 10
    chunked = activation_bytes(SHAPE, "float32", 10, head_chunk=3, targets=7, entropy=True)
    # RL adds the entropy's 2 tensors; chunks add 2 whole-length gradients of the 7 gathered hidden states
    assert chunked.head == (12 * 8 + 4) * 10 + 5 * 4 * 100 * 3 + 4 * 100 * 8 + 2 * 4 * 7 * 8


def test_largest_budget_is_the_last_that_fits():
    for every, chunk in [(0, 0), (1, 0), (2, 16)]:
        free = 10**6
        tokens = largest_budget(SHAPE, "bfloat16", free, checkpoint_every=every, head_chunk=chunk)
        peak = [
            activation_bytes(SHAPE, "bfloat16", n, checkpoint_every=every, head_chunk=chunk).peak
            for n in (tokens, tokens + 1)
        ]
        assert tokens > 0 and peak[0] <= free < peak[1]
    assert largest_budget(SHAPE, "bfloat16", -1) == 0


@pytest.mark.parametrize(("every", "chunk"), [(0, 0), (1, 0), (2, 64)])
def test_prediction_within_documented_error_of_measurement(every, chunk):
    tokens = 512
    ids = np.random.default_rng(0).integers(3, 1000, tokens).tolist()
    row = pack_trajectories([Trajectory(ids, [1] * tokens)], "flat", tokens)[0]
    targets = predicted_tokens(row)
    model = load_model(BENCH, checkpoint_every=every)

    def step():
        target_logprobs(model, row, targets, head_chunk=chunk).sum().backward()

    step()  # the parameter gradients exist from here on: the peak below is the step's activations
    measured = profiled_peak_bytes(step)
    shape = ModelShape.of(load_config(BENCH))
    planned = activation_bytes(shape, "float32", tokens, checkpoint_every=every, head_chunk=chunk, targets=len(targets))
    assert abs(planned.peak / measured - 1) <= DOCUMENTED_ERROR, (planned, measured)


def _branching_row(tokens: int, branches: int):
    """One packed row of ``tokens`` tokens: a chain (``branches`` 1), or a stem of half of them with ``branches``
    children sharing it (a tree of ``branches + 1`` nodes)."""
    rng = np.random.default_rng(0)
    if branches == 1:
        return pack_trajectories([Trajectory(rng.integers(3, 1000, tokens).tolist(), [1] * tokens)], "flat", tokens)[0]
    stem = rng.integers(3, 1000, tokens // 2).tolist()
    each = (tokens - len(stem)) // branches
    paths = [Trajectory(stem + rng.integers(3, 1000, each).tolist(), [1] * (len(stem) + each)) for _ in range(branches)]
    return pack_trajectories(paths, "tree", 10**6)[0]


def test_recurrent_mixers_read_from_the_models():
    """The hybrids' mixers are found on the meta-device model with the sizes the tree forward uses; the Gated
    DeltaNet scan chunk is ds_tree.models.hybrid's; a recurrent layer replaces attention's bytes (Falcon-H1's
    layers run both), and a row's nodes add conv history and scan padding."""
    from ds_tree.models.hybrid import GATED_DELTA_CHUNK

    qwen = ModelShape.of(load_config("configs/models/tiny_qwen3_5.json"))
    assert qwen.recurrent.kind == "gated_delta" and qwen.recurrent.chunk == GATED_DELTA_CHUNK
    assert (qwen.recurrent.heads, qwen.recurrent.key_dim, qwen.recurrent.conv_channels) == (4, 16, 128)
    assert qwen.recurrent_layers == qwen.attention_free == (0, 2)
    bamba = ModelShape.of(load_config("configs/models/tiny_bamba.json"))
    assert (bamba.recurrent.kind, bamba.recurrent.chunk, bamba.recurrent.projected) == ("mamba2", 32, 324)
    falcon = ModelShape.of(load_config("configs/models/tiny_falcon_h1.json"))
    assert falcon.recurrent_layers == (0, 1) and falcon.attention_free == ()
    assert ModelShape.of(load_config(BENCH)).recurrent is None
    chain = activation_bytes(qwen, "float32", 512)
    tree = activation_bytes(qwen, "float32", 512, row=RowNodes(9, {64: 768}))
    # per recurrent layer: 8 more nodes' 3-token conv history (4 B x 128 channels) and 256 padded scan tokens
    mixer = qwen.recurrent
    assert tree.layers - chain.layers == 2 * (
        mixer.bytes("float32", 512, RowNodes(9, {64: 768})) - mixer.bytes("float32", 512)
    )
    assert mixer.bytes("float32", 512, RowNodes(9, {64: 512})) - mixer.bytes("float32", 512) == 8 * 3 * 4 * 128


@pytest.mark.parametrize(
    ("model", "branches", "every"),
    [
        ("tiny_qwen3_5", 1, 0),
        ("tiny_qwen3_5", 8, 0),
        ("tiny_qwen3_5", 1, 1),
        ("tiny_bamba", 1, 0),
        ("tiny_bamba", 8, 0),
        ("tiny_bamba", 1, 1),
    ],
)
def test_hybrid_prediction_within_documented_error_of_measurement(model, branches, every):
    """Hybrid models (Gated DeltaNet, Mamba2) on a 512-token chain or 9-node tree: the recurrent layers' tree
    scan counted per token, per padded scan token and per node (the plan counted them as attention layers:
    0.63 of the measured peak)."""
    from ds_tree.models.tree_nodes import tree_nodes

    source = f"configs/models/{model}.json"
    row = _branching_row(512, branches)
    targets = predicted_tokens(row)
    network = load_model(source, checkpoint_every=every)

    def step():
        target_logprobs(network, row, targets).sum().backward()

    step()  # the parameter gradients exist from here on
    measured = profiled_peak_bytes(step)
    shape = ModelShape.of(load_config(source))
    nodes = tree_nodes(torch.as_tensor(np.asarray(row.kv_end))[None])
    chunk = shape.recurrent.chunk
    assert nodes.n_nodes == (1 if branches == 1 else branches + 1)
    layout = RowNodes(nodes.n_nodes, {chunk: nodes.scanned_tokens(chunk)})
    tokens = len(row.kv_end)
    planned = activation_bytes(shape, "float32", tokens, checkpoint_every=every, targets=len(targets), row=layout)
    assert abs(planned.peak / measured - 1) <= DOCUMENTED_ERROR, (planned, measured)


def test_dfs_walk_of_a_hybrid_caches_keys_and_values_of_its_attention_layers_only():
    """tiny Qwen3.5: two of its four layers attend; the other two keep their mixer's scan of each chunk."""
    qwen = ModelShape.of(load_config("configs/models/tiny_qwen3_5.json"))
    attention_only = dataclasses.replace(qwen, recurrent=None, recurrent_layers=(), attention_free=())
    for recompute in (False, True):
        hybrid = dfs_activation_bytes(qwen, "float32", 1024, 128, recompute=recompute)
        plain = dfs_activation_bytes(attention_only, "float32", 1024, 128, recompute=recompute)
        assert 2 * hybrid.cache == plain.cache
        assert hybrid.chunk > plain.chunk  # a mixer keeps more per token than attention here


def test_dfs_prediction_of_a_hybrid_within_documented_error_of_measurement():
    """The dfs walk of tiny Bamba (the two 1024-token paths of the test below, chunks of 128, no recompute);
    docs/MEMORY.md lists the cases still outside the bound (recompute: the scan's backward working set)."""
    source, tokens, chunk = "configs/models/tiny_bamba.json", 1024, 128
    rng = np.random.default_rng(0)
    stem = rng.integers(3, 1000, tokens - chunk).tolist()
    paths = [Trajectory(stem + rng.integers(3, 1000, chunk).tolist(), [1] * tokens) for _ in range(2)]
    rows = pack_trajectories(paths, "dfs", 10**7)
    normalisers = Normalisers.from_rows(pack_trajectories(paths, "tree", 10**7))
    model = load_model(source)

    def step():
        run_rows(
            model,
            rows,
            normalisers,
            "token_mean",
            "exact",
            dfs=DfsSettings(chunk, False),
            backward_for=lambda n: torch.Tensor.backward,
        )

    step()  # the parameter gradients exist from here on
    measured = profiled_peak_bytes(step)
    planned = dfs_activation_bytes(ModelShape.of(load_config(source)), "float32", tokens, chunk)
    assert abs(planned.peak / measured - 1) <= DOCUMENTED_ERROR, (planned, measured)


@pytest.mark.parametrize(
    ("chunk", "recompute", "every", "head_chunk"), [(128, False, 0, 0), (256, True, 0, 0), (512, True, 1, 128)]
)
def test_dfs_prediction_within_documented_error_of_measurement(chunk, recompute, every, head_chunk):
    """Two 1024-token paths sharing all but their last chunk: the second is walked with gradients on the
    shared keys and values (as the planner assumes). docs/MEMORY.md's dfs table holds more cases."""
    tokens = 1024
    rng = np.random.default_rng(0)
    stem = rng.integers(3, 1000, tokens - chunk).tolist()
    paths = [Trajectory(stem + rng.integers(3, 1000, chunk).tolist(), [1] * tokens) for _ in range(2)]
    rows = pack_trajectories(paths, "dfs", 10**6)
    normalisers = Normalisers.from_rows(pack_trajectories(paths, "tree", 10**6))
    model = load_model(BENCH, checkpoint_every=every)
    settings = DfsSettings(chunk, recompute)

    def step():
        run_rows(
            model,
            rows,
            normalisers,
            "token_mean",
            "exact",
            dfs=settings,
            backward_for=lambda n: torch.Tensor.backward,
            head_chunk=head_chunk,
        )

    step()  # the parameter gradients exist from here on
    measured = profiled_peak_bytes(step)
    shape = ModelShape.of(load_config(BENCH))
    planned = dfs_activation_bytes(
        shape, "float32", tokens, chunk, recompute=recompute, checkpoint_every=every, head_chunk=head_chunk
    )
    assert abs(planned.peak / measured - 1) <= DOCUMENTED_ERROR, (planned, measured)


@pytest.mark.parametrize(("chunk", "recompute"), [(10**9, False), (10**9, True), (16, False), (16, True)])
def test_dfs_prediction_at_both_ends_of_the_chunk_size(chunk, recompute):
    """Issue 42 #8: ``dfs_chunk=1e9`` predicted 3.7e9 GiB (a chunk longer than the path is the path, walked
    in one forward); a small chunk on the same 512-token path: planned against measured at both ends."""
    tokens = 512
    path = [Trajectory(np.random.default_rng(2).integers(3, 1000, tokens).tolist(), [1] * tokens)]
    rows = pack_trajectories(path, "dfs", 10**6)
    normalisers = Normalisers.from_rows(pack_trajectories(path, "tree", 10**6))
    model = load_model(BENCH)

    def step():
        backward = lambda n: torch.Tensor.backward  # noqa: E731
        run_rows(
            model, rows, normalisers, "token_mean", "exact", dfs=DfsSettings(chunk, recompute), backward_for=backward
        )

    step()
    measured = profiled_peak_bytes(step)
    shape = ModelShape.of(load_config(BENCH))
    planned = dfs_activation_bytes(shape, "float32", tokens, chunk, recompute=recompute)
    # a path walked in one chunk: within the documented 5% (3.5% over, with and without recompute; it was
    # 11% and 19% over while its keys and values were counted in the cache beside the graph that holds
    # them). Short chunks on a long path stay over-predicted a little more (16 tokens: 5.0%, 64: 8%):
    # bounded at 20% until that term is found.
    upper = 1 + DOCUMENTED_ERROR if chunk >= tokens else 1.2
    assert 1 - DOCUMENTED_ERROR <= planned.peak / measured <= upper, (planned, measured)
    if chunk > tokens:
        for packed_below in (False, True):
            options = {"recompute": recompute, "packed_below": packed_below}
            same = dfs_activation_bytes(shape, "float32", tokens, tokens, **options)
            assert dfs_activation_bytes(shape, "float32", tokens, chunk, **options) == same


def test_plan_reports_the_chunk_the_walk_uses(capsys):
    argv = ["configs/tiny_cpu.yaml", "--json", "--path-tokens", "8192", "packing.mode=dfs"]
    assert plan_main([*argv, "packing.dfs_chunk=1000000000"]) == 0
    huge = json.loads(capsys.readouterr().out)["dfs"]
    assert plan_main([*argv, "packing.dfs_chunk=8192"]) == 0
    whole = json.loads(capsys.readouterr().out)["dfs"]
    assert (huge["chunk"], huge["configured_chunk"]) == (8192, 10**9)
    assert huge["with_recompute"]["peak"] == whole["with_recompute"]["peak"] < 2**30


@pytest.mark.parametrize("recompute", [False, True])
def test_dfs_prediction_with_a_packed_chunk_below_the_path(recompute):
    """The new chunks' worst case (``packed_below``): 32 sibling subtrees of 8 tokens, two 128-token packed
    chunks below a 383-token stem walked in chain chunks (the second with gradients on the stem's keys
    and values, as the planner assumes); planned against measured."""
    chunk, stem_tokens = 128, 383
    rng = np.random.default_rng(1)
    stem = rng.integers(3, 1000, stem_tokens).tolist()
    paths = [Trajectory(stem + rng.integers(3, 1000, 8).tolist(), [1] * (stem_tokens + 8)) for _ in range(32)]
    rows = pack_trajectories(paths, "dfs", 10**6)
    normalisers = Normalisers.from_rows(pack_trajectories(paths, "tree", 10**6))
    model = load_model(BENCH)

    def step():
        backward = lambda n: torch.Tensor.backward  # noqa: E731
        settings = DfsSettings(chunk, recompute)
        run_rows(model, rows, normalisers, "token_mean", "exact", dfs=settings, backward_for=backward)

    step()
    measured = profiled_peak_bytes(step)
    shape = ModelShape.of(load_config(BENCH))
    planned = dfs_activation_bytes(shape, "float32", stem_tokens + 1, chunk, recompute=recompute, packed_below=True)
    chain = dfs_activation_bytes(shape, "float32", stem_tokens + 1, chunk, recompute=recompute)
    assert planned.peak > chain.peak
    assert abs(planned.peak / measured - 1) <= DOCUMENTED_ERROR, (planned, measured)


def _sharded_walk_peaks(rank: int, trajectories, settings: dict) -> list[float]:
    """One rank of a 2-rank group (:func:`~ds_tree.verify.sequence_parallel.spawn_group`): the walk of
    ``trajectories`` as ``packing.mode: dfs`` plans it under sequence parallelism, each case
    ``(chunk, recompute)`` measured after a warm-up; the largest peak over the ranks (process 0's is reported)."""
    import torch.distributed as dist

    from ds_tree.models.ulysses import enable_sequence_parallel
    from ds_tree.objectives.sft import global_normalisers, run_rows
    from ds_tree.packing.plan import PlanSettings, plan_step

    model = load_model(BENCH)
    enable_sequence_parallel(model, 2)
    peaks = []
    for chunk, recompute in settings["cases"]:
        plan = PlanSettings(mode="dfs", budget=chunk, sequence_parallel_size=2, dfs_chunk=chunk)
        rows = plan_step(trajectories[chunk], plan, 2).for_rank(rank).rows
        normalisers, walk = global_normalisers(rows), DfsSettings(chunk, recompute)

        def step(rows=rows, normalisers=normalisers, walk=walk):
            run_rows(model, rows, normalisers, "token_mean", "exact", backward=torch.Tensor.backward, dfs=walk)

        step()  # the parameter gradients exist from here on
        peak = torch.tensor([float(profiled_peak_bytes(step))])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peaks.append(peak.item())
    return peaks


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_dfs_prediction_within_documented_error_of_measurement():
    """The dfs walk sharded over a sequence-parallel group of 2 (spawned ranks, ~15 s): the planner's
    ``sequence_parallel=2`` peak against the busier rank's measured one, on the two 1024-token paths of
    :func:`test_dfs_prediction_within_documented_error_of_measurement`; about half the single-rank walk's.
    docs/MEMORY.md's table holds more cases (models, checkpointing, the chunked head, a packed chunk)."""
    from ds_tree.verify.sequence_parallel import spawn_group

    tokens, cases = 1024, [(128, False), (256, True)]
    paths = {}
    for chunk, _ in cases:
        rng = np.random.default_rng(0)
        stem = rng.integers(3, 1000, tokens - chunk).tolist()
        paths[chunk] = [Trajectory(stem + rng.integers(3, 1000, chunk).tolist(), [1] * tokens) for _ in range(2)]
    measured = spawn_group(_sharded_walk_peaks, paths, {"size": 2, "threads": 1, "cases": cases})
    shape = ModelShape.of(load_config(BENCH))
    for (chunk, recompute), peak in zip(cases, measured, strict=True):
        planned = dfs_activation_bytes(shape, "float32", tokens, chunk, recompute=recompute, sequence_parallel=2)
        alone = dfs_activation_bytes(shape, "float32", tokens, chunk, recompute=recompute)
        assert abs(planned.peak / peak - 1) <= DOCUMENTED_ERROR, (chunk, recompute, planned, peak)
        assert 0.45 < planned.peak / alone.peak < 0.55, (planned, alone)


def test_sharded_dfs_plan_is_one_ranks_share_and_one_rank_is_the_plain_walk():
    """``sequence_parallel=S``: per-token terms on a shard of ``ceil(n / S)`` tokens, keys and values of
    ``Hkv / S`` heads (one replicated head when ``Hkv < S``), the chunk's mask whole."""
    options = {"checkpoint_every": 2, "head_chunk": 3, "entropy": True, "packed_below": True}
    for recompute in (False, True):
        options["recompute"] = recompute
        plain = dfs_activation_bytes(SHAPE, "bfloat16", 57, 5, **options)
        assert dfs_activation_bytes(SHAPE, "bfloat16", 57, 5, sequence_parallel=1, **options) == plain
        sharded = dfs_activation_bytes(SHAPE, "bfloat16", 57, 5, sequence_parallel=2, **options)
        assert sharded.peak < plain.peak
        # SHAPE has 1 key/value head: each of the 2 ranks holds a copy, so the cache is not halved
        assert sharded.cache == plain.cache
    wide = dataclasses.replace(SHAPE, heads=4, kv_heads=4)
    plain = dfs_activation_bytes(wide, "bfloat16", 64, 8, recompute=True)
    sharded = dfs_activation_bytes(wide, "bfloat16", 64, 8, recompute=True, sequence_parallel=2)
    assert sharded.cache * 2 == plain.cache
    longest = largest_dfs_path(wide, "bfloat16", plain.peak, 8, recompute=True, sequence_parallel=2)
    assert longest > largest_dfs_path(wide, "bfloat16", plain.peak, 8, recompute=True)


@pytest.mark.parametrize(
    ("chunk", "recompute", "every", "head_chunk"),
    [(5, False, 0, 0), (5, True, 0, 0), (8, False, 2, 3), (3, True, 1, 2)],
)
def test_largest_dfs_path_is_the_longest_all_of_whose_shorter_paths_fit(chunk, recompute, every, head_chunk):
    options = {"recompute": recompute, "checkpoint_every": every, "head_chunk": head_chunk}
    free = dfs_activation_bytes(SHAPE, "bfloat16", 57, chunk, **options).peak
    longest = largest_dfs_path(SHAPE, "bfloat16", free, chunk, **options)
    peaks = [dfs_activation_bytes(SHAPE, "bfloat16", n, chunk, **options).peak for n in range(1, longest + 2)]
    assert longest >= 57 - chunk and all(peak <= free for peak in peaks[:-1]) and peaks[-1] > free
    # over whole chunks, without recompute every held chunk keeps its context's keys and values: the
    # peak's increments grow (quadratic); with recompute, once the context outweighs the head, only the
    # path's cache and the chunk's context grow (linear)
    paths = [k * chunk for k in (100, 200, 300)]
    increments = np.diff([dfs_activation_bytes(SHAPE, "bfloat16", n, chunk, **options).peak for n in paths])
    assert increments[1] > increments[0] if not recompute else increments[1] == increments[0]
    assert largest_dfs_path(SHAPE, "bfloat16", 0, chunk, **options) == 0


NO_DFS = ("packing.dfs_chunk=0", "packing.dfs_recompute=false")
"""Without dfs walks the walk's settings cannot apply (refused at config time): back to their defaults."""


def test_plan_command_walks_dfs_configs(capsys):
    config = "configs/examples/agent_grpo_dfs.yaml"  # over_budget: dfs, dfs_recompute: true, checkpointing
    argv = [config, "--world-size", "8", "--json", "--path-tokens", "65536"]
    assert plan_main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    dfs = plan["dfs"]
    assert (dfs["chunk"], dfs["recompute"], dfs["path_tokens"]) == (4096, True, 65536)
    without, with_ = dfs["without_recompute"], dfs["with_recompute"]
    assert with_["held"] == 0 < without["held"] and with_["peak"] < without["peak"]
    assert with_["largest_path"] > without["largest_path"] > 65536
    packed = plan["activations"]["with_checkpointing"]["peak"]
    assert plan["peak_bytes"] == plan["states"]["total"] + max(packed, with_["peak"])
    assert plan_main([config, "--world-size", "8"]) == 0
    assert "longest root-to-leaf path the dfs walk trains within 80 GiB" in capsys.readouterr().out
    assert plan_main([config, "--world-size", "8", "--json", "packing.over_budget=error", *NO_DFS]) == 0
    assert json.loads(capsys.readouterr().out)["dfs"] is None


def test_plan_command_shards_the_dfs_walk_under_sequence_parallelism(capsys):
    """configs/examples/long_tree_rl.yaml walked (``packing.mode: dfs``) by groups of 2 ranks: the walk's
    peak is one rank's share of the group's, about half a single rank's (docs/RL.md "Long trees")."""
    config = "configs/examples/long_tree_rl.yaml"
    argv = [config, "--world-size", "8", "--path-tokens", "65536", "packing.mode=dfs", "packing.dfs_chunk=4096"]
    plans = {}
    for size, extra in ((2, []), (1, ["packing.over_budget=error"])):
        assert plan_main([*argv, "--json", f"parallel.sequence_parallel_size={size}", *extra]) == 0
        plans[size] = json.loads(capsys.readouterr().out)
    sharded, alone = plans[2]["dfs"], plans[1]["dfs"]
    assert (sharded["sequence_parallel_size"], alone["sequence_parallel_size"]) == (2, 1)
    for name in ("without_recompute", "with_recompute"):
        assert 0.45 < sharded[name]["peak"] / alone[name]["peak"] < 0.55, name
        assert sharded[name]["largest_path"] > 2 * alone[name]["largest_path"] * 0.9, name
    assert plans[2]["peak_bytes"] == plans[2]["states"]["total"] + sharded["without_recompute"]["peak"]
    assert plan_main([*argv, "parallel.sequence_parallel_size=2"]) == 0
    assert "each chunk sharded over 2 ranks" in capsys.readouterr().out


def test_plan_command(capsys):
    argv = ["configs/examples/llama3_8b_zero3_offload.yaml", "--world-size", "1", "--json", "packing.budget=4096"]
    assert plan_main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["zero_stage"], plan["offload_optimizer"], plan["offload_param"]) == (3, True, True)
    assert plan["budget"] == 4096 and plan["config_uses"] == "with_checkpointing"
    assert plan["states"]["optimizer"] == 0 and plan["states"]["cpu"] > 0
    without, with_ = plan["activations"]["without_checkpointing"], plan["activations"]["with_checkpointing"]
    assert with_["peak"] < without["peak"]
    assert plan["peak_bytes"] == plan["states"]["total"] + with_["peak"]
    assert plan["largest_budget"]["with_checkpointing"] > plan["largest_budget"]["without_checkpointing"] > 0
    assert plan_main(["configs/examples/llama3_8b_zero3_offload.yaml", "--world-size", "1"]) == 0
    assert "largest packing.budget within 80 GiB" in capsys.readouterr().out
    assert plan_main(["configs/examples/llama3_8b_zero3_offload.yaml", "deepspeed=missing.json"]) == 2
    assert "missing.json" in capsys.readouterr().err
