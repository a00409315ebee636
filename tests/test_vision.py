"""Vision-language trees: processor folders, image identity in the trie, rotary positions on the tree,
and Qwen2.5-VL / Qwen3-VL tree vs flat in float64 with the vision tower run once per distinct image."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_tree.cli.make_tokenizer import VISION_FAMILIES
from ds_tree.cli.make_tokenizer import main as make_tokenizer_main
from ds_tree.errors import ConfigError, DataError
from ds_tree.models.loading import load_config as load_model_config
from ds_tree.models.loading import load_model
from ds_tree.models.vision import attach_rope_positions, check_vision_settings
from ds_tree.packing.parts import whole_tree
from ds_tree.packing.rows import assemble_row
from ds_tree.registries import MODEL_FAMILIES
from ds_tree.trees import trie as trie_module
from ds_tree.trees.images import TrajectoryImage
from ds_tree.trees.stats import tree_stats
from ds_tree.trees.trajectory import Trajectory
from ds_tree.trees.trie import build_forest, build_trees
from ds_tree.verify.tree_vs_flat import compare, compare_rl, run_mode
from ds_tree.vocab import vision_processor
from ds_tree.vocab.vision_processor import VISION_TOKENS, build_image_processor, load_vision_processor

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"qwen2_5_vl": "configs/models/tiny_qwen2_5_vl.json", "qwen3_vl": "configs/models/tiny_qwen3_vl.json"}
VISION_START, VISION_END, IMAGE_PAD = 1024, 1025, 1026


def make_image(family: str, seed: int, width_patches: int = 2, height_patches: int = 1) -> TrajectoryImage:
    """A random image of height_patches x width_patches merged patches (28x56 pixels for Qwen2.5-VL by default),
    processed by its family."""
    side = vision_processor.family(family).patch_size * 2
    pixels = np.random.default_rng(seed).random((side * height_patches, side * width_patches, 3))
    pixels = (pixels * 255).astype(np.uint8)
    out = build_image_processor(vision_processor.family(family))(images=[pixels], return_tensors="np")
    return TrajectoryImage.of(out["pixel_values"], out["image_grid_thw"][0])


def trajectory(parts, group="g", reward=None) -> Trajectory:
    """Ids and images in order: a list is text ids, an image becomes <|vision_start|> pads <|vision_end|>."""
    ids, index, images = [], [], []
    for part in parts:
        if isinstance(part, TrajectoryImage):
            ids += [VISION_START] + [IMAGE_PAD] * part.tokens + [VISION_END]
            index += [-1] + [len(images)] * part.tokens + [-1]
            images.append(part)
        else:
            ids += part
            index += [-1] * len(part)
    return Trajectory(
        np.array(ids), np.ones(len(ids)), group_id=group, reward=reward, images=tuple(images), image_index=index
    )


def agent_trees(family: str) -> list[Trajectory]:
    """Two tasks: a screenshot shared by every trial, one shared by a subtree, distinct ones with the same
    placeholder ids at the same place (they must not merge), a text-only trial, and a repeated image."""
    shared, subtree, other, late = (make_image(family, seed) for seed in range(4))
    wide = make_image(family, 4, width_patches=3)
    task = [3, 10, 11]
    return [
        trajectory([task, shared, [12, 13], subtree, [20, 21, 22]], reward=1.0),
        trajectory([task, shared, [12, 13], subtree, [30, 31]], reward=0.0),
        trajectory([task, shared, [12, 13], other, [20, 21, 22]], reward=1.0),  # same ids as the first: other image
        trajectory([task, shared, [12, 13], late, [5], shared, [40, 41]], reward=0.0),
        trajectory([task, [50, 51, 52]], reward=0.5),
        trajectory([[3, 60], wide, [61, 62]], group="h", reward=1.0),
        trajectory([[3, 60], wide, [63]], group="h", reward=0.0),
    ]


# ----------------------------------------------------------------------------- processor folders
@pytest.fixture(scope="module")
def processor_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("processor")
    assert make_tokenizer_main(["--output", str(folder), "--vision", "qwen2_5_vl"]) == 0
    return folder


def test_make_tokenizer_vision_writes_a_processor_folder(processor_folder):
    processor = load_vision_processor(processor_folder)
    assert processor.token_ids == dict(zip(VISION_TOKENS, [1024, 1025, 1026, 1027], strict=True))
    assert (processor_folder / "preprocessor_config.json").is_file()
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": "a.png"}]},
        {"role": "assistant", "content": "ok"},
    ]
    ids = processor.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    start = ids.index(VISION_START)
    assert ids[start : start + 3] == [VISION_START, IMAGE_PAD, VISION_END]
    grid = build_image_processor(processor.family)(images=[np.zeros((28, 56, 3), np.uint8)])["image_grid_thw"]
    assert [int(v) for v in grid[0]] == [1, 2, 4]  # 28x56 pixels: 2 merged tokens
    assert VISION_FAMILIES == tuple(name for name, spec in MODEL_FAMILIES.items() if spec.vision is not None)


# ----------------------------------------------------------------------------- trees
def test_images_merge_by_identity_never_by_placeholder_ids():
    family = "qwen2_5_vl"
    a, b = make_image(family, 0), make_image(family, 1)
    same = [trajectory([[3, 4], a, [5]]), trajectory([[3, 4], a, [6]])]
    different = [trajectory([[3, 4], a, [5]]), trajectory([[3, 4], b, [5]])]
    for group in (same, different):
        for t in group:
            t.rope_positions = np.broadcast_to(np.arange(len(t)), (3, len(t)))
    (tree_same,) = build_trees(same)
    (tree_different,) = build_trees(different)
    assert tree_same.n_tokens == len(same[0]) + 1 and len(tree_same.images) == 1
    assert tree_different.n_tokens == 2 * len(different[0]) - 3 and len(tree_different.images) == 2
    assert np.array_equal(different[0].input_ids, different[1].input_ids)  # only identity tells them apart


def test_dropping_image_identity_fails_loudly(monkeypatch):
    family = "qwen2_5_vl"
    different = [trajectory([[3, 4], make_image(family, 0), [5]]), trajectory([[3, 4], make_image(family, 1), [5]])]
    for t in different:
        t.rope_positions = np.broadcast_to(np.arange(len(t)), (3, len(t)))
    monkeypatch.setattr(trie_module, "trie_keys", lambda ids, *_: ids)  # a trie keyed on ids alone
    with pytest.raises(AssertionError, match="merged different images"):
        build_trees(different)


def test_rope_positions_must_agree_on_shared_tokens():
    image = make_image("qwen2_5_vl", 0)
    first, second = trajectory([[3, 4], image, [5]]), trajectory([[3, 4], image, [6]])
    first.rope_positions = np.broadcast_to(np.arange(len(first)), (3, len(first)))
    second.rope_positions = first.rope_positions.copy()
    second.rope_positions[1, 3] += 1  # a height position of the shared image differs
    with pytest.raises(DataError, match="rope positions .* at token 3 differ"):
        build_trees([first, second])
    second.rope_positions = None  # not attached: the tree can be counted, not forwarded
    first.rope_positions = None
    row = assemble_row([whole_tree(tree) for tree in build_trees([first, second])])
    with pytest.raises(ValueError, match="without its rope positions"):
        row.tensors()


def test_bad_image_layouts_are_data_errors():
    image = make_image("qwen2_5_vl", 0)
    with pytest.raises(DataError, match="needs 2 placeholder tokens, the trajectory has 1"):
        Trajectory(np.array([3, IMAGE_PAD, 5]), np.ones(3), images=(image,), image_index=[-1, 0, -1])
    with pytest.raises(DataError, match="has 8 patches but pixel_values"):
        TrajectoryImage.of(image.pixel_values[:4], image.grid_thw)


ONLINE = (
    "rollout.enabled=true rollout.reward=exact_match rollout.prompts=P data.path= objective.kind=grpo model.tokenizer=P"
)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("parallel.sequence_parallel_size=2 packing.mode=dfs", "parallel.sequence_parallel_size"),  # sharded walk
        (ONLINE, "rollout.env.path"),  # single-turn online RL: text prompts only
    ],
)
def test_refused_settings_name_their_field(tmp_path, override, field):
    from ds_tree.config import load_config
    from tests.helpers.configs import write_config

    path = write_config(tmp_path, tmp_path / "data", model={"source": str(ROOT / CONFIGS["qwen2_5_vl"])})
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    overrides = [item.replace("=P", f"={tmp_path / 'prompts.jsonl'}") for item in override.split()]
    config = load_config(path, overrides)
    with pytest.raises(ConfigError, match=re.escape(field)):
        check_vision_settings(config, load_model_config(config.model.source))


@pytest.mark.parametrize(
    "model_type", [name for name, spec in MODEL_FAMILIES.items() if spec.bidirectional_images]
)  # gemma3, gemma3n, paligemma
def test_bidirectional_image_attention_models_are_refused(tmp_path, model_type):
    config = tmp_path / f"{model_type}.json"
    config.write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(ValueError, match="bidirectionally.*Supported vision-language models: qwen2_5_vl, qwen3_vl"):
        load_model(config)


# ----------------------------------------------------------------------------- tree vs flat
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_vision_tower_encodes_each_distinct_image_once(family):
    trajectories = agent_trees(family)
    model = load_model(CONFIGS[family], dtype="float64")
    attach_rope_positions(model.config, trajectories)
    encoded = []  # images per tower call
    model.model.visual.register_forward_hook(
        lambda _module, _args, kwargs, _out: encoded.append(len(kwargs["grid_thw"])), with_kwargs=True
    )
    run_mode(model, trajectories, "tree", 4096, 1, "token_mean", "exact")
    groups = (trajectories[:5], trajectories[5:])
    distinct_per_tree = sum(len({image.key for t in group for image in t.images}) for group in groups)
    assert encoded == [distinct_per_tree] == [5]  # one row, one call
    encoded.clear()
    run_mode(model, trajectories, "flat", 4096, 1, "token_mean", "exact")
    # flat: once per trajectory and distinct image (the fourth shows one screenshot twice)
    assert sum(encoded) == sum(len({image.key for image in t.images}) for t in trajectories) == 10
    encoded.clear()
    run_mode(model, trajectories[4:5], "tree", 4096, 1, "token_mean", "exact")  # text only: one blank image
    assert encoded == [1]


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("budget", [4096, 40])
def test_sft_tree_equals_flat_in_float64(family, budget):
    report = compare(agent_trees(family), CONFIGS[family], dtype="float64", budget=budget)
    assert report["passed"], report
    assert report["tree_tokens"] < report["flat_tokens"]
    assert report["max_rel_grad_err"] <= 1e-10 and report["loss_rel_err"] <= 1e-10
    assert report["max_abs_logprob_err"] <= 1e-10


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_grpo_tree_equals_flat_in_float64(family):
    report = compare_rl(agent_trees(family), CONFIGS[family], estimator="grpo", dtype="float64")
    assert report["passed"], report
    assert report["max_rel_grad_err"] <= 1e-10 and report["max_abs_old_logprob_err"] <= 1e-10


def test_vision_gradients_are_checked():
    """The tower's parameters are among the compared gradients, and a gradient sent to it twice would fail."""
    trajectories = agent_trees("qwen2_5_vl")
    model = load_model(CONFIGS["qwen2_5_vl"], dtype="float64")
    attach_rope_positions(model.config, trajectories)
    flat = run_mode(model, trajectories, "flat", 4096, 1, "token_mean", "exact")
    tree = run_mode(model, trajectories, "tree", 4096, 1, "token_mean", "exact")
    tower = [name for name in flat.gradients if ".visual." in name]
    assert len(tower) >= 20 and all(torch.count_nonzero(flat.gradients[name]) for name in tower)
    doubled = {name: grad * (2 if ".visual." in name else 1) for name, grad in tree.gradients.items()}
    errors = [(doubled[n] - flat.gradients[n]).abs().max() / flat.gradients[n].abs().max() for n in tower]
    assert max(errors) > 0.5


