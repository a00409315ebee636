"""Rollouts with image observations (issue 45): environments return screenshots, the HF tree sampler
feeds them (pixels and multimodal rotary positions), episode leaves carry them into training.

The oracle for the sampler is stock transformers: each leaf's log-probs, sampled with keys/values
shared and carried across turns, equal one plain forward of the whole path in float64 (with the
model's own position rule, ``mm_token_type_ids``), and the leaves train tree == flat."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.cli.make_tokenizer import main as make_tokenizer_main
from ds_tree.data.convert import load_tokenizer
from ds_tree.envs.gui_screens import COLOURS, GuiScreensEnv, app_screen, home_screen
from ds_tree.errors import ConfigError
from ds_tree.models.loading import keep_norms_in_float64, load_model
from ds_tree.models.loading import load_config as load_model_config
from ds_tree.rollout.env import EnvironmentCalls, StepResult, ToolEnvironment, check_messages, step_result
from ds_tree.rollout.episodes.records import save_rollouts
from ds_tree.rollout.episodes.runner import EpisodeRunner
from ds_tree.rollout.images import observation_images
from ds_tree.rollout.render import Renderer
from ds_tree.sampling.hf import sample_tree
from ds_tree.sampling.hf_engine import HFTurnSampler
from ds_tree.sampling.prompts import stop_token_ids
from ds_tree.sampling.settings import EnvSettings, SamplerSettings
from ds_tree.trees.trie import build_forest
from ds_tree.turn_formats import resolve_format, turn_stop_tokens

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/models/tiny_qwen2_5_vl.json"
TASK = {"id": "screen-x", "colour": 2}


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision_processor")
    assert make_tokenizer_main(["--output", str(folder), "--vision", "qwen2_5_vl"]) == 0
    return folder


@pytest.fixture(scope="module")
def policy():
    """float64 tiny Qwen2.5-VL, made to end turns: ``<|im_end|>`` about every third token."""
    model = load_model(CONFIG, attention="torch", dtype="float64", seed=0)
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight[4] = 0.0
        model.lm_head.weight[4, 0] = 0.8
    return model


class Screens(ToolEnvironment):
    """Every turn is answered with a screenshot: the same one for turns of even length (siblings share
    it), another for odd ones; a caption text part beside it; done after three turns."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, task):
        return [
            {"role": "system", "content": "Look."},
            {"role": "user", "content": [{"type": "text", "text": "Home:"}, {"type": "image", "image": home_screen()}]},
        ]

    def step(self, turn):
        self.turns += 1
        if self.turns == 3:
            return StepResult(reward=float(len(turn.raw) % 2), done=True)
        screen = app_screen((self.turns + len(turn.raw)) % 2)
        parts = [{"type": "text", "text": "now"}, {"type": "image", "image": screen}]
        return StepResult(messages=[{"role": "user", "content": parts}])


def renderer_and_stops(processor_dir, model_config):
    tokenizer = load_tokenizer(processor_dir)
    turn_format = resolve_format("auto", tokenizer)
    stops = stop_token_ids(tokenizer, model_config, turn_stop_tokens(turn_format, tokenizer))
    return Renderer(tokenizer, stops, 0, turn_format, observation_images(processor_dir, model_config)), stops


def run_episode(processor_dir, model, env_class, carry=True, width=4, task=TASK):
    renderer, stops = renderer_and_stops(processor_dir, model.config)
    settings = SamplerSettings(width=width, branching=2, max_depth=2, max_new_tokens=12, temperature=1.0)
    env = EnvSettings(max_turns=4)
    runner = EpisodeRunner(
        env_class, renderer, HFTurnSampler(model, settings, stops, carry=carry), settings, env, 600, EnvironmentCalls(1)
    )
    tree = runner.run(task, "screen-x", 0, 1, torch.Generator().manual_seed(0))
    tree.build_leaves("screen-x/step1/slot0", "tasks.jsonl:1")
    return tree, runner


