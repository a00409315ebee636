"""The held-out loss (``eval.data``; docs/EVAL.md): the training objective's SFT loss on data the run does not
train on, exact and tree-packed, without gradients.

The held-out trajectories are planned as one step is (the run's layout: packed rows, walked trees,
sequence-parallel shards, every rank its share), their normalisers summed over the ranks, and each item's
restoration weights (``objective.normalisation``, ``objective.policy``) weigh the no-grad log-probs its
runner gives at its targets (the RL objective's old-policy path): ``eval/loss`` is the flat baseline's
``sum_i sum_t c_it * l_it`` over the whole set, to float round-off, at the tree's cost (``eval/tree_tokens``
of ``eval/flat_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.config import Config, ConfigError
from ds_tree.data import load_trajectories
from ds_tree.data.convert import load_tokenizer
from ds_tree.data.tree_dataset import read_meta
from ds_tree.engine.calls import in_process_group
from ds_tree.engine.runners import RunContext, runner_of
from ds_tree.errors import DataError
from ds_tree.losses.sft import restoration_weights
from ds_tree.losses.terms import sft_terms
from ds_tree.models.vision import attach_rope_positions
from ds_tree.objectives.rl_rows import even_out_forwards
from ds_tree.objectives.sft import global_normalisers
from ds_tree.packing.plan import RankPlan
from ds_tree.packing.rows import PackedRow
from ds_tree.run.dataset import path_limit
from ds_tree.trees.trajectory import Trajectory, check_vocab
from ds_tree.vocab.tokenizer import tokenizer_identity


@dataclass
class LossRun:
    """How this rank forwards its held-out items: the model (no gradients), where, and the step's plan."""

    model: torch.nn.Module
    plan: Callable[[list[Trajectory]], RankPlan]
    """This rank's items of a list of trajectories (the run's layout)."""
    run: RunContext


class HeldOutData:
    """``eval.data``'s trajectories, checked before any model is built, and their loss (module docstring)."""

    def __init__(self, config: Config, model_config) -> None:
        self.config = config
        path = config.eval.data
        try:
            self.trajectories = load_trajectories(path)
            check_vocab(self.trajectories, model_config.get_text_config().vocab_size)
            attach_rope_positions(model_config, self.trajectories)
        except (DataError, ValueError) as error:
            raise ConfigError(f"eval.data: {error}") from None
        check_tokenizer(config)
        check_fits(self.trajectories, config)

    def scalars(self, loss_run: LossRun) -> dict[str, float]:
        """``eval/loss``, ``eval/tree_tokens``, ``eval/flat_tokens`` (every rank alike: collectives)."""
        plan = loss_run.plan(self.trajectories)
        objective = self.config.objective
        total = torch.tensor([heldout_loss(loss_run, plan.rows, objective.normalisation, objective.policy)])
        dist.all_reduce(total)
        return {
            "eval/loss": float(total.item()),
            "eval/tree_tokens": float(plan.tree_tokens),
            "eval/flat_tokens": float(plan.flat_tokens),
        }


@torch.no_grad()
def heldout_loss(loss_run: LossRun, rows: Sequence[PackedRow], normalisation: str, policy: str) -> float:
    """This rank's share of the SFT loss of ``rows`` (float64), their normalisers summed over the ranks: each
    item's no-grad log-probs at its weighted targets, by its kind's runner. Every rank makes as many
    forwards (packed rows: the plan pads the ranks to one count; walked trees under ZeRO-3: evened out)."""
    normalisers = global_normalisers(rows)
    run = loss_run.run
    if run.dfs is not None and run.dfs.lockstep and in_process_group():
        even_out_forwards(loss_run.model, rows, run)
    total = 0.0
    for row in rows:
        terms = sft_terms(restoration_weights(row, normalisers, normalisation, policy))
        logprobs = runner_of(row).logprobs(loss_run.model, row, terms.targets, run)
        loss, _ = terms.loss(torch.as_tensor(logprobs), None, np.arange(terms.targets.size))
        total += float(loss)
    return total


def check_tokenizer(config: Config) -> None:
    """A converted ``eval.data`` must record the tokenizer of ``model.tokenizer`` (or, without one, of a
    converted ``data.path``): its ids would mean other text (a :class:`ConfigError` naming both)."""
    recorded = dataset_tokenizer(config.eval.data)
    if recorded is None:  # a tokens JSONL: ids only, nothing to compare
        return
    reference, where = None, ""
    if config.model.tokenizer:
        try:
            reference, where = tokenizer_identity(load_tokenizer(config.model.tokenizer)), "model.tokenizer"
        except DataError as error:
            raise ConfigError(f"model.tokenizer: {error}") from None
    elif config.data.path:
        reference, where = dataset_tokenizer(config.data.path), "data.path"
    if reference is None or reference.get("serialised_sha256") == recorded.get("serialised_sha256"):
        return
    raise ConfigError(
        f"eval.data ({config.eval.data}) was converted with the tokenizer {recorded.get('name_or_path')!r} "
        f"(sha256 {str(recorded.get('serialised_sha256'))[:12]}), {where} has another "
        f"({reference.get('name_or_path')!r}, sha256 {str(reference.get('serialised_sha256'))[:12]}): its token ids "
        f"mean other text. Convert it again with {where}'s tokenizer"
    )


def dataset_tokenizer(path: str) -> dict | None:
    """The tokenizer identity a converted dataset records (None: a tokens file, or none recorded)."""
    if not Path(path).is_dir():
        return None
    try:
        recorded = read_meta(path).get("tokenizer")
    except DataError as error:
        raise ConfigError(f"{path}: {error}") from None
    return recorded if isinstance(recorded, dict) else None


def check_fits(trajectories: list[Trajectory], config: Config) -> None:
    """Every held-out path fits one row, as training data must (dfs walks take any length)."""
    size = config.parallel.sequence_parallel_size
    budget = path_limit(config)
    longest = max(trajectories, key=len)
    if budget is not None and len(longest) > budget:
        raise ConfigError(
            f"eval.data: {longest.where} has {len(longest)} tokens, more than packing.budget"
            f"{' x parallel.sequence_parallel_size' if size > 1 else ''} ({budget}): every root-to-leaf path must "
            "fit one row"
        )