# ----------------------------------------------------------------------------- chat data with images
def write_png(path, seed: int, size=(56, 28), mode="RGB") -> None:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).convert(mode).save(path)


def data_url(path) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def click(x: int) -> dict:
    return {"id": "c", "type": "function", "function": {"name": "click", "arguments": f'{{"x": {x}, "y": 4}}'}}


def gui_records(folder) -> list[dict]:
    """Two tasks; every trial of a task starts from the same screenshot (a file, or the same data URL)."""
    write_png(folder / "start.png", 0)
    for seed in (1, 2):
        write_png(folder / f"after{seed}.png", seed)
    start = {"type": "image", "image": "start.png"}
    records = []
    for trial, after in enumerate(("after1.png", "after2.png", "after1.png")):
        records.append(
            {
                "group_id": "task1",
                "trial": trial,
                "reward": float(trial == 0),
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Open the settings."}, start]},
                    {"role": "assistant", "content": None, "tool_calls": [click(trial)]},
                    {"role": "tool", "tool_call_id": "c", "content": [{"type": "image", "image": after}]},
                    {"role": "assistant", "content": "done"},
                ],
            }
        )
    shot = {"type": "image_url", "image_url": {"url": data_url(folder / "after2.png")}}
    for trial in range(2):
        records.append(
            {
                "group_id": "task2",
                "reward": float(trial),
                "messages": [
                    {"role": "user", "content": [shot, {"type": "text", "text": "Where is the menu?"}]},
                    {"role": "assistant", "content": ["top", "left"][trial]},
                ],
            }
        )
    return records