def stock_logprobs(model, trajectory) -> np.ndarray:
    """Per token, the log-prob a plain stock-transformers forward of the whole path gives it (float64 norms)."""
    from transformers import AutoModelForImageTextToText

    stock = AutoModelForImageTextToText.from_config(model.config, attn_implementation="sdpa", dtype=torch.float32)
    stock.to(torch.float64).load_state_dict(model.state_dict())
    keep_norms_in_float64(stock)
    ids = torch.as_tensor(trajectory.input_ids)[None]
    pixels = torch.cat([torch.as_tensor(image.pixel_values) for image in trajectory.images]).double()
    grids = torch.as_tensor([image.grid_thw for image in trajectory.images])
    with torch.no_grad():
        logits = stock.eval()(
            input_ids=ids,
            pixel_values=pixels,
            image_grid_thw=grids,
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
        ).logits[0]
    logprobs = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    return np.concatenate([[np.nan], logprobs.numpy()])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_sampler_feeds_prompt_images_exactly(family):
    """sample_tree on a prompt with two images: every sampled log-prob equals a stock forward of the path."""
    from ds_tree.trees.trajectory import Trajectory
    from tests.test_vision import CONFIGS, IMAGE_PAD, VISION_END, VISION_START, make_image

    policy = load_model(CONFIGS[family], attention="torch", dtype="float64", seed=0)
    a, b = make_image(family, 0), make_image(family, 1, width_patches=3)
    prompt = [3, 10, VISION_START, *[IMAGE_PAD] * a.tokens, VISION_END, 11, VISION_START, *[IMAGE_PAD] * b.tokens]
    prompt += [VISION_END, 13]
    settings = SamplerSettings(width=4, branching=2, max_depth=2, segment_length=3, max_new_tokens=6)
    generator = torch.Generator().manual_seed(0)
    tree = sample_tree(policy, prompt, settings, generator=generator, eos_token_ids=[2], images=[a, b])
    assert tree.leaves == 4
    assert policy.config.vision_config._attn_implementation == "sdpa"  # the tower's own attention restored
    for leaf in tree.leaf_nodes():
        ids, logprobs = tree.completion(leaf)
        index = np.array([-1, -1, -1, *[0] * a.tokens, -1, -1, -1, *[1] * b.tokens, -1, -1] + [-1] * len(ids))
        path = Trajectory(np.array(prompt + ids), np.ones(len(index)), images=(a, b), image_index=index)
        expected = stock_logprobs(policy, path)[len(prompt) :]
        np.testing.assert_allclose(logprobs, expected, rtol=0, atol=1e-12)
        assert not {policy.config.image_token_id, policy.config.video_token_id} & set(ids)  # never sampled
    with pytest.raises(ValueError, match="image placeholder tokens"):
        sample_tree(policy, prompt, settings, generator=torch.Generator(), eos_token_ids=[2], images=[a])


def test_image_observations_sampled_carried_and_trained_exactly(processor_dir, policy):
    """An episode whose turns are answered with screenshots: leaves carry their images (siblings share the
    same screenshot by identity), the sampler's log-probs equal a stock forward of each path with keys and
    values carried across turns or each turn prefilled, and the leaves train tree == flat in float64."""
    from ds_tree.models.vision import attach_rope_positions
    from ds_tree.verify.tree_vs_flat import compare_rl

    carried, runner = run_episode(processor_dir, policy, Screens)
    prefilled, _ = run_episode(processor_dir, policy, Screens, carry=False)
    assert [n.token_ids for n in carried.nodes] == [n.token_ids for n in prefilled.nodes]
    assert carried.forward_tokens < prefilled.forward_tokens
    leaves = [leaf.trajectory for leaf in carried.leaves]
    assert len(leaves) == 4 and max(leaf.turns for leaf in carried.leaves) == 3  # some are cut by max_new_tokens
    image_token = policy.config.image_token_id
    for leaf, trajectory in zip(carried.leaves, leaves, strict=True):
        assert len(trajectory.images) == leaf.turns  # the home screen, then a screenshot after each turn but the last
        assert np.array_equal(trajectory.image_index >= 0, trajectory.input_ids == image_token)
        assert trajectory.images[0].key == leaves[0].images[0].key
        sampled = ~np.isnan(trajectory.logprobs)
        np.testing.assert_allclose(
            trajectory.logprobs[sampled], stock_logprobs(policy, trajectory)[sampled], rtol=0, atol=1e-12
        )
    for a, b in zip(carried.nodes, prefilled.nodes, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-12)
    keys = {image.key for t in leaves for image in t.images}
    assert len(keys) == 3  # home + the two app screens, shared across siblings by identity
    attach_rope_positions(policy.config, leaves)
    (forest,) = build_forest(leaves)
    assert forest.n_tokens < sum(t.input_ids.size for t in leaves)
    for leaf, reward in zip(leaves, (1.0, 0.0, 0.5, 0.0), strict=True):
        leaf.reward = reward
    report = compare_rl(leaves, CONFIG, estimator="grpo", dtype="float64")
    assert report["passed"] and report["max_rel_grad_err"] <= 1e-10, report


