"""Sliding-window and soft-capped models on trees: the flat row equals the model's own eager
attention, and the tree equals the flat baseline.

Tiny random-init configs of the architectures that use a window (Mistral: every layer; Qwen2: the
layers from ``max_window_layers`` on; Gemma2/Gemma3: alternating sliding and full layers, Gemma2
also soft-capping its attention scores) with windows far shorter than the paths, so the window
cuts every long path. Gemma's final-logit soft-capping is the LM head's business, off here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM

from ds_tree.attention.registry import implementation_name, tree_attention
from ds_tree.models.loading import keep_norms_in_float64, load_config, load_model
from ds_tree.trees.trajectory import Trajectory
from ds_tree.verify.tree_vs_flat import compare

WINDOW = 5
COMMON = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "sliding_window": WINDOW,
}
MODELS = {
    "mistral": {"model_type": "mistral"},
    # use_sliding_window with max_window_layers 1: layer 0 full, layer 1 sliding
    "qwen2": {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1},
    # a small cap so that tanh bends the scores of a random-init model (|scores| ~ 1)
    "gemma2": {
        "model_type": "gemma2",
        "layer_types": ["sliding_attention", "full_attention"],
        "attn_logit_softcapping": 0.5,
        "final_logit_softcapping": None,
        "query_pre_attn_scalar": 8,
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 8,
    },
}


# The model's own attention to compare a flat row with: sdpa runs in the model's dtype; Gemma2 has
# only eager (sdpa cannot soft-cap), whose softmax transformers takes in float32 even for a float64
# model: its probabilities' rounding (6e-8 relative) reaches the logits as 7e-8 of their scale
# (measured; sdpa agrees to 8e-16).
BASELINES = {"mistral": ("sdpa", 1e-12), "qwen2": ("sdpa", 1e-12), "gemma3": ("sdpa", 1e-12), "gemma2": ("eager", 1e-6)}


@pytest.fixture(scope="module")
def model_configs(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("sliding_models")
    paths = {}
    for name, fields in MODELS.items():
        path = folder / f"{name}.json"
        path.write_text(json.dumps({**COMMON, **fields}))
        paths[name] = str(path)
    return paths


@pytest.mark.parametrize("name", sorted(MODELS))
def test_flat_row_equals_the_models_own_attention(name, model_configs):
    """Two sequences packed in one flat row (depths restart at the second) through the tree engine
    give the logits the model's own attention gives each sequence alone, in float64; without the
    window they would not."""
    implementation, tolerance = BASELINES[name]
    model = load_model(model_configs[name], attention="torch", dtype="float64")
    own = AutoModelForCausalLM.from_config(load_config(model_configs[name]), attn_implementation=implementation)
    own.to(torch.float64).load_state_dict(model.state_dict())
    keep_norms_in_float64(own)  # as load_model does: transformers' RMSNorm rounds to float32
    own.eval()
    model.eval()
    lengths = (19, 13)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, COMMON["vocab_size"], (n,), generator=generator) for n in lengths]
    kv_end = torch.cat([torch.full((n,), sum(lengths[: i + 1])) for i, n in enumerate(lengths)])
    with torch.no_grad():
        packed = model(
            input_ids=torch.cat(sequences)[None],
            position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
            kv_end=kv_end[None],
            use_cache=False,
        ).logits[0]
        alone = torch.cat([own(input_ids=ids[None], use_cache=False).logits[0] for ids in sequences])
        model.config.sliding_window = None  # the same weights without a window: something else
        for module in model.modules():
            if hasattr(module, "sliding_window"):
                module.sliding_window = None
        unwindowed = model(
            input_ids=torch.cat(sequences)[None],
            position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
            kv_end=kv_end[None],
            use_cache=False,
        ).logits[0]
    scale = alone.abs().max().item()
    assert (packed - alone).abs().max().item() <= tolerance * scale
    assert (unwindowed - alone).abs().max().item() > 1e-3 * scale


def _forest(seed: int) -> list[Trajectory]:
    """Two groups: a 9-token prompt, three 7-token turns, each with two 6-token answers (depth 22)."""
    rng = np.random.default_rng(seed)
    trajectories = []
    for group in range(2):
        prompt = rng.integers(3, COMMON["vocab_size"], 9).tolist()
        for turn in range(3):
            middle = rng.integers(3, COMMON["vocab_size"], 7).tolist()
            for answer in range(2):
                ids = np.array(prompt + middle + rng.integers(3, COMMON["vocab_size"], 6).tolist(), dtype=np.int64)
                mask = np.r_[np.zeros(9), np.full(13, 1.0 + answer)]
                trajectories.append(Trajectory(ids, mask, group_id=f"g{group}", source=f"g{group}/t{turn}{answer}"))
    return trajectories


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tree_equals_flat(name, model_configs):
    """Loss, log-probs and every gradient of the tree equal the flat baseline's in float64."""
    report = compare(_forest(1), model_configs[name], dtype="float64", budget=128, block=8)
    assert report["tree_tokens"] < report["flat_tokens"]
    assert report["passed"], {key: report[key] for key in ("loss_rel_err", "max_rel_grad_err", "max_abs_logprob_err")}


def test_window_needs_position_ids(model_configs):
    """A layer with a window whose model does not hand position_ids to its attention is refused."""
    model = load_model(model_configs["mistral"], attention="torch", dtype="float32")
    attention = AttentionInterface()[implementation_name("torch")]
    query = torch.zeros(1, 4, 4, 8)
    with pytest.raises(ValueError, match=r"MistralAttention uses a sliding window \(5\).*position_ids"):
        layer = model.model.layers[0].self_attn
        attention(layer, query, query, query, None, sliding_window=5, kv_end=torch.full((1, 4), 4))


def test_triton_refuses_a_cap_that_is_not_positive():
    """The triton engine caps scores (tests/test_triton_attention.py); a cap <= 0 is refused by name."""
    query = torch.zeros(1, 2, 4, 16)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        tree_attention(query, query, query, torch.full((1, 4), 4), engine="triton", softcap=0.0)