def write_jsonl(path, records) -> None:
    import json

    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_chat_with_images_converts_stores_each_image_once_and_verifies(processor_folder, tmp_path):
    from ds_tree.data import load_trajectories
    from ds_tree.data.convert import ConvertOptions, convert
    from ds_tree.data.tree_dataset import IMAGES_FILE

    write_jsonl(tmp_path / "gui.jsonl", gui_records(tmp_path))
    summary = convert([tmp_path / "gui.jsonl"], tmp_path / "dataset", processor_folder, ConvertOptions(format="chat"))
    assert summary["format_version"] == 3
    with np.load(tmp_path / "dataset" / IMAGES_FILE) as stored:
        assert len(stored["keys"]) == 3  # start, after1, after2 (a file and a data URL of one picture: one image)
    trajectories = load_trajectories(tmp_path / "dataset")
    assert [len(t.images) for t in trajectories] == [2, 2, 2, 1, 1]
    assert trajectories[0].images[0].key == trajectories[1].images[0].key
    assert trajectories[1].images[1].key == trajectories[3].images[0].key
    for t in trajectories:  # placeholders are untrained, the assistant's words are trained
        assert not np.any(t.loss_mask[t.image_index >= 0]) and t.loss_mask.sum() > 0
    report = compare(trajectories, CONFIGS["qwen2_5_vl"], dtype="float64")
    assert report["passed"] and report["tree_tokens"] < report["flat_tokens"], report


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ({"type": "image", "image": "missing.png"}, "image file 'missing.png' not found"),
        ({"type": "image", "image": "garbage.png"}, "unreadable image"),
        ({"type": "image", "image": "cmyk.jpg"}, "image mode 'CMYK' is not supported"),
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "base64 data URL"),
        ({"type": "image", "image": 3}, "needs 'image': a path"),
    ],
)
def test_bad_images_are_one_error_naming_file_and_line(processor_folder, tmp_path, broken, message):
    from ds_tree.data.convert import ConvertOptions, convert

    (tmp_path / "garbage.png").write_bytes(b"not a png")
    write_png(tmp_path / "cmyk.jpg", 3, mode="CMYK")
    records = gui_records(tmp_path)
    records[3]["messages"][0]["content"][0] = broken
    write_jsonl(tmp_path / "gui.jsonl", records)
    with pytest.raises(DataError, match=rf"gui\.jsonl:4: message 0: content part 0: .*{message}"):
        convert([tmp_path / "gui.jsonl"], tmp_path / "dataset", processor_folder, ConvertOptions(format="chat"))


