"""The model matrix (docs/MODELS.md): tree vs flat on every supported architecture, in float64.

Each entry is a tiny random-init config of a real transformers architecture, built here. One
forest with shared prefixes and a path longer than the sliding windows runs flat and as trees,
whole and split into parts: loss, every trajectory's log-probs and every gradient must agree to
1e-10. The flat log-probs are also checked against transformers' own eager attention on each
trajectory alone, so a window or a soft-cap the tree engine dropped in both modes cannot pass.

The vision-language entries (:data:`VISION_MODELS`) run the same on forests with screenshots (shared by
every trial, by a subtree, different images behind identical placeholder ids: ``tests/test_vision.py``'s
``agent_trees``), and their eager reference is transformers' own forward from ``pixel_values`` and
``image_grid_thw``: its own tower call, feature scatter and multimodal rotary positions.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from ds_tree.comparison import gradient_errors
from ds_tree.models.loading import load_config, load_model
from ds_tree.models.token_mixing import UnsupportedModelError
from ds_tree.models.vision import attach_rope_positions
from ds_tree.registries import MODEL_FAMILIES
from ds_tree.trees.random_trees import TreeShape, random_forest
from ds_tree.verify.tree_vs_flat import run_mode
from tests.test_vision import agent_trees

EXACT = 1e-10
# transformers' eager attention takes its softmax in float32 whatever the model dtype.
EAGER = 1e-5
WINDOW = 4
"""Sliding window of the windowed entries: shorter than the forest's paths (up to 13 tokens)."""
BASE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.5)  # a large coefficient: the aux gradient counts
MODELS = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen2_sliding": dict(model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(model_type="qwen3"),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=16, **MOE),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=16, **MOE),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, **MOE),
    "mistral": dict(model_type="mistral", sliding_window=WINDOW),
    # Gemma 2: attention and final-logit soft-capping and sliding layers. The caps are far below the
    # defaults (50, 30) and the init wider than the default 0.02, so that scores and logits reach them.
    "gemma2": dict(
        model_type="gemma2",
        sliding_window=WINDOW,
        layer_types=SLIDING_THEN_FULL,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=0.5,
        initializer_range=0.5,
    ),
    "gemma": dict(model_type="gemma"),  # RMSNorm scaled by 1 + weight
    "gemma3": dict(model_type="gemma3_text", sliding_window=WINDOW, layer_types=SLIDING_THEN_FULL),
    "phi3": dict(model_type="phi3"),
    # Hybrids (ds_tree/models/hybrid.py): recurrent layers run per tree node, from the parent's state.
    "qwen3_5": dict(
        model_type="qwen3_5_text",
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    # Qwen3.5-MoE: its Gated DeltaNet mixer class, gated norm and router (with the router loss) are its own
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe_text",
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        **MOE,
    ),
    "bamba": dict(
        model_type="bamba",
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_chunk_size=4,
    ),
    # Qwen3-Next: Gated DeltaNet with fused projections, gated attention with partial RoPE, MoE with a
    # shared expert (the router loss included through MOE's coefficient)
    "qwen3_next": dict(
        model_type="qwen3_next",
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        **MOE,
    ),
    # Falcon-H1: Mamba2 and attention side by side in every layer, muP multipliers, the gate without the norm
    "falcon_h1": dict(
        model_type="falcon_h1",
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_chunk_size=4,
        mamba_rms_norm=False,
        ssm_in_multiplier=0.5,
        ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9],
        ssm_out_multiplier=0.8,
        attention_in_multiplier=1.2,
    ),
    "nemotron_h": dict(
        model_type="nemotron_h",
        layers_block_type=["linear_attention", "full_attention"],
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=8,
        conv_kernel=4,
        chunk_size=4,
    ),
}

VISION_MODELS = {"qwen2_5_vl": "configs/models/tiny_qwen2_5_vl.json", "qwen3_vl": "configs/models/tiny_qwen3_vl.json"}
"""Vision-language entries: the tiny configs of the repository (nested text and vision configs)."""