def test_saved_rollouts_name_each_leafs_images(processor_dir, policy, tmp_path: Path):
    tree, _ = run_episode(processor_dir, policy, Screens, width=2)
    records = [json.loads(line) for line in save_rollouts(tmp_path, 1, [tree]).read_text().splitlines()]
    for record, leaf in zip(records, tree.leaves, strict=True):
        assert [image["key"] for image in record["images"]] == [image.key for image in leaf.trajectory.images]
        assert record["images"][0]["grid_thw"] == [1, 4, 4]


def test_gui_task_demonstrations_and_rewards(processor_dir):
    """The example task: the screenshot tool's answer is an image, only the pixels tell the colour, and
    the demonstrations' answers do not depend on it."""
    env = GuiScreensEnv()
    opening = check_messages("reset", env.reset(TASK))
    assert opening[1]["content"][1]["image"].size == (56, 56)  # arrays become PIL images
    result = step_result(env.step(parse_call("screenshot")))
    (message,) = result.messages
    assert message["role"] == "tool" and message["content"][0]["type"] == "image"
    assert np.array_equal(np.asarray(message["content"][0]["image"])[-1, -1], COLOURS[TASK["colour"]])
    assert env.reward(parse_call(None, "2")) == 1.0 and env.reward(parse_call(None, "3")) == 0.0
    assert GuiScreensEnv().reward(parse_call(None, "2")) == 0.0  # without looking
    rng = random.Random(0)
    hits = [env.demonstration({"colour": c % 5}, rng)[-1]["content"] == str(c % 5) for c in range(500)]
    assert 0.14 < np.mean(hits) < 0.26
    model_config = load_model_config(CONFIG)
    renderer, _ = renderer_and_stops(processor_dir, model_config)
    ids = renderer.prompt(opening, None)
    assert ids.count(model_config.image_token_id) == 4  # 56 x 56 pixels: 2 x 2 merged patches


def parse_call(name, text=""):
    from ds_tree.rollout.env import ToolCall, Turn

    return Turn(text, [ToolCall(name, {}, "call_1_0")] if name else [])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([{"type": "image", "image": np.zeros((4, 4), dtype=np.uint8)}], r"uint8 \[height, width, 3 or 4\]"),
        ([{"type": "image", "image": 3}], "must be a PIL image, a uint8 array or a file path"),
        ([{"type": "video"}], "a part is an object of type text, image or image_url"),
    ],
)
def test_bad_image_observations_are_environment_errors(content, message):
    from ds_tree.rollout.env import EnvFailure

    with pytest.raises(EnvFailure, match=re.escape(message) if "[" not in message else message):
        check_messages("step", [{"role": "tool", "tool_call_id": "c", "content": content}])