GUI_IMAGES = [["start.png", "after1.png"], ["start.png", "after2.png"], ["start.png", "after1.png"], ["after2.png"]] + [
    ["after2.png"]
]
"""The images of each of :func:`gui_records`' records, in order (the data URL is after2.png's bytes)."""


def gui_tokens_records(folder, processor_folder, trajectories) -> list[dict]:
    """:func:`gui_records` in the tokens form: the chat conversion's ids and loss masks, the pixels processed here
    from the files (start.png as a .npy, after1.png as a nested list, after2.png as a .npy in a subfolder); every
    other record gives its image_index, the rest leave it to the placeholders."""
    from PIL import Image

    processor = load_vision_processor(processor_folder).image_processor
    (folder / "pixels").mkdir()
    given = {}
    for name, form in (("start.png", "start.npy"), ("after1.png", None), ("after2.png", "pixels/after2.npy")):
        out = processor(images=[np.asarray(Image.open(folder / name).convert("RGB"))], return_tensors="np")
        if form is not None:
            np.save(folder / form, out["pixel_values"])
        pixels = form if form is not None else out["pixel_values"].tolist()
        given[name] = {"pixel_values": pixels, "grid_thw": out["image_grid_thw"][0].tolist()}
    records = []
    for line, (t, names) in enumerate(zip(trajectories, GUI_IMAGES, strict=True)):
        record = {"group_id": t.group_id, "input_ids": t.input_ids.tolist(), "loss_mask": t.loss_mask.tolist()}
        record.update(reward=t.reward, images=[dict(given[name]) for name in names])
        if line % 2:
            record["image_index"] = t.image_index.tolist()
        records.append(record)
    return records