def test_every_registered_family_has_an_entry():
    """Adding a model family is its spec file, its line in ds_tree/registries.py and its entry here
    (docs/MODELS.md, "Adding a model family"); the families refused at load are tested where they are refused."""
    tested = {fields["model_type"] for fields in MODELS.values()}
    tested |= {json.loads(Path(source).read_text())["model_type"] for source in VISION_MODELS.values()}
    registered = {name for name, spec in MODEL_FAMILIES.items() if not spec.bidirectional_images}
    assert registered == tested
    assert all(spec.model_type == name for name, spec in MODEL_FAMILIES.items())


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("models")
    paths = {}
    for name, fields in MODELS.items():
        paths[name] = str(directory / f"{name}.json")
        (directory / f"{name}.json").write_text(json.dumps({**BASE, **fields}))
    return paths


@pytest.fixture(scope="module")
def forest():
    trajectories = random_forest(
        random.Random(0), TreeShape(trees=2, depth=3, children=(1, 3), node_tokens=(1, 5), alphabet=(3, 127))
    )
    assert max(len(t) for t in trajectories) > 3 * WINDOW  # the windows cut every long path
    return trajectories


def _eager_logprobs(model, source: str, trajectory) -> np.ndarray:
    """Log-probs of the trajectory alone under transformers' eager attention, from ``model``'s weights."""
    reference = AutoModelForCausalLM.from_config(load_config(source), attn_implementation="eager")
    reference.load_state_dict(model.state_dict())
    reference.to(torch.float64).eval()
    if reference._can_set_experts_implementation():
        reference.set_experts_implementation("eager")  # grouped_mm refuses float64
    ids = torch.as_tensor(trajectory.input_ids)[None]
    with torch.no_grad():
        logits = reference(input_ids=ids, use_cache=False).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()


def _eager_vision_logprobs(model, source: str, trajectory) -> np.ndarray:
    """Log-probs of the trajectory alone by transformers' own vision-language forward (eager attention in the
    tower and the language model), from its ids and its images' ``pixel_values`` and ``image_grid_thw``: the
    model places the features and computes the rotary positions itself (image tokens found by id, as its
    processor marks them)."""
    reference = AutoModelForImageTextToText.from_config(load_config(source), attn_implementation="eager")
    reference.load_state_dict(model.state_dict())
    reference.to(torch.float64).eval()
    ids = torch.as_tensor(trajectory.input_ids)[None]
    images = {}
    if trajectory.images:
        images = dict(
            pixel_values=torch.cat([torch.as_tensor(image.pixel_values) for image in trajectory.images]).double(),
            image_grid_thw=torch.as_tensor([image.grid_thw for image in trajectory.images]),
            mm_token_type_ids=(ids == reference.config.image_token_id).int(),
        )
    with torch.no_grad():
        logits = reference(input_ids=ids, use_cache=False, **images).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].numpy()


def _check_tree_equals_flat(name: str, model, trajectories, budgets: tuple[int, int]):
    """Flat, then tree with whole trees and with parts carrying their ancestor paths: loss, every
    trajectory's log-probs and every gradient to :data:`EXACT`. Returns the flat result."""
    flat = run_mode(model, trajectories, "flat", 4096, 1, "token_mean", "exact")
    for budget in budgets:
        tree = run_mode(model, trajectories, "tree", budget, 1, "token_mean", "exact")
        assert budget == budgets[0] or tree.rows > 2
        assert abs(tree.loss - flat.loss) <= EXACT * abs(flat.loss)
        for trajectory in trajectories:
            key = id(trajectory)
            np.testing.assert_allclose(tree.logprobs[key], flat.logprobs[key], rtol=0, atol=EXACT)
        errors = gradient_errors(flat.gradients, tree.gradients)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= EXACT, (name, budget, worst, errors[worst])
    return flat


