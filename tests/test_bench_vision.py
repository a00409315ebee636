"""ds-tree bench on vision-language trees: the tower's calls, images and patches per step (counted by a
hook during the benched steps) against the data's own images, and the ideal that counts vision patches.

The expected counts are computed here from the trajectories alone: a tree encodes each distinct image of
its group once, the flat baseline each distinct image of each trajectory once. Timings are not asserted.
"""

from __future__ import annotations

import json

import pytest

from ds_tree.bench.vision import distinct_images, patch_weight, tower_seconds_per_patch
from ds_tree.cli.bench import main as bench_main
from ds_tree.cli.make_tokenizer import main as make_tokenizer_main
from ds_tree.data import load_trajectories
from ds_tree.data.convert import ConvertOptions, convert
from ds_tree.data.gui_synthetic import write_gui_chat
from ds_tree.models.loading import load_config, load_model
from ds_tree.models.vision import attach_rope_positions
from ds_tree.packing.modes import pack_trajectories

MODEL = "configs/models/tiny_qwen2_5_vl.json"


@pytest.fixture(scope="module")
def gui_dataset(tmp_path_factory):
    """2 tasks x 4 trials, three 28x28 screenshots a trial: per task 1 shared by all, 2 by halves, 4 by quarters."""
    folder = tmp_path_factory.mktemp("gui")
    assert make_tokenizer_main(["--output", str(folder / "processor"), "--vision", "qwen2_5_vl"]) == 0
    path = write_gui_chat(folder / "chat", tasks=2, trials=4, side=28)
    convert([path], folder / "dataset", folder / "processor", ConvertOptions(format="chat"))
    return folder / "dataset", load_trajectories(folder / "dataset")


def patches(image) -> int:
    t, h, w = image.grid_thw
    return t * h * w


def data_images(trajectories, mode: str) -> tuple[int, int]:
    """Images and patches the tower must encode per pass: distinct per group (tree) or per trajectory (flat)."""
    scopes = {}
    for index, trajectory in enumerate(trajectories):
        scope = scopes.setdefault(trajectory.group_id if mode == "tree" else index, {})
        scope.update({image.key: patches(image) for image in trajectory.images})
    return sum(len(scope) for scope in scopes.values()), sum(sum(scope.values()) for scope in scopes.values())


@pytest.mark.parametrize(
    "config_path, mlp_matrices, mergers",
    [(MODEL, 3, 1), ("configs/models/tiny_qwen3_vl.json", 2, 2)],  # gated MLP; Qwen3-VL: plain MLP, deepstack merger
    ids=["qwen2_5_vl", "qwen3_vl"],
)
def test_patch_weight_is_the_towers_multiply_adds_per_patch_over_the_decoders_per_token(
    config_path, mlp_matrices, mergers
):
    config = load_config(config_path)
    vision, text = config.vision_config, config.text_config
    merged = vision.hidden_size * vision.spatial_merge_size**2
    per_patch = (
        vision.in_channels * vision.temporal_patch_size * vision.patch_size**2 * vision.hidden_size  # patch embed
        + vision.depth * (4 * vision.hidden_size**2 + mlp_matrices * vision.hidden_size * vision.intermediate_size)
        + mergers * (merged * merged + merged * vision.out_hidden_size) / vision.spatial_merge_size**2  # per merged
    )
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    attention = text.hidden_size * head_dim * (2 * text.num_attention_heads + 2 * text.num_key_value_heads)
    per_token = text.num_hidden_layers * (attention + 3 * text.hidden_size * text.intermediate_size)
    assert patch_weight(load_model(config_path)) == pytest.approx(per_patch / per_token)


def test_text_models_have_no_patch_weight():
    assert patch_weight(load_model("configs/models/tiny_qwen3.json")) is None


@pytest.mark.parametrize(
    "objective", [[], ["--objective", "grpo", "--ppo-epochs", "2", "--kl-coef", "0.1"]], ids=["sft", "grpo-kl"]
)
def test_bench_counts_the_towers_images_tree_against_flat(gui_dataset, tmp_path, objective):
    dataset, trajectories = gui_dataset
    out = tmp_path / "bench.json"
    argv = ["--data", str(dataset), "--model", MODEL, "--steps", "1", "--warmup", "0", "--budget", "1024"]
    assert bench_main([*argv, *objective, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    modes = report["modes"]
    attach_rope_positions(load_config(MODEL), trajectories)
    passes = 1 + 2 + 1 if objective else 1  # RL: the old policy's pass, 2 updates, the reference's pass
    for mode in ("flat", "tree"):
        images, patch_count = data_images(trajectories, mode)
        rows = len(pack_trajectories(trajectories, mode, 1024, 1))
        counted = modes[mode]
        assert (counted["images_per_step"], counted["patches_per_step"]) == (images, patch_count)
        assert counted["tower_calls_per_step"] == rows * passes  # one call per forward of a row
        assert counted["tower_images_per_step"] == images * passes
        assert counted["tower_patches_per_step"] == patch_count * passes
    assert data_images(trajectories, "tree") == (14, 56) and data_images(trajectories, "flat") == (24, 96)
    weight = report["patch_weight"]
    assert weight == pytest.approx(patch_weight(load_model(MODEL)))
    flat, tree = modes["flat"], modes["tree"]
    work = {m: modes[m]["packed_tokens_per_step"] + weight * modes[m]["patches_per_step"] for m in modes}
    assert report["ideal_speedup_with_patches"] == pytest.approx(work["flat"] / work["tree"])
    assert report["efficiency_with_patches"] == pytest.approx(report["speedup"] / report["ideal_speedup_with_patches"])
    assert report["tower_call_ratio"] == flat["tower_calls_per_step"] / tree["tower_calls_per_step"]
    assert report["tower_patch_ratio"] == pytest.approx(96 / 56)
    if objective:  # RL: no measured prices (the tower's price is a forward and backward's)
        assert "tower_s_per_patch" not in report
        return
    price = report["tower_s_per_patch"]
    assert price > 0
    rest = sum(modes[m]["forward_backward_time_s"] - price * modes[m]["patches_per_step"] for m in modes)
    assert report["lm_s_per_token"] == pytest.approx(rest / sum(modes[m]["packed_tokens_per_step"] for m in modes))
    assert report["patch_weight_measured"] == pytest.approx(price / report["lm_s_per_token"])
    work = {
        m: modes[m]["packed_tokens_per_step"] + report["patch_weight_measured"] * modes[m]["patches_per_step"]
        for m in modes
    }
    assert report["ideal_speedup_with_patches_measured"] == pytest.approx(work["flat"] / work["tree"])
    assert report["efficiency_with_patches_measured"] == pytest.approx(
        report["speedup"] / report["ideal_speedup_with_patches_measured"]
    )


def test_timing_the_tower_leaves_no_gradient(gui_dataset):
    """The bench times the tower on one mode's model before its steps: no gradient may reach that step."""
    _, trajectories = gui_dataset
    model = load_model(MODEL)
    images = distinct_images(trajectories[:4])
    assert len(images) == 7  # one task: 1 + 2 + 4 screenshots
    assert tower_seconds_per_patch(model, images, lambda: None, repeats=1) > 0
    assert all(parameter.grad is None for parameter in model.parameters())