def test_tokens_records_with_processed_images_convert_as_chat_records_do(processor_folder, tmp_path):
    """The GUI data as chat records and as tokens records with processed pixels: the same trajectories, images
    and trees, each image stored once; and tree == flat in float64 on the tokens form."""
    from ds_tree.data import load_trajectories
    from ds_tree.data.convert import ConvertOptions, convert
    from ds_tree.data.tree_dataset import IMAGES_FILE

    write_jsonl(tmp_path / "gui.jsonl", gui_records(tmp_path))
    convert([tmp_path / "gui.jsonl"], tmp_path / "chat", processor_folder, ConvertOptions(format="chat"))
    from_chat = load_trajectories(tmp_path / "chat")
    write_jsonl(tmp_path / "tokens.jsonl", gui_tokens_records(tmp_path, processor_folder, from_chat))
    convert([tmp_path / "tokens.jsonl"], tmp_path / "tokens", processor_folder, ConvertOptions(format="tokens"))
    from_tokens = load_trajectories(tmp_path / "tokens")
    with pytest.raises(DataError, match=r"tokens\.jsonl:1: a record with images: convert the file first"):
        load_trajectories(tmp_path / "tokens.jsonl")  # read directly, its images would be dropped
    for chat, tokens in zip(from_chat, from_tokens, strict=True):
        assert np.array_equal(chat.input_ids, tokens.input_ids) and np.array_equal(chat.image_index, tokens.image_index)
        assert [i.key for i in chat.images] == [i.key for i in tokens.images]
        assert np.array_equal(chat.loss_mask, tokens.loss_mask) and chat.group_id == tokens.group_id
    with np.load(tmp_path / "tokens" / IMAGES_FILE) as stored:
        assert len(stored["keys"]) == 3
    for chat, tokens in zip(build_forest(from_chat), build_forest(from_tokens), strict=True):
        assert [i.key for i in chat.images] == [i.key for i in tokens.images]
        for name in ("input_ids", "kv_end", "image_id", "image_patch"):
            assert np.array_equal(getattr(chat, name), getattr(tokens, name)), name
    report = compare(from_tokens, CONFIGS["qwen2_5_vl"], dtype="float64")
    assert report["passed"] and report["tree_tokens"] < report["flat_tokens"], report
    assert report["max_rel_grad_err"] <= 1e-10 and report["loss_rel_err"] <= 1e-10, report


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r["images"][0].update(grid_thw=[1, 4, 4]), r"images\[0\]: image grid \(1, 4, 4\) has 16 patches"),
        (
            lambda r: r["images"][0].update(pixel_values="garbage.npy"),
            r"images\[0\]: unreadable .npy file 'garbage.npy'",
        ),
        (
            lambda r: r["images"][0].update(pixel_values="missing.npy"),
            r"images\[0\]: pixel_values file 'missing.npy' not",
        ),
        (
            lambda r: r["images"][0].update(pixel_values=[[0.5] * 5] * 8),
            r"images\[0\]: pixel_values has shape \(8, 5\)",
        ),
        (
            lambda r: (r["images"].pop(), r.pop("image_index")),
            r"grids \[\(1, 2, 4\)\] need 2 placeholder token\(s\) \(id 1026\), input_ids has 4",
        ),
        (lambda r: r.update(image_index=[-1] * len(r["input_ids"])), r"token \d+: image_index -1 but input_ids 1026"),
        (lambda r: r["images"][0].pop("grid_thw"), r"images\[0\]: an image is an object with exactly"),
    ],
)
def test_bad_processed_images_are_one_error_naming_file_and_line(processor_folder, tmp_path, change, message):
    from ds_tree.data import load_trajectories
    from ds_tree.data.convert import ConvertOptions, convert

    write_jsonl(tmp_path / "gui.jsonl", gui_records(tmp_path))
    convert([tmp_path / "gui.jsonl"], tmp_path / "chat", processor_folder, ConvertOptions(format="chat"))
    records = gui_tokens_records(tmp_path, processor_folder, load_trajectories(tmp_path / "chat"))
    (tmp_path / "garbage.npy").write_bytes(b"not an array")
    change(records[1])
    write_jsonl(tmp_path / "tokens.jsonl", records)
    with pytest.raises(DataError, match=rf"tokens\.jsonl:2: .*{message}"):
        convert([tmp_path / "tokens.jsonl"], tmp_path / "tokens", processor_folder, ConvertOptions(format="tokens"))