@pytest.mark.parametrize("name", list(MODELS))
def test_tree_equals_flat(name, sources, forest):
    model = load_model(sources[name], attention="torch", dtype=torch.float64, seed=7)
    flat = _check_tree_equals_flat(name, model, forest, (4096, 16))
    assert set(flat.gradients) >= {n for n, p in model.named_parameters() if "experts" not in n}
    for trajectory in forest[:3]:
        eager = _eager_logprobs(model, sources[name], trajectory)
        np.testing.assert_allclose(flat.logprobs[id(trajectory)], eager, rtol=0, atol=EAGER, err_msg=name)


@pytest.mark.parametrize("name", list(VISION_MODELS))
def test_vision_language_tree_equals_flat(name):
    """Trees with images, whole and split into parts (budget 20: the longest path), the tower's
    gradients included; the flat log-probs equal transformers' own forward from the pixels on every
    trajectory (with images, repeated images, and text only)."""
    trajectories = agent_trees(name)
    model = load_model(VISION_MODELS[name], attention="torch", dtype=torch.float64, seed=7)
    attach_rope_positions(model.config, trajectories)
    flat = _check_tree_equals_flat(name, model, trajectories, (4096, 20))
    tower = {n for n, _ in model.named_parameters() if ".visual." in n}
    assert len(tower) >= 20 and set(flat.gradients) == {n for n, _ in model.named_parameters()}
    for trajectory in trajectories:
        eager = _eager_vision_logprobs(model, VISION_MODELS[name], trajectory)
        np.testing.assert_allclose(flat.logprobs[id(trajectory)], eager, rtol=0, atol=EAGER, err_msg=name)


def test_gemma2_final_softcapping_in_the_chunked_head(sources, forest):
    """The chunked head applies Gemma 2's final-logit soft-cap itself: same numbers as the model's head."""
    model = load_model(sources["gemma2"], attention="torch", dtype=torch.float64, seed=7)
    assert model.config.final_logit_softcapping == 0.5
    whole = run_mode(model, forest, "tree", 4096, 1, "token_mean", "exact")
    chunked = run_mode(model, forest, "tree", 4096, 1, "token_mean", "exact", head_chunk=5)
    assert model.config.final_logit_softcapping == 0.5  # switched off only inside the call
    assert abs(chunked.loss - whole.loss) <= 1e-12 * abs(whole.loss)
    for key, logprobs in whole.logprobs.items():
        np.testing.assert_allclose(chunked.logprobs[key], logprobs, rtol=0, atol=1e-12)
    assert max(gradient_errors(whole.gradients, chunked.gradients).values()) <= 1e-12


@pytest.mark.parametrize(
    ("fields", "dtype", "named"),
    [
        (dict(model_type="mamba", state_size=4, expand=2, conv_kernel=2), "float32", "mamba"),
        (dict(model_type="mixtral", num_local_experts=4, router_jitter_noise=0.1), "float32", "MixtralSparseMoeBlock"),
        (
            dict(
                model_type="deepseek_v3",
                n_routed_experts=4,
                moe_intermediate_size=16,
                first_k_dense_replace=0,
                n_group=1,
                topk_group=1,
                kv_lora_rank=8,
                q_lora_rank=8,
                qk_rope_head_dim=4,
                qk_nope_head_dim=4,
                v_head_dim=8,
            ),
            "float64",
            "DeepseekV3TopkRouter",
        ),
    ],
    ids=["mamba", "mixtral-jitter", "deepseek_v3-float64"],
)
def test_refused_at_load_naming_the_layer(tmp_path, fields, dtype, named):
    source = tmp_path / "model.json"
    source.write_text(json.dumps({**BASE, **fields}))
    with pytest.raises(UnsupportedModelError, match=named):
        load_model(source, attention="torch", dtype=dtype)
