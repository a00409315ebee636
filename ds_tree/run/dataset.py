"""A run's offline data, checked before any process group exists: ``data.path``'s groups (a converted dataset
without images read lazily, else loaded whole), the start-up checks that name the trajectory at fault, and the
step sampler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ds_tree.config import Config, ConfigError
from ds_tree.data import load_trajectories
from ds_tree.data.dataset_reader import LoadedGroups, TreeDatasetReader
from ds_tree.data.sampler import StepSampler
from ds_tree.data.tree_dataset import is_tree_dataset_dir
from ds_tree.errors import DataError
from ds_tree.models.vision import attach_rope_positions
from ds_tree.trees.trajectory import Trajectory, check_vocab, group_trajectories

DataCheck = Callable[[list[Trajectory]], None]
"""An objective's check of the trajectories it trains on (``None``: it reads none of them)."""
CHECK_BATCH = 1024
"""Groups of a converted dataset read at a time by the start-up checks (a batch in memory, not the dataset)."""


@dataclass
class TrainingData:
    """What the trainer keeps of ``data.path``."""

    trajectories: list[Trajectory]
    """The trajectories when they are loaded whole (tokens JSONL; empty for a converted dataset)."""
    groups: LoadedGroups | TreeDatasetReader
    """The groups by index: a converted dataset read lazily (each step reads only the groups a rank needs), or
    tokens JSONL held in memory."""
    sampler: StepSampler
    """Which groups each step takes."""


def prepare_dataset(config: Config, model_config, check_data: DataCheck | None) -> TrainingData:
    """``data.path``'s groups, checked against ``model_config`` and by the objective's ``check_data``, and the
    step sampler."""
    path, reader = Path(config.data.path), None
    try:
        if is_tree_dataset_dir(path):
            reader = TreeDatasetReader(path)
            if "image_keys" in reader.table.column_names:  # images: loaded whole (docs/DATA.md)
                reader = None
        trajectories = load_trajectories(path) if reader is None else []
    except DataError as error:
        raise ConfigError(f"data.path: {error}") from None
    if reader is not None:
        check_converted(config, model_config, check_data, reader)
        groups = reader
    else:
        groups = check_loaded(config, model_config, check_data, trajectories)
    return TrainingData(trajectories, groups, step_sampler(config, groups.n_groups))


def check_loaded(
    config: Config, model_config, check_data: DataCheck | None, trajectories: list[Trajectory]
) -> LoadedGroups:
    """Checks of a dataset loaded whole; its groups."""
    check_vocab(trajectories, model_config.get_text_config().vocab_size)
    try:  # images: positions by the model's rule, laid out on the trees when they are built
        attach_rope_positions(model_config, trajectories)
    except ValueError as error:
        raise ConfigError(f"model.source: {error} (data.path {config.data.path})") from None
    longest = max(trajectories, key=len)
    check_longest(config, len(longest), longest.source or f"group {longest.group_id!r}")
    groups = LoadedGroups(group_trajectories(trajectories))
    step_sampler(config, groups.n_groups)  # groups_per_step before the objective's checks, as a run reports them
    if check_data is not None:
        check_data(trajectories)
    return groups


def check_converted(config: Config, model_config, check_data: DataCheck | None, reader: TreeDatasetReader) -> None:
    """Checks of a converted dataset read lazily: from its mapped columns (largest token id, longest trajectory),
    and the objective's checks a batch of groups at a time (memory bounded by a batch, not the dataset)."""
    vocab = model_config.get_text_config().vocab_size
    if reader.max_token_id() >= vocab:  # name the first trajectory over it
        for groups in reader.batches(CHECK_BATCH):
            check_vocab([t for group in groups for t in group], vocab)
    tokens, row = reader.longest_trajectory()
    longest = max(reader.groups([row])[0], key=len) if tokens else None
    check_longest(config, tokens, longest.where if longest is not None else "")
    step_sampler(config, reader.n_groups)
    if check_data is not None:  # the objective reads the data
        for groups in reader.batches(CHECK_BATCH):
            check_data([t for group in groups for t in group])


def path_limit(config: Config) -> int | None:
    """The longest root-to-leaf path one row takes (a sequence-parallel group's under SP); None where dfs walks
    paths of any length. Training and held-out data alike must fit it."""
    if config.packing.uses_dfs:
        return None
    return config.packing.budget * config.parallel.sequence_parallel_size


def check_longest(config: Config, tokens: int, where: str) -> None:
    """Every root-to-leaf path fits a row (a sequence-parallel group's under SP), unless dfs walks it."""
    size = config.parallel.sequence_parallel_size
    budget = path_limit(config)
    if budget is not None and tokens > budget:
        limit = f"packing.budget ({budget})"
        if size > 1:
            limit = f"packing.budget x parallel.sequence_parallel_size ({config.packing.budget} x {size})"
        raise ConfigError(
            f"{limit} is below the longest trajectory ({tokens} tokens, {where}); "
            "every root-to-leaf path must fit one row"
        )


def step_sampler(config: Config, groups: int) -> StepSampler:
    """The step sampler over ``groups`` groups; a step's groups are distinct (else some are trained twice)."""
    if config.data.groups_per_step > groups:  # a step would train some groups twice
        raise ConfigError(
            f"data.groups_per_step ({config.data.groups_per_step}) is more than the {groups} groups "
            f"in data.path ({config.data.path}); set it to at most {groups}"
        )
    return StepSampler(groups, config.data.groups_per_step, config.data.seed)