def test_image_parts_and_processed_images_need_a_processor_folder():
    from ds_tree.data.chat import render_chat
    from ds_tree.data.convert import Converter, ConvertOptions
    from ds_tree.vocab.tokenizer import build_tokenizer

    messages = [
        {"role": "user", "content": [{"type": "image", "image": "a.png"}]},
        {"role": "assistant", "content": "ok"},
    ]
    with pytest.raises(DataError, match="make-tokenizer --vision"):
        render_chat(build_tokenizer(300), messages, where="x.jsonl:1")
    record = {"group_id": "g", "input_ids": [3, 1026, 1026, 4], "loss_mask": [0, 0, 0, 1]}
    record["images"] = [{"pixel_values": [[0.0] * 1176] * 8, "grid_thw": [1, 2, 4]}]
    with pytest.raises(DataError, match=r"x\.jsonl:1: 'images' need a processor folder as --tokenizer"):
        Converter(ConvertOptions(format="tokens"), build_tokenizer(300)).trajectories("x.jsonl:1", record)


@pytest.mark.distributed
def test_two_ranks_zero3_match_single_process_flat(processor_folder, tmp_path):
    """The trainer's step on 2 gloo ranks, ZeRO-3, trees split into parts (budget 120), rows with and
    without images on the ranks: every gradient (the tower's included) equals one process's flat step."""
    import json

    from ds_tree.data.convert import ConvertOptions, convert
    from tests.helpers.configs import write_accumulating_ds_config, write_config
    from tests.helpers.launch import torchrun

    text_only = [  # a task without images: rows of it call the tower on a blank patch (ZeRO-3 pairs the calls)
        {"group_id": "task3", "reward": float(trial), "messages": [{"role": "user", "content": "Hi"}, answer]}
        for trial, answer in enumerate(
            [{"role": "assistant", "content": "Hello."}, {"role": "assistant", "content": "Hey"}]
        )
    ]
    write_jsonl(tmp_path / "gui.jsonl", gui_records(tmp_path) + text_only)
    convert([tmp_path / "gui.jsonl"], tmp_path / "dataset", processor_folder, ConvertOptions(format="chat"))
    config = write_config(
        tmp_path,
        tmp_path / "dataset",
        model={"source": str(ROOT / CONFIGS["qwen2_5_vl"]), "seed": 3},
        deepspeed=str(write_accumulating_ds_config(tmp_path / "ds.json", 3)),
        packing={"budget": 120},
    )
    out = tmp_path / "report.json"
    torchrun("tests/distributed/grad_check.py", "--config", str(config), "--out", str(out), "data.groups_per_step=3")
    report = json.loads(out.read_text())
    assert report["zero_stage"] == 3 and report["world_size"] == 2 and report["min_micro_batches_per_rank"] >= 2
    # float32 round-off, as for the text models (tests/test_engine.py): measured 6.8e-7 and 5.5e-6
    assert report["max_rel_grad_err"] < 1e-5, report
    assert report["max_rel_param_err"] < 1e-5, report


