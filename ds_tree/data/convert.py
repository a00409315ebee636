"""Chat, tokens or explicit-tree records -> a tree dataset (``ds_tree.data.tree_dataset``).

Inputs: JSONL (.jsonl or .jsonl.gz, one record a line), Parquet files (.parquet) and Hugging Face datasets
folders (``save_to_disk``), one record a row, read a batch at a time (:mod:`ds_tree.data.arrow_records`).
Formats:
  chat    {"group_id", "trial"?, "messages": [OpenAI messages], "tools"?, "reward"?}
  tokens  {"group_id", "input_ids", "loss_mask" | "labels", "reward"?, "trial"?, "logprobs"?, "advantages"?,
           "images"?, "image_index"?}   (images already processed: ds_tree.data.token_images)
  tree    {"group_id"?, "tools"?, "nodes": [{"id", "parent", "input_ids" | "messages", ...}]}
  preference  {"prompt"?, "chosen", "rejected", "tools"?, "group_id"?}   (TRL's; ds_tree.data.preference)
The RL rollout fields ``logprobs`` and ``advantages`` (one entry per token) pass through the tokens
and tree formats; a chat record cannot carry them, since its tokens are known only after rendering.
A bad line stops the run with its file:line and reason; ``skip_bad`` skips it and counts it by
reason instead. ``prefix_policy`` says what happens to a conversation whose chat template is not
prefix-stable: "full" keeps it with the unstable assistant turns untrained, "drop" skips it,
"error" stops; either way it is counted. Nothing is written at the output unless the whole run
succeeds.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ds_tree.data.arrow_records import is_arrow_input, read_arrow_records
from ds_tree.data.chat import TRAIN_ON, check_text, render_chat
from ds_tree.data.chat_images import MAX_IMAGE_PIXELS, ImageReader, check_parts, image_parts
from ds_tree.data.explicit import trajectories_from_explicit_tree
from ds_tree.data.jsonl import read_jsonl
from ds_tree.data.preference import preference_trajectories
from ds_tree.data.records import MISSING, PER_TOKEN_FIELDS, group_id
from ds_tree.data.token_images import ProcessedImageReader, given_image_index, placeholder_index
from ds_tree.data.tokens import trajectory_from_record
from ds_tree.data.tree_dataset import check_output_dir, save_tree_dataset
from ds_tree.errors import DataError, RecordError
from ds_tree.hub import TOKENIZER_FILES, local_path
from ds_tree.trees.images import TrajectoryImage
from ds_tree.trees.stats import TokenCounts
from ds_tree.trees.trajectory import Trajectory, check_vocab
from ds_tree.vocab.tokenizer import tokenizer_identity
from ds_tree.vocab.vision_processor import VisionProcessor, load_vision_processor

FORMATS = ("chat", "tokens", "tree", "preference")
MERGES = ("group", "global")
PREFIX_POLICIES = ("full", "drop", "error")
GLOBAL_GROUP = "all"
"""The group id every trajectory gets with ``merge="global"``."""


@dataclass(frozen=True)
class ConvertOptions:
    format: str = "chat"
    """One of :data:`FORMATS`."""
    group_key: str = "group_id"
    """Record field naming the tree a line belongs to."""
    train_on: str = "assistant"
    """Which assistant turns a chat is trained on, one of ``ds_tree.data.chat.TRAIN_ON``."""
    merge: str = "group"
    """``group``: one tree per group; ``global``: every trajectory in one group."""
    prefix_policy: str = "full"
    """One of :data:`PREFIX_POLICIES` (see the module docstring)."""
    skip_bad: bool = False
    """Skip malformed lines, counted by reason, instead of stopping."""
    limit: int | None = None
    """Read at most this many records in total."""
    max_image_pixels: int = MAX_IMAGE_PIXELS
    """Largest image (width x height) of an image part, checked from its header before decoding
    (:func:`~ds_tree.data.chat_images.check_image_size`)."""

    def __post_init__(self) -> None:
        for name, allowed in (
            ("format", FORMATS),
            ("train_on", TRAIN_ON),
            ("merge", MERGES),
            ("prefix_policy", PREFIX_POLICIES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {self.max_image_pixels}")


def read_records(paths: list[Path], limit: int | None) -> Iterator[tuple[str, dict | DataError]]:
    """``(file:line, record)`` (``PATH:row N`` for Parquet and datasets folders) over all inputs, at most
    ``limit`` records; bad lines come as errors in place of records so that ``skip_bad`` can go on past them."""
    count = 0
    for path in paths:
        records = read_arrow_records(path) if is_arrow_input(path) else read_jsonl(path, keep_going=True)
        for where, record in records:
            if limit is not None and count >= limit:
                return
            count += 1
            yield where, record


def load_tokenizer(path: str | Path):
    """A Hugging Face tokenizer from a local directory or a hub id's cached snapshot (:mod:`ds_tree.hub`);
    a clear :class:`DataError` (:class:`~ds_tree.errors.HubError` for a hub id) otherwise."""
    from transformers import AutoTokenizer

    path = local_path(path, TOKENIZER_FILES)
    if not path.is_dir():
        raise DataError(f"{path}: no such tokenizer directory")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"{path}: not a loadable tokenizer directory ({reason})") from error


class Converter:
    """Turns records of one format into trajectories and keeps the counts for the summary."""

    def __init__(self, options: ConvertOptions, tokenizer, vision: VisionProcessor | None = None) -> None:
        self.options = options
        self.tokenizer = tokenizer
        self.vision = vision
        """A processor folder's image side: chat records may then hold image parts (ds_tree.data.chat_images)."""
        self.images = (
            ImageReader(vision.image_processor, vision.family.merge_size, options.max_image_pixels) if vision else None
        )
        self.processed_images = (
            ProcessedImageReader(vision.family.merge_size, vision.family.patch_values) if vision else None
        )
        """Reads the already processed images of tokens records (ds_tree.data.token_images)."""
        self.prefix_unstable = 0  # trajectories kept with unstable turns untrained (policy "full")

    def group_id(self, where: str, record: dict, default: object = MISSING) -> str | int:
        value = group_id(where, record.get(self.options.group_key, default), self.options.group_key)
        try:  # saved in the dataset: a lone surrogate would fail the write after the whole run
            check_text(f"{where}: {self.options.group_key}", value)
        except ValueError as error:
            raise RecordError("invalid_text", str(error)) from None
        return value

    def read_images(self, where: str, messages: object) -> list[TrajectoryImage]:
        """The images of a chat record's messages, in rendering order (none without a processor folder)."""
        if self.images is None or not isinstance(messages, list):
            return []
        images = []
        for index, j, part in image_parts(messages):
            check_parts(f"{where}: message {index}", messages[index]["content"])
            images.append(self.images.read(where, f"{where}: message {index}: content part {j}", part))
        return images

    def render(
        self, where: str, messages: object, tools: object, images: list[TrajectoryImage] = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        rendered = render_chat(
            self.tokenizer,
            messages,
            tools,
            where=where,
            train_on=self.options.train_on,
            image_token_id=self.vision.image_token_id if self.vision else None,
            image_tokens=[image.tokens for image in images],
        )
        if rendered.unstable_turns:
            message = f"{where}: the chat template is not prefix-stable for {rendered.unstable_turns} assistant turn(s)"
            if self.options.prefix_policy != "full":
                raise RecordError("prefix_unstable", message)
            self.prefix_unstable += 1
        return rendered.input_ids, rendered.loss_mask

    def trajectories(self, where: str, record: dict) -> list[Trajectory]:
        """The trajectories of one record; with a processor folder its image tokens are never trained
        (:meth:`untrain_placeholders`), whatever ``--train-on all`` or a record's ``loss_mask`` says."""
        trajectories = self.record_trajectories(where, record)
        if self.vision is not None:
            for trajectory in trajectories:
                self.untrain_placeholders(trajectory)
        return trajectories

    def untrain_placeholders(self, trajectory: Trajectory) -> None:
        """Zero the loss of ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>`` (and ``<|video_pad|>``):
        their targets are the processor's layout, not something the model writes."""
        placeholders = np.isin(trajectory.input_ids, list(self.vision.token_ids.values()))
        trajectory.loss_mask[placeholders] = 0.0

    def record_trajectories(self, where: str, record: dict) -> list[Trajectory]:
        form = self.options.format
        if form == "tree":
            group = self.group_id(where, record, default=where)  # a tree line is a group by itself

            def tokenize(messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
                if isinstance(messages, list) and image_parts(messages):
                    raise RecordError(
                        "images_in_tree",
                        f"{where}: a node's messages hold image parts; explicit trees do not carry images yet: give "
                        "each path as a chat record (--format chat), whose shared screenshots merge into one tree",
                    )
                return self.render(where, messages, record.get("tools"))

            trajectories = trajectories_from_explicit_tree(record, where, tokenize)
            for trajectory in trajectories:
                trajectory.group_id = group
            return trajectories
        if form == "preference":  # a record is a tree by itself unless its group key says otherwise
            return preference_trajectories(where, record, self.tokenizer, self.group_id(where, record, default=where))
        group = self.group_id(where, record)
        if form == "chat":
            carried = [name for name in PER_TOKEN_FIELDS if record.get(name) is not None]
            if carried:
                raise RecordError(
                    "per_token_fields_in_chat",
                    f"{where}: field {carried[0]!r} is not allowed in a chat record (its tokens are known only "
                    "after rendering); give rollouts with their tokens (--format tokens or tree)",
                )
            images = self.read_images(where, record.get("messages"))
            input_ids, loss_mask = self.render(where, record.get("messages"), record.get("tools"), images)
            # Reuse the tokens reader's field checks (reward, trial) on the rendered record.
            record = {**record, "input_ids": input_ids.tolist(), "loss_mask": loss_mask.tolist()}
            trajectory = trajectory_from_record(where, {**record, "group_id": group})
            if images:
                index = placeholder_index(where, trajectory.input_ids, self.vision.image_token_id, images)
                trajectory = dataclasses.replace(trajectory, images=tuple(images), image_index=index)
            return [trajectory]
        trajectory = trajectory_from_record(where, {**record, "group_id": group})
        if record.get("images") is not None or record.get("image_index") is not None:
            trajectory = self.with_processed_images(where, record, trajectory)
        return [trajectory]

    def with_processed_images(self, where: str, record: dict, trajectory: Trajectory) -> Trajectory:
        """A tokens record's trajectory with its already processed ``images`` (ds_tree.data.token_images)."""
        if self.vision is None:
            raise RecordError(
                "bad_image",
                f"{where}: 'images' need a processor folder as --tokenizer (ds-tree make-tokenizer --vision FAMILY), "
                "which gives the placeholder id, the merge size and the patch size",
            )
        if record.get("images") is None:
            raise RecordError("bad_image", f"{where}: 'image_index' without 'images'")
        images = self.processed_images.read(where, record["images"])
        image_token_id = self.vision.image_token_id
        if record.get("image_index") is None:
            index = placeholder_index(where, trajectory.input_ids, image_token_id, images)
        else:
            index = given_image_index(where, record["image_index"], trajectory.input_ids, image_token_id)
        try:
            return dataclasses.replace(trajectory, images=tuple(images), image_index=index)
        except DataError as error:
            raise RecordError("bad_image", str(error)) from None


def convert(
    inputs: list[Path], output: Path, tokenizer_dir: str | Path, options: ConvertOptions, overwrite: bool = False
) -> dict:
    """Run the conversion; returns the summary (the dataset's meta file, its path and its POR)."""
    check_output_dir(output, overwrite, inputs)  # fail before the work, not after
    tokenizer = load_tokenizer(tokenizer_dir)
    converter = Converter(options, tokenizer, load_vision_processor(tokenizer_dir))
    trajectories: list[Trajectory] = []
    skipped: Counter[str] = Counter()
    lines = 0
    progress = tqdm(read_records(inputs, options.limit), unit=" records", file=sys.stderr, delay=2.0)
    for where, record in progress:
        lines += 1
        try:
            if isinstance(record, DataError):
                raise record
            trajectories.extend(converter.trajectories(where, record))
        except DataError as error:
            reason = getattr(error, "reason", "bad_record")
            dropped_by_policy = reason == "prefix_unstable" and options.prefix_policy == "drop"
            if not (options.skip_bad or dropped_by_policy):
                raise
            skipped[reason] += 1
    if options.merge == "global":
        for trajectory in trajectories:
            trajectory.group_id = GLOBAL_GROUP
    check_vocab(trajectories, len(tokenizer))
    meta = {
        "tokenizer": tokenizer_identity(tokenizer),
        "inputs": [str(path) for path in inputs],
        "options": {
            "format": options.format,
            "group_key": options.group_key,
            "train_on": options.train_on,
            "merge": options.merge,
            "prefix_policy": options.prefix_policy,
            "limit": options.limit,
        },
        "lines": lines,
        "skipped": dict(sorted(skipped.items())),
        "prefix_unstable_kept": converter.prefix_unstable,
    }
    meta = save_tree_dataset(trajectories, output, meta, overwrite=overwrite, inputs=inputs)
    counts = TokenCounts(meta["counts"]["flat_tokens"], meta["counts"]["tree_tokens"])
    return {"output": str(output), **meta, "por": counts.por}