def test_text_policy_ends_a_leaf_on_an_image_observation(tokenizer, caplog):
    """A text-only policy cannot see an image: the leaf ends ``env_error`` naming the reason."""
    model = load_model("configs/models/tiny_llama.json", attention="torch", dtype="float32", seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight[4] = 0.0
        model.lm_head.weight[4, 0] = 0.8
    settings = SamplerSettings(width=2, branching=2, max_depth=1, max_new_tokens=12, temperature=1.0)
    renderer = Renderer(tokenizer, [2, 4])

    class TextScreens(Screens):
        def reset(self, task):
            return [{"role": "user", "content": "Look."}]

    runner = EpisodeRunner(
        TextScreens, renderer, HFTurnSampler(model, settings, [2, 4]), settings, EnvSettings(), 400, EnvironmentCalls(1)
    )
    tree = runner.run(TASK, "t", 0, 1, torch.Generator().manual_seed(0))
    assert tree.counts["env_errors"] == 2
    assert "the policy has no vision tower" in caplog.text


def test_vision_rollouts_refused_on_vllm(processor_dir, tmp_path):
    from ds_tree.config import load_config
    from ds_tree.models.vision import check_vision_settings

    config = load_config(gui_config(processor_dir, tmp_path))
    check_vision_settings(config, load_model_config(config.model.source))  # the shipped example: accepted
    config.rollout.engine = "vllm"
    message = r"rollout.engine: vllm: .* vision-language model; sampling with images on vLLM is not built: .*; use "
    message += "rollout.engine: hf$"
    with pytest.raises(ConfigError, match=message):  # the engine's declared capability and its reason
        check_vision_settings(config, load_model_config(config.model.source))


def gui_config(processor_dir, tmp_path: Path) -> Path:
    from ds_tree.envs.gui_screens import tasks

    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(task) + "\n" for task in tasks(8, 0)))
    text = (ROOT / "configs/multiturn_gui_cpu.yaml").read_text()
    text = text.replace("runs/multiturn_gui/tokenizer", str(processor_dir))
    text = text.replace("configs/gui_tasks.jsonl", str(tmp_path / "tasks.jsonl"))
    text = text.replace("configs/", f"{ROOT}/configs/")
    path = tmp_path / "gui.yaml"
    path.write_text(text)
    return path


class GuiAlwaysLooks(GuiScreensEnv):
    """The example's task, except that a first turn that does not call the tool is shown the screenshot
    anyway: every first turn that ends is followed by an image observation, whatever a briefly warmed-up
    policy writes."""

    def step(self, turn):
        if not turn.tool_calls and not self.looked:
            self.looked = True
            parts = [{"type": "text", "text": "Look:"}, {"type": "image", "image": app_screen(self.colour)}]
            return StepResult(messages=[{"role": "user", "content": parts}])
        return super().step(turn)


@pytest.mark.distributed
def test_two_ranks_zero3_train_on_screenshot_episodes(processor_dir, tmp_path: Path) -> None:
    """The shipped example, cut short: 2 gloo ranks under ZeRO-3, a warm-up SFT step on demonstrations with
    images (self-checked: tree == flat, the tower's gradients included), then GRPO steps on episode trees
    whose leaves share the home screen and their task's screenshot."""
    from tests.helpers.launch import torchrun

    config = gui_config(processor_dir, tmp_path)
    overrides = [
        f"output_dir={tmp_path / 'run'}",
        "max_steps=5",
        "rollout.env.path=tests.test_vision_rollouts:GuiAlwaysLooks",
        "rollout.prompts_per_step=4",
        "rollout.width=4",
        "rollout.branching=4",
        "rollout.env.turn_branching=[1,4]",
        "rollout.env.warmup_steps=4",  # the turn format learnt: first turns end, a screenshot follows
        "objective.reference_step=4",
        "checkpoint.export_hf=false",
        "checkpoint.every=0",
    ]
    torchrun("ds_tree/train.py", "--config", str(config), *overrides, timeout=400)
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = {record["step"]: record for record in records if "step" in record}
    assert "warmup/sft_loss" in steps[1] and not any(key.startswith("selfcheck/") for key in steps[1])
    assert (
        "selfcheck/max_grad_rel_err" in steps[5]
    )  # deferred from the warm-up to the first RL step (passed: the run ran on)
    assert 0 <= steps[5]["rollout/reward_mean"] <= 1 and np.isfinite(steps[5]["loss/train"])
    saved = [json.loads(line) for line in (tmp_path / "run/rollouts/step_000005.jsonl").read_text().splitlines()]
    seen = [record for record in saved if len(record["images"]) == 2]  # a first turn, the screenshot, an answer
    assert len(seen) >= 8, [record["stop_reason"] for record in saved]
    assert len({record["images"][0]["key"] for record in saved}) == 1  # one home screen for every task
    for task in {record["group_id"] for record in seen}:  # a task's answers share its screenshot
        assert len({record["images"][1]["key"] for record in seen if record["group_id"] == task}) == 1