@pytest.mark.distributed
def test_two_rank_zero3_training_self_check_passes_on_gui_data(tmp_path):
    """A training run (``ds_tree.train`` under the DeepSpeed launcher, 2 gloo ranks, ZeRO-3) of the tiny
    Qwen3-VL (deepstack) on converted GUI data with ``objective.self_check: first``: the check's sample (two
    trials sharing their first screenshot) runs tree and flat, each trajectory with its own images, on
    both ranks with the tower gathered by ZeRO-3's hooks, compares every parameter and passes.
    (``tests/test_self_check.py`` injects merged and dropped images into the same check: it stops.)"""
    import json

    from ds_tree.data.convert import ConvertOptions, convert
    from ds_tree.data.gui_synthetic import write_gui_chat
    from tests.helpers.configs import write_config
    from tests.helpers.launch import launch_training

    assert make_tokenizer_main(["--output", str(tmp_path / "processor"), "--vision", "qwen3_vl"]) == 0
    path = write_gui_chat(tmp_path / "gui", tasks=2, trials=4, side=32)  # 32x32 pixels: one merged token each
    convert([path], tmp_path / "dataset", tmp_path / "processor", ConvertOptions(format="chat"))
    source = str(ROOT / CONFIGS["qwen3_vl"])
    config = write_config(tmp_path, tmp_path / "dataset", model={"source": source})
    process = launch_training(config, "data.groups_per_step=2", "objective.self_check=first")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-4000:]
    parameters = sum(1 for _ in load_model(source).parameters())
    assert re.search(rf"self-check step 1: tree vs flat .* over {parameters} parameters", output), output[-4000:]
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["selfcheck/tokens"] > 0 and record["selfcheck/max_grad_rel_err"] < 1e-5, record
    assert record["selfcheck/loss_rel_err"] < 1e-5 and record["selfcheck/max_abs_logprob_err"] < 1e-5, record


def test_gui_synthetic_data_shares_screenshots_as_trees_do(processor_folder, tmp_path):
    from ds_tree.data import load_trajectories
    from ds_tree.data.convert import ConvertOptions, convert
    from ds_tree.data.gui_synthetic import write_gui_chat
    from ds_tree.data.tree_dataset import IMAGES_FILE

    path = write_gui_chat(tmp_path / "gui", tasks=2, trials=4, side=28)
    convert([path], tmp_path / "dataset", processor_folder, ConvertOptions(format="chat"))
    with np.load(tmp_path / "dataset" / IMAGES_FILE) as stored:
        assert len(stored["keys"]) == 2 * 7  # per task: 1 shared by all, 2 by halves, 4 by quarters
    trajectories = load_trajectories(tmp_path / "dataset")
    assert [len(t.images) for t in trajectories] == [3] * 8
    stats = tree_stats(build_forest(trajectories))  # ds-tree stats
    assert stats["images"] == {
        "images_flat": 24,
        "images_tree": 14,
        "patches_flat": 24 * 4,  # 28x28 pixels: grid (1, 2, 2) of 14-pixel patches
        "patches_tree": 14 * 4,
        "patches_saved": 1 - 14 / 24,
    }
    attach_rope_positions(load_model_config(CONFIGS["qwen2_5_vl"]), trajectories)
    trees = build_trees(trajectories[:4])
    assert len(trees) == 1 and len(trees[0].images) == 7


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("chunk", [5, 64])
def test_dfs_walk_equals_flat_in_float64(family, chunk):
    """The walk in chunks that cut images (5 tokens) and hold whole subtrees (64): SFT and GRPO."""
    from ds_tree.engine.dfs import DfsSettings

    report = compare(agent_trees(family), CONFIGS[family], dtype="float64", dfs=DfsSettings(chunk))
    assert report["passed"] and report["dfs_max_rel_grad_err"] <= 1e-10, report
    report = compare_rl(agent_trees(family), CONFIGS[family], estimator="grpo", dtype="float64", dfs=DfsSettings(chunk))
    assert report["passed"] and report["dfs_max_rel_grad_err"] <= 1e-10, report


def walked_trees(family: str) -> list[Trajectory]:
    """A walk in chunks of 5 tokens meets each way an image can recur: a 2x2-patch screenshot in the shared
    prefix (text chunks after it: their rotary positions are not the depths) shown again deeper in one path,
    where a chunk boundary cuts it, and one screenshot in two sibling branches (owned by their fork's chunk)."""
    screen, button, menu = make_image(family, 10, height_patches=2), make_image(family, 11), make_image(family, 12)
    task = [3, 10, 11]
    return [
        trajectory([task, screen, [12, 13, 14, 15, 16, 17], button, [20, 21, 22]], reward=1.0),
        trajectory([task, screen, [12, 13, 14, 15, 16, 18], button, [30, 31]], reward=0.0),
        trajectory([task, screen, [12, 13, 14, 15, 16, 19], menu, [5, 6], screen, [40]], reward=0.5),
        trajectory([task, [50, 51, 52]], reward=0.0),
    ]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_dfs_walk_encodes_each_distinct_image_once(family):
    """Each distinct image of a walk goes through the tower once, forward, and its gradient (the sum of every
    chunk's that reads it) reaches the tower once; with ``recompute`` its owner chunk encodes it again."""
    from ds_tree.engine.dfs import DfsSettings

    trajectories = walked_trees(family)
    model = load_model(CONFIGS[family], dtype="float64")
    attach_rope_positions(model.config, trajectories)
    forwards, backwards = [], []  # real images per tower call (the blank patch of a chunk without any left out)

    def count(_module, args, kwargs, output):
        if args[0].any():
            images = len(kwargs["grid_thw"])
            forwards.append(images)
            if output.pooler_output.requires_grad:
                output.pooler_output.register_hook(lambda _grad: backwards.append(images))

    model.model.visual.register_forward_hook(count, with_kwargs=True)
    distinct = len({image.key for t in trajectories for image in t.images})
    assert distinct == 3
    run_mode(model, trajectories, "dfs", 4096, 1, "token_mean", "exact", dfs=DfsSettings(5))
    # the training walk, then the no-grad walk of the log-probs (run_mode)
    assert sum(forwards) == 2 * distinct and sum(backwards) == distinct, (forwards, backwards)
    forwards.clear(), backwards.clear()
    run_mode(model, trajectories, "dfs", 4096, 1, "token_mean", "exact", dfs=DfsSettings(5, recompute=True))
    assert sum(backwards) == distinct and sum(forwards) <= 3 * distinct, (forwards, backwards)


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("recompute", [False, True])
def test_dfs_walk_with_cached_images_equals_flat_in_float64(family, recompute):
    from ds_tree.engine.dfs import DfsSettings

    dfs = DfsSettings(5, recompute=recompute)
    report = compare(walked_trees(family), CONFIGS[family], dtype="float64", dfs=dfs)
    assert report["passed"] and report["dfs_max_rel_grad_err"] <= 1e-10, report
    assert report["dfs_loss_rel_err"] <= 1e-10 and report["dfs_max_abs_logprob_err"] <= 1e-10, report
    report = compare_rl(walked_trees(family), CONFIGS[family], estimator="grpo", dtype="float64", dfs=dfs)
    assert report["passed"] and report["dfs_max_rel_grad_err"] <= 1e-10, report


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_lora_adapters_tree_equals_flat_in_float64(family):
    from ds_tree.config import LoraSettings

    report = compare(agent_trees(family), CONFIGS[family], dtype="float64", lora=LoraSettings(rank=4))
    assert report["passed"] and report["max_rel_grad_err"] <= 1e-10, report


def test_images_need_a_vision_language_model():
    with pytest.raises(ValueError, match="has no vision tower"):
        attach_rope_positions(load_model_config("configs/models/tiny_qwen3.json"), agent_trees("qwen2_5_vl"))
