"""Multi-turn rollouts as trees: an agent talks to an environment, branching at turn boundaries.

One task (a line of ``rollout.prompts``) gives one episode tree (docs/ENVIRONMENTS.md):

- the environment's ``reset`` messages are rendered into the root (context, untrained);
- at turn boundary ``k`` (``k = 0`` is the prompt) with ``k < rollout.max_depth``, a live leaf owning
  ``q > 1`` of the task's ``rollout.width`` leaves forks into ``min(q, rollout.branching)`` children
  (``q`` at the last boundary), the sampler's quota rule with turns for segments. Its environment
  is forked once per extra child (``rollout.env.fork``: copy / replay; ``none`` forks at the prompt
  only, where each child gets a fresh environment), so siblings continue the same episode state;
- the children's assistant turns are sampled from the same exact token prefix in one call of the
  turn sampler (:class:`HFTurnSampler`: the existing tree sampler, the prefix encoded once, its
  keys/values shared by the siblings), each stopping at the turn's end token;
- each child's turn is parsed (tool calls) and stepped in its environment; the observation is
  bridged onto the sampled ids (:meth:`~ds_tree.rollout.render.Renderer.bridge`, never re-rendering
  the sampled turn).

A node holds one turn: its sampled tokens (trained, with the sampler's log-probs and the policy
version, the training step, that sampled them) followed by the observation's tokens (context). A
leaf's reward is the sum of its path's turn rewards plus the environment's ``score`` if it has one;
GRPO/RLOO compare leaves of a task, TreePO's sub-groups are the turn nodes (the trie's branch
points are turn boundaries). Per-turn rewards are saved with each leaf (``turn_rewards``).

Failures stay inside the leaf they hit (:data:`STOP_REASONS`): a malformed tool call is answered with
a parse-error observation; a ``step`` over ``step_timeout_s`` with a tool error; an environment method
that raises or returns the wrong type ends the leaf with ``env_error`` (logged with task and turn,
counted, the leaf dropped from the loss); ``episode_timeout_s`` stops leaves with ``timeout``; a turn
that would pass ``max_context_tokens`` stops with ``length``, keeping every sampled token.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ds_tree.atomic import remove
from ds_tree.data.chat import check_text
from ds_tree.data.convert import load_tokenizer
from ds_tree.data.jsonl import read_jsonl
from ds_tree.data.sampler import StepSampler
from ds_tree.errors import ConfigError, DataError, RolloutError
from ds_tree.models.vision import attach_rope_positions
from ds_tree.rollout.env import (
    EnvFailure,
    Environment,
    EnvironmentCalls,
    StepResult,
    Turn,
    check_messages,
    load_environment_class,
    step_result,
)
from ds_tree.rollout.formats import list_registered, resolve_format, turn_stop_tokens
from ds_tree.rollout.images import observation_images, rendering_stand_ins, with_pil_images
from ds_tree.rollout.online import OnlineRollouts, rank_slots, slot_generator
from ds_tree.rollout.prompts import stop_token_ids
from ds_tree.rollout.render import NotAppendOnly, Renderer, parse_error_message
from ds_tree.sampling.interface import EngineTurnSampler
from ds_tree.sampling.settings import EnvSettings, SamplerSettings, path_limit
from ds_tree.trees.images import TrajectoryImage, placeholder_index
from ds_tree.trees.trajectory import Trajectory

logger = logging.getLogger(__name__)

STOP_REASONS = ("done", "max_turns", "length", "timeout", "env_error", "rewritten")
"""Why a leaf ended: the environment said done; ``max_turns``; the context (or one turn) ran out of
tokens; ``episode_timeout_s``; an environment failure (dropped from the loss); its history was
rewritten and the episode went on in a new branch."""
TRAINED_STOPS = ("done", "max_turns", "length", "timeout")


# ------------------------------------------------------------------ the turn sampler (engine boundary)
@dataclass
class SampledTurn:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """``eos`` (a stop token, kept last) or ``length``."""


class HFTurnSampler:
    """``n`` assistant turns after one exact token prefix, on a Hugging Face model with the project's
    tree sampler (the prefix prefilled once, its keys/values shared by the ``n`` continuations).

    Keys/values are carried across turns: each sampled turn's (its prefix and tokens, all but the stop
    token, which was never fed) are kept until a later call's prefix extends them, the next turn of
    that leaf after its observation was bridged on; that call feeds only the stop token and the
    observation instead of prefilling the whole path again (``forward_tokens`` counts what is fed).
    The result is the full prefill's to round-off (float64: equal to 1e-12, the same tokens;
    tests/test_multiturn.py). :meth:`end_episode` drops what is kept; models with recurrent layers
    prefill every turn (``carry`` off).

    The boundary another engine (vLLM) implements: ``sample(prefix_ids, n, max_new_tokens, generator)``.
    """

    def __init__(self, model, settings: SamplerSettings, stop_ids: Sequence[int], carry: bool = True) -> None:
        from ds_tree.sampling.state_cache import has_recurrent_layers

        self.model = model
        self.settings = settings
        self.stop_ids = list(stop_ids)
        self.forward_tokens = 0
        self.carry = carry and not has_recurrent_layers(model.config)
        self.carried: list[tuple[list[int], list]] = []
        """(token ids fed, their keys/values) of the turns sampled since :meth:`end_episode`."""

    def take_carried(self, prefix_ids: list[int]):
        """The kept keys/values of the longest fed ids that ``prefix_ids`` extends (removed: a leaf's
        next turn is sampled once), or None."""
        best = None
        for index, (ids, _) in enumerate(self.carried):
            if len(ids) < len(prefix_ids) and prefix_ids[: len(ids)] == ids:
                if best is None or len(ids) > len(self.carried[best][0]):
                    best = index
        return None if best is None else self.carried.pop(best)[1]

    def end_episode(self) -> None:
        self.carried.clear()

    def sample(
        self,
        prefix_ids: Sequence[int],
        n: int,
        max_new_tokens: int,
        generator: torch.Generator,
        images: Sequence[TrajectoryImage] = (),
    ) -> list[SampledTurn]:
        """``images``: the prefix's images in order (a vision-language policy; ``sample_tree``'s)."""
        from ds_tree.sampling.hf import sample_tree

        settings = dataclasses.replace(
            self.settings,
            width=n,
            independent=True,
            max_new_tokens=max_new_tokens,
            segment_length=max_new_tokens,
            refill=False,
        )
        prefix_ids = [int(token) for token in prefix_ids]
        tree = sample_tree(
            self.model,
            prefix_ids,
            settings,
            generator=generator,
            eos_token_ids=self.stop_ids,
            prefix_key_values=self.take_carried(prefix_ids) if self.carry else None,
            keep_key_values=self.carry,
            images=images,
        )
        self.forward_tokens += tree.forward_tokens
        turns = []
        for leaf in tree.leaf_nodes():
            ids, logprobs = tree.completion(leaf)
            reason = "eos" if tree.nodes[leaf].finish_reason == "eos" else "length"
            turns.append(SampledTurn(ids, logprobs, reason))
            if self.carry and reason == "eos":  # a cut turn ends its leaf: nothing continues it
                self.carried.append((prefix_ids + ids[:-1], tree.leaf_key_values[leaf]))
        return turns


# ------------------------------------------------------------------ episode trees
class EpisodeStopped(RuntimeError):
    """The run closed while an episode was sampled (on the background sampler): the episode is dropped,
    its environments closed; a resumed run samples its step anew from the step's seeds."""


@dataclass
class TurnNode:
    """One turn of an episode tree: sampled tokens, then the observation's (context)."""

    parent: int
    """-1: a root (the prompt, or a conversation the environment rewrote)."""
    token_ids: list[int] = field(default_factory=list)
    trainable: list[int] = field(default_factory=list)
    """1 on the sampled assistant tokens, 0 on prompt and observation tokens."""
    logprobs: list[float] = field(default_factory=list)
    """The sampler's log-prob of each sampled token, NaN elsewhere."""
    version: int = -1
    """The policy version (training step) that sampled this node's tokens; -1 for a root."""
    turn: int = 0
    reward: float = 0.0
    """This turn's reward (``StepResult.reward``)."""
    stop_reason: str | None = None
    """On a leaf, one of :data:`STOP_REASONS`."""
    error: str = ""
    continues: int = -1
    """On a root made by a rewritten conversation: the node whose episode it continues."""
    score: float = 0.0
    """The environment's ``score`` added on this leaf."""
    images: list[TrajectoryImage] = field(default_factory=list)
    """The images whose placeholders are among ``token_ids`` (image observations), in order."""


@dataclass
class Leaf:
    """One kept root-to-leaf path, ready to train, and what is saved about it."""

    trajectory: Trajectory
    versions: list[int]
    turn_rewards: list[float]
    stop_reason: str
    turns: int


@dataclass
class EpisodeTree:
    """A task's episode tree and its counters (what a rank sends to the others)."""

    slot: int
    task: str
    nodes: list[TurnNode]
    sampled_tokens: int = 0
    forward_tokens: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    """``parse_errors``, ``step_timeouts``, ``env_errors``, ``rewritten``, ``observations_cut``."""
    leaves: list[Leaf] = field(default_factory=list)
    image_token_id: int | None = None
    """A vision-language policy's ``<|image_pad|>`` (never sampled: each run of it is one node image)."""

    def children(self) -> list[list[int]]:
        children: list[list[int]] = [[] for _ in self.nodes]
        for index, node in enumerate(self.nodes):
            parent = node.parent if node.parent >= 0 else node.continues
            if parent >= 0:
                children[parent].append(index)
        return children

    def path(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.nodes[node].parent
        return path[::-1]

    def build_leaves(self, group_id: str, source: str) -> None:
        """The kept leaves as trajectories (``env_error`` leaves and paths with no sampled token dropped)."""
        children = self.children()
        returns: dict[int, float] = {}

        def path_return(index: int) -> float:
            node = self.nodes[index]
            total = node.reward + node.score
            parent = node.parent if node.parent >= 0 else node.continues
            return total + (path_return(parent) if parent >= 0 else 0.0)

        def kept_below(index: int) -> list[int]:
            if not children[index]:
                return [index] if self.nodes[index].stop_reason in TRAINED_STOPS else []
            return [leaf for child in children[index] for leaf in kept_below(child)]

        for index, node in enumerate(self.nodes):
            if node.stop_reason in TRAINED_STOPS and not children[index]:
                returns[index] = path_return(index)
        for index, node in enumerate(self.nodes):  # a rewritten path: the mean return of its continuation
            if node.stop_reason == "rewritten":
                below = [returns[leaf] for leaf in kept_below(index)]
                if below:
                    returns[index] = float(np.mean(below))
        self.leaves = []
        for index in sorted(returns):
            path = self.path(index)
            nodes = [self.nodes[n] for n in path]
            mask = np.concatenate([np.asarray(n.trainable, dtype=np.float64) for n in nodes])
            if not mask[1:].any():
                continue
            trial = len(self.leaves)
            input_ids = np.concatenate([np.asarray(n.token_ids, dtype=np.int64) for n in nodes])
            images = [image for n in nodes for image in n.images]
            image_index = placeholder_index(input_ids, self.image_token_id, images) if images else None
            trajectory = Trajectory(
                input_ids=input_ids,
                loss_mask=mask,
                group_id=group_id,
                reward=returns[index],
                trial=trial,
                source=f"{source} leaf {trial}",
                logprobs=np.concatenate([np.asarray(n.logprobs, dtype=np.float64) for n in nodes]),
                policy_version=min(n.version for n in nodes if n.parent >= 0),  # its oldest turn's
                images=tuple(images),
                image_index=image_index,
            )
            self.leaves.append(
                Leaf(
                    trajectory,
                    versions=[n.version for n in nodes for _ in n.token_ids],
                    turn_rewards=[n.reward for n in nodes if n.parent >= 0],
                    stop_reason=self.nodes[index].stop_reason,
                    turns=sum(n.parent >= 0 for n in nodes),
                )
            )


@dataclass
class _Live:
    """A leaf still going: its environment, conversation (messages and ids) and quota of leaves."""

    node: int
    env: Environment
    messages: list[dict]
    ids: list[int]
    turn: int
    quota: int
    recorded: list[tuple[Turn, list[dict]]]
    """Turns stepped in ``env`` and the messages each gave back (what ``replay`` re-applies)."""
    images: list[TrajectoryImage] = field(default_factory=list)
    """The images of ``ids``, in order (image observations)."""


class EpisodeRunner:
    """Samples episode trees of one environment class with one turn sampler (module docstring)."""

    def __init__(
        self,
        make_env: Callable[[], Environment],
        renderer: Renderer,
        sampler: HFTurnSampler,
        settings: SamplerSettings,
        env: EnvSettings,
        max_context_tokens: int,
        calls: EnvironmentCalls,
        stopping: threading.Event | None = None,
    ) -> None:
        self.make_env = make_env
        self.renderer = renderer
        self.sampler = sampler
        self.settings = settings
        self.env = env
        self.max_context = max_context_tokens
        self.calls = calls
        self.fork_mode = env.fork or getattr(make_env, "fork_mode", "copy")
        self.stopping = stopping or threading.Event()
        """Once set, the episode being sampled stops at its next leaf (:class:`EpisodeStopped`)."""
        self.open: dict[int, Environment] = {}
        """The environments of the episode being sampled not closed yet (closed when it ends, on every path)."""

    # -- environment calls, every one guarded
    def call(self, method, *args, timeout: float | None = None):
        return self.calls.call(method, *args, timeout=timeout or self.env.step_timeout_s)

    def construct(self) -> Environment:
        """A new environment: the constructor is user code like any method, so it runs under the
        deadline and its failure (raising, sys.exit, no answer) is an environment error."""
        env = self.call(self.make_env)
        if not hasattr(env, "reset") or not hasattr(env, "step"):
            raise EnvFailure(
                f"{getattr(self.make_env, '__name__', 'the factory')} returned {type(env).__name__}, not an environment"
            )
        return self.opened(env)

    def opened(self, env: Environment) -> Environment:
        self.open[id(env)] = env
        return env

    def fork(self, live: _Live, task: dict, opening: list[dict]) -> Environment:
        if self.fork_mode == "copy":
            forked = self.call(live.env.fork)
            if not isinstance(forked, Environment) and not hasattr(forked, "step"):
                raise EnvFailure(f"fork must return an environment, got {type(forked).__name__}")
            return self.opened(forked)
        if self.fork_mode == "none":  # only at the prompt: a fresh episode
            return self.fresh(task, opening)
        made: list[Environment] = []  # a replay that fails or times out after the constructor is still closed
        try:
            timeout = self.env.step_timeout_s * (len(live.recorded) + 1)
            return self.opened(self.call(self.replay, live, task, opening, made, timeout=timeout))
        except Exception:
            for env in made:
                self.close(env)
            raise

    def fresh(self, task: dict, opening: list[dict]) -> Environment:
        env = self.construct()
        messages = check_messages("reset", self.call(env.reset, task))
        if messages != opening:
            raise EnvFailure(
                "reset gave different opening messages for the same task (fork needs a deterministic reset)"
            )
        return env

    def replay(self, live: _Live, task: dict, opening: list[dict], made: list) -> Environment:
        env = self.make_env()  # already in a worker thread, under the replay's deadline
        made.append(env)
        if check_messages("reset", _run(env.reset(task))) != opening:
            raise EnvFailure("replay: reset gave different opening messages for the same task")
        for index, (turn, messages) in enumerate(live.recorded):
            again = step_result(_run(env.step(turn)))
            if again.messages != messages:
                raise EnvFailure(f"replay: turn {index} gave different messages than when it was recorded")
        return env

    def close(self, env: Environment) -> None:
        self.open.pop(id(env), None)
        try:
            self.call(env.close)
        except Exception as error:  # closing is best effort; the leaf is already decided
            logger.warning("environment close failed: %s: %s", type(error).__name__, error)

    def close_open(self) -> None:
        """Close every environment of the episode still open (an episode stopped or failed midway)."""
        while self.open:
            self.close(next(iter(self.open.values())))

    # -- one task
    def run(self, task: dict, label: str, slot: int, version: int, generator: torch.Generator) -> EpisodeTree:
        tree = EpisodeTree(slot, label, [])
        if self.renderer.images is not None:
            tree.image_token_id = self.renderer.images.image_token_id
        counts = tree.counts = dict.fromkeys(
            ("parse_errors", "step_timeouts", "env_errors", "rewritten", "observations_cut"), 0
        )
        started = time.monotonic()
        forward_before = self.sampler.forward_tokens
        self.open.clear()
        try:
            env = self.construct()
            opening = check_messages("reset", self.call(env.reset, task))
            tools = self.tools(env)
            ids, images = self.renderer.prompt_with_images(opening, tools)
        except Exception as error:
            self.report(label, 0, error)
            counts["env_errors"] += 1
            tree.nodes.append(TurnNode(-1, stop_reason="env_error", error=f"{type(error).__name__}: {error}"))
            self.close_open()
            return tree
        tree.nodes.append(TurnNode(-1, list(ids), [0] * len(ids), [math.nan] * len(ids), images=list(images)))
        live = [_Live(0, env, list(opening), list(ids), 0, self.settings.width, [], list(images))]
        try:
            while live:
                going = []
                for leaf in live:
                    if self.stopping.is_set():
                        raise EpisodeStopped(f"task {label}: sampling stopped at turn {leaf.turn} (the run is closing)")
                    going += self.expand(tree, leaf, task, opening, tools, version, generator, started)
                live = going
        finally:  # every path: an engine error, a stop, a leaf left open by a bug
            getattr(self.sampler, "end_episode", lambda: None)()  # keys/values carried across its turns
            self.close_open()
        tree.forward_tokens = self.sampler.forward_tokens - forward_before
        tree.sampled_tokens = sum(sum(node.trainable) for node in tree.nodes)
        return tree

    def tools(self, env: Environment) -> list[dict] | None:
        schemas = env.tool_schemas() if hasattr(env, "tool_schemas") else []
        if not isinstance(schemas, list) or not all(isinstance(schema, dict) for schema in schemas):
            raise EnvFailure(f"tool_schemas must return a list of objects, got {type(schemas).__name__}")
        try:
            check_text("tool_schemas", schemas)
        except ValueError as error:
            raise EnvFailure(str(error)) from None
        return schemas or None

    def report(self, label: str, turn: int, error: BaseException) -> None:
        logger.warning("environment error in task %s, turn %d: %s: %s", label, turn, type(error).__name__, error)

    def end(self, tree: EpisodeTree, leaf: _Live, node: int, reason: str, error: str = "") -> None:
        """Stop a leaf: its node records why; the environment's ``score`` is added to kept leaves."""
        record = tree.nodes[node]
        record.stop_reason, record.error = reason, error
        if reason in TRAINED_STOPS and hasattr(leaf.env, "score"):
            try:
                value = self.call(leaf.env.score, leaf.messages)
                if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                    raise EnvFailure(f"score must return a finite number, got {value!r}")
                record.score = float(value)
            except Exception as failure:
                self.report(tree.task, leaf.turn, failure)
                tree.counts["env_errors"] += 1
                record.stop_reason, record.error = "env_error", str(failure)
        self.close(leaf.env)

    def children_count(self, leaf: _Live) -> int:
        if self.settings.independent or self.fork_mode == "none":
            return leaf.quota if leaf.turn == 0 else 1
        if self.env.turn_branching:
            return self.env.turn_branching[leaf.turn] if leaf.turn < len(self.env.turn_branching) else 1
        if leaf.turn >= self.settings.max_depth:
            return 1
        last = leaf.turn == self.settings.max_depth - 1
        return leaf.quota if last else min(leaf.quota, self.settings.branching)

    def expand(self, tree, leaf: _Live, task, opening, tools, version, generator, started) -> list[_Live]:
        """Sample ``leaf``'s next turns and step them; the children still going."""
        if leaf.turn >= self.env.max_turns:
            self.end(tree, leaf, leaf.node, "max_turns")
            return []
        if time.monotonic() - started > self.env.episode_timeout_s:
            self.end(tree, leaf, leaf.node, "timeout")
            return []
        room = self.max_context - len(leaf.ids)
        if room < 1:
            self.end(tree, leaf, leaf.node, "length")
            return []
        count = self.children_count(leaf)
        envs = [leaf.env]
        for _ in range(count - 1):
            try:
                envs.append(self.fork(leaf, task, opening))
            except Exception as error:  # this sibling is not sampled; its share of leaves goes to the others
                self.report(tree.task, leaf.turn, error)
                tree.counts["env_errors"] += 1
        shares = [leaf.quota // len(envs) + (i < leaf.quota % len(envs)) for i in range(len(envs))]
        seen = {"images": leaf.images} if leaf.images else {}  # an engine without images is refused at the config
        turns = self.sampler.sample(leaf.ids, len(envs), min(self.settings.max_new_tokens, room), generator, **seen)
        going = []
        for env, share, sampled in zip(envs, shares, turns, strict=True):
            index = len(tree.nodes)
            tree.nodes.append(
                TurnNode(
                    leaf.node,
                    list(sampled.token_ids),
                    [1] * len(sampled.token_ids),
                    list(sampled.logprobs),
                    version,
                    leaf.turn + 1,
                )
            )
            child = _Live(
                index,
                env,
                list(leaf.messages),
                leaf.ids + sampled.token_ids,
                leaf.turn + 1,
                share,
                list(leaf.recorded),
                list(leaf.images),
            )
            if self.step(tree, child, sampled, tools):
                going.append(child)
        return going

    def step(self, tree: EpisodeTree, child: _Live, sampled: SampledTurn, tools) -> bool:
        """Parse and step ``child``'s new turn, append its observation; whether it goes on."""
        node = tree.nodes[child.node]
        if sampled.finish_reason != "eos":  # the turn ran out of tokens: never bridge a cut turn
            self.end(tree, child, child.node, "length")
            return False
        parsed = self.renderer.parse(sampled.token_ids, call_prefix=f"call_{child.turn}")
        child.messages.append(self.renderer.message(parsed.turn))
        if parsed.error is not None:
            tree.counts["parse_errors"] += 1
            result = StepResult(messages=[parse_error_message(parsed.error)])
        else:
            try:
                result = step_result(self.call(child.env.step, parsed.turn))
                child.recorded.append((parsed.turn, result.messages))
            except TimeoutError:
                tree.counts["step_timeouts"] += 1
                message = f"error: the environment did not answer within {self.env.step_timeout_s} s"
                result = StepResult(messages=[{"role": "tool", "tool_call_id": "timeout", "content": message}])
            except Exception as error:
                self.report(tree.task, child.turn, error)
                tree.counts["env_errors"] += 1
                self.end(tree, child, child.node, "env_error", f"{type(error).__name__}: {error}")
                return False
        node.reward = float(result.reward)
        if result.done:
            self.end(tree, child, child.node, "done")
            return False
        try:
            return self.observe(tree, child, result, tools)
        except EnvFailure as error:  # what the environment wrote cannot be rendered as text
            self.report(tree.task, child.turn, error)
            tree.counts["env_errors"] += 1
            self.end(tree, child, child.node, "env_error", f"{type(error).__name__}: {error}")
            return False

    def observe(self, tree: EpisodeTree, child: _Live, result: StepResult, tools) -> bool:
        """Append ``result``'s messages to ``child`` (bridged, or a new branch); whether it goes on."""
        node = tree.nodes[child.node]
        messages = result.messages
        if result.history is not None:  # an extended history is bridged; a rewritten one starts a new branch
            known = len(child.messages)
            if result.history[:known] != child.messages:
                return self.rewrite(tree, child, result.history, tools)
            messages = result.history[known:]
        new = [self.renderer.cut(message) for message in messages]
        tree.counts["observations_cut"] += sum(a is not b for a, b in zip(new, messages, strict=True))
        try:
            observation, images = self.renderer.bridge_with_images(child.ids, child.messages, new, tools)
        except NotAppendOnly:
            return self.rewrite(tree, child, child.messages + new, tools)
        if len(child.ids) + len(observation) >= self.max_context:
            self.end(tree, child, child.node, "length")
            return False
        node.images += images
        child.images += images
        child.messages += new
        child.ids += observation
        node.token_ids += observation
        node.trainable += [0] * len(observation)
        node.logprobs += [math.nan] * len(observation)
        return True

    def rewrite(self, tree: EpisodeTree, child: _Live, history: list[dict], tools) -> bool:
        """Continue ``child`` from a rewritten conversation: a new root, the old path ends ``rewritten``."""
        tree.counts["rewritten"] += 1
        ids, images = self.renderer.prompt_with_images(history, tools)
        if len(ids) >= self.max_context:
            self.end(tree, child, child.node, "length")
            return False
        tree.nodes[child.node].stop_reason = "rewritten"
        index = len(tree.nodes)
        tree.nodes.append(
            TurnNode(
                -1,
                list(ids),
                [0] * len(ids),
                [math.nan] * len(ids),
                turn=child.turn,
                continues=child.node,
                images=list(images),
            )
        )
        child.node, child.messages, child.ids, child.images = index, list(history), list(ids), list(images)
        return True


def _run(value):
    """The value of a sync call, or of an ``async`` one (already in a worker thread: its own loop)."""
    import asyncio
    import inspect

    return asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value


async def _awaited(awaitable):
    return await awaitable


# ------------------------------------------------------------------ tasks, config, metrics, saving
@dataclass
class Task:
    task: dict
    label: str
    source: str


def read_tasks(path: str | Path) -> list[Task]:
    """The tasks JSONL (``rollout.prompts`` with ``rollout.env.path``): one JSON object a line."""
    tasks = []
    for index, (where, record) in enumerate(read_jsonl(path)):
        if not isinstance(record, dict):
            raise DataError(f"{where}: a task must be a JSON object")
        tasks.append(Task(record, str(record.get("group_id", record.get("id", f"task-{index}"))), where))
    if not tasks:
        raise DataError(f"{path}: no tasks")
    return tasks


def check_env_config(config) -> None:
    """What ``rollout.env.path`` needs from the rest of the config (raises :class:`ConfigError`)."""
    rollout = config.rollout
    try:
        load_environment_class(rollout.env.path)
    except ValueError as error:
        raise ConfigError(f"rollout.env.path {error}") from None
    if rollout.env.format != "auto" and rollout.env.format not in list_registered():
        raise ConfigError(
            f"rollout.env.format {rollout.env.format!r} is not a registered chat format; use auto or one of "
            f"{', '.join(list_registered())}"
        )
    if rollout.reward:
        raise ConfigError(
            "rollout.reward is not used with rollout.env.path (the environment gives the rewards); remove it"
        )
    for name in ("repetition_ngram", "logprob_floor"):
        if getattr(rollout, name):
            raise ConfigError(f"rollout.{name} is a single-turn sampler setting; set it to 0 with rollout.env.path")
    limit, what = path_limit(config)
    if rollout.env.max_context_tokens > limit:
        raise ConfigError(
            f"rollout.env.max_context_tokens ({rollout.env.max_context_tokens}) is more than {what}: "
            "every root-to-leaf path must fit one row"
        )
    if rollout.env.turn_branching and math.prod(rollout.env.turn_branching) != rollout.width:
        raise ConfigError(
            f"rollout.env.turn_branching {rollout.env.turn_branching} makes {math.prod(rollout.env.turn_branching)} "
            f"leaves a task, not rollout.width ({rollout.width}); make their product the width"
        )
    warmup = rollout.env.warmup_steps
    env_class = load_environment_class(rollout.env.path)
    for name in ("warmup_steps", "refresh_every"):  # both train on demonstrations
        value = getattr(rollout.env, name)
        if value and not callable(getattr(env_class, "demonstration", None)):
            raise ConfigError(
                f"rollout.env.{name} ({value}) needs demonstrations, and {rollout.env.path} has no "
                f"demonstration(task, rng) method (docs/ENVIRONMENTS.md); write one or set {name}: 0"
            )
    check_constructor(env_class, rollout.env)
    if warmup:
        if warmup >= config.max_steps:
            raise ConfigError(
                f"rollout.env.warmup_steps ({warmup}) leaves no RL step: it must be less than max_steps "
                f"({config.max_steps})"
            )


def check_constructor(env_class, env: EnvSettings, tries: int = 2) -> None:
    """Build the environment as a run would (under ``step_timeout_s``, then ``close`` it): a
    constructor that fails ``tries`` times in a row would fail every task of every step, a config
    error now rather than a run that keeps no leaf (a failure at run time is a per-task error)."""
    calls = EnvironmentCalls(max(env.workers, tries))
    errors = []
    for _ in range(tries):
        try:
            made = calls.call(env_class, timeout=env.step_timeout_s)
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")
            continue
        if hasattr(made, "close"):
            try:
                calls.call(made.close, timeout=env.step_timeout_s)
            except Exception as error:
                logger.warning("environment close failed: %s: %s", type(error).__name__, error)
        return
    raise ConfigError(
        f"rollout.env.path {env.path}: the environment cannot be constructed ({tries} tries, "
        f"each within rollout.env.step_timeout_s={env.step_timeout_s} s): {errors[-1]}"
    )


def lost_tasks(trees: list[EpisodeTree], max_context: int, episode_timeout_s: float) -> str:
    """Why the tasks that kept no leaf lost them: each cause with its count and the first error."""
    causes: dict[str, int] = {}
    for tree in trees:
        if tree.leaves:
            continue
        children = tree.children()
        ends = [node for index, node in enumerate(tree.nodes) if not children[index]]
        prompt = len(tree.nodes[0].token_ids) if tree.nodes else 0
        for node in ends[:1] or [None]:
            reason = node.stop_reason if node is not None else None
            if reason == "env_error":
                cause = f"environment errors (first: {node.error})"
            elif reason == "length" and not any(n.trainable and any(n.trainable) for n in tree.nodes):
                cause = (
                    f"the prompt ({prompt} tokens) leaves no room for a turn under the path limit "
                    f"({max_context} tokens: rollout.env.max_context_tokens, or packing.budget)"
                )
            elif reason == "timeout":
                cause = f"rollout.env.episode_timeout_s ({episode_timeout_s} s) ran out before a turn was sampled"
            else:
                cause = f"no sampled token on any kept path (stop reason {reason})"
            causes[cause] = causes.get(cause, 0) + 1
    return "; ".join(f"{count} task(s): {cause}" for cause, count in causes.items()) or "none lost"


def episode_scalars(trees: list[EpisodeTree]) -> dict[str, float]:
    """The ``rollout/`` metrics of one step's episode trees (all ranks)."""
    leaves = [leaf for tree in trees for leaf in tree.leaves]
    rewards = [leaf.trajectory.reward for leaf in leaves]
    flat = sum(len(leaf.trajectory) for leaf in leaves)
    tree_tokens = sum(len(node.token_ids) for tree in trees for node in tree.nodes)
    independent = sum(int(leaf.trajectory.loss_mask.sum()) for leaf in leaves)
    sampled = sum(tree.sampled_tokens for tree in trees)
    scalars = {
        "rollout/reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
        "rollout/leaves": float(np.mean([len(tree.leaves) for tree in trees])),
        "rollout/turns": float(np.mean([leaf.turns for leaf in leaves])) if leaves else 0.0,
        "rollout/por": 1.0 - tree_tokens / flat if flat else 0.0,
        "rollout/sampled_tokens": float(sampled),
        "rollout/forward_tokens": float(sum(tree.forward_tokens for tree in trees)),
        "rollout/tokens_saved": float(independent - sampled),
    }
    for name in ("parse_errors", "step_timeouts", "env_errors", "rewritten", "observations_cut"):
        scalars[f"rollout/{name}"] = float(sum(tree.counts.get(name, 0) for tree in trees))
    for reason in TRAINED_STOPS:
        scalars[f"rollout/stop_{reason}"] = float(sum(leaf.stop_reason == reason for leaf in leaves))
    return scalars


def leaf_record(leaf: Leaf, task: str) -> dict:
    """A kept leaf as a tokens JSONL record (:mod:`ds_tree.data.tokens`), with its episode's extras."""
    trajectory = leaf.trajectory
    return {
        "group_id": trajectory.group_id,
        "trial": trajectory.trial,
        "input_ids": trajectory.input_ids.tolist(),
        "loss_mask": trajectory.loss_mask.tolist(),
        "logprobs": [None if math.isnan(x) else x for x in trajectory.logprobs.tolist()],
        "reward": trajectory.reward,
        "versions": leaf.versions,
        "turn_rewards": leaf.turn_rewards,
        "stop_reason": leaf.stop_reason,
        "task": task,
        **(
            {"images": [{"key": image.key, "grid_thw": list(image.grid_thw)} for image in trajectory.images]}
            if trajectory.images
            else {}
        ),
    }


def save_rollouts(output_dir: str | Path, step: int, trees: list[EpisodeTree]) -> Path:
    """Write ``step``'s kept leaves to ``output_dir/rollouts/step_<N>.jsonl`` (replaced atomically)."""
    directory = Path(output_dir) / "rollouts"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:06d}.jsonl"
    partial = path.with_suffix(".jsonl.partial")
    remove(partial)  # a leftover, or a link planted under its name: created anew ("x"), never followed
    with partial.open("x") as handle:
        for tree in sorted(trees, key=lambda t: t.slot):
            for leaf in tree.leaves:
                handle.write(json.dumps(leaf_record(leaf, tree.task)) + "\n")
    partial.replace(path)
    return path


# ------------------------------------------------------------------ the online loop's multi-turn mode
class MultiTurnRollouts(OnlineRollouts):
    """:class:`~ds_tree.rollout.online.OnlineRollouts` with episode trees instead of completions."""

    def __init__(self, config, model_config) -> None:
        rollout = config.rollout
        try:
            self.tokenizer = load_tokenizer(config.model.tokenizer)
        except DataError as error:
            raise ConfigError(f"model.tokenizer: {error}") from None
        try:
            self.tasks = read_tasks(rollout.prompts)
        except DataError as error:
            raise ConfigError(f"rollout.prompts: {error}") from None
        self.config = config
        self.model_config = model_config
        self.settings = rollout.sampler_settings()
        try:
            turn_format = resolve_format(rollout.env.format, self.tokenizer)
        except ValueError as error:
            raise ConfigError(f"rollout.env.format ({rollout.env.format}) with model.tokenizer: {error}") from None
        self.stop_ids = stop_token_ids(self.tokenizer, model_config, turn_stop_tokens(turn_format, self.tokenizer))
        self.sampler = StepSampler(len(self.tasks), rollout.prompts_per_step, rollout.seed)
        self.env_class = load_environment_class(rollout.env.path)
        try:  # its own tokenizer: episodes may render on the background sampler while demonstrations do here
            renderer_tokenizer = load_tokenizer(config.model.tokenizer) if rollout.max_staleness else self.tokenizer
            self.renderer = Renderer(
                renderer_tokenizer,
                self.stop_ids,
                rollout.env.max_observation_tokens,
                turn_format,
                observation_images(config.model.tokenizer, model_config, rollout.env.max_image_pixels),
            )
        except ValueError as error:
            raise ConfigError(f"model.tokenizer (chat format {turn_format.name}): {error}") from None
        self.model = None
        self.engine = None  # OnlineRollouts.close stops a managed engine; episodes sample on self.model
        self.runner = None
        self.scalars: dict[str, float] = {}
        self.stopping = threading.Event()
        """Set by :meth:`close`: the episode being sampled stops at its next leaf, its environments closed."""

    def runner_for_model(self) -> EpisodeRunner:
        if self.runner is None:
            env = self.config.rollout.env
            self.runner = EpisodeRunner(
                self.env_class,
                self.renderer,
                HFTurnSampler(self.model, self.settings, self.stop_ids)
                if self.engine is None
                else EngineTurnSampler(self.engine, self.settings, self.stop_ids),  # rollout.engine: vllm
                self.settings,
                env,
                env.max_context_tokens or path_limit(self.config)[0],
                EnvironmentCalls(env.workers),
                stopping=self.stopping,
            )
        return self.runner

    def sample_episode(self, step: int, slot: int, task_index: int, version: int | None = None) -> EpisodeTree:
        """One task's episode tree, every turn sampled by policy ``version`` (default ``step``)."""
        task = self.tasks[task_index]
        device = next(self.model.parameters()).device if self.model is not None else "cpu"
        generator = slot_generator(self.config.rollout.seed, step, slot, device)
        version = step if version is None else version
        with torch.no_grad():
            tree = self.runner_for_model().run(task.task, task.label, slot, version, generator)
        # one numbering: the console's and the saved file's 1-based step (``step`` counts from 0)
        tree.build_leaves(f"{task.label}/step{step + 1}/slot{slot}", f"{task.source} (step {step + 1}, slot {slot})")
        return tree

    def sample_share(self, step: int, version: int) -> list[EpisodeTree]:
        """This rank's episode trees of ``step`` (no collective: the background sampler runs it too, and
        its environments are made, forked and closed on that thread)."""
        indices = self.sampler.groups_for_step(step)
        slots = rank_slots(len(indices), dist.get_rank(), dist.get_world_size())
        return [self.sample_episode(step, slot, indices[slot], version) for slot in slots]

    def samples(self, step: int) -> bool:
        return not self.warming_up(step)

    def join_timeout_s(self) -> float:
        """Closing stops the episode being sampled at its next leaf (:class:`EpisodeRunner`): one leaf's
        forks, turn and steps, each environment call within ``step_timeout_s``."""
        return 5.0 + self.config.rollout.env.step_timeout_s * (self.config.rollout.width + 2)

    def warming_up(self, step: int) -> bool:
        """Whether ``step`` (0-based) is an SFT step: one of ``rollout.env.warmup_steps``, or a refresh
        (``rollout.env.refresh_every``)."""
        env = self.config.rollout.env
        if step < env.warmup_steps:
            return True
        return bool(env.refresh_every) and (step - env.warmup_steps) % env.refresh_every == env.refresh_every - 1

    def demonstrations(self, step: int, update: int) -> list[Trajectory]:
        """The warm-up's demonstrations of one update of ``step``: one per task of the step's order,
        written by the environment's ``demonstration(task, rng)`` and rendered with the chat
        template (every assistant turn trained). Every rank builds the same list."""
        import random

        from ds_tree.data.chat import render_chat

        trajectories = []
        settings = self.config.rollout.env
        calls = EnvironmentCalls(settings.workers)  # user code gets a deadline: a hang is an error, not a stall
        for slot, index in enumerate(self.sampler.groups_for_step(step)):
            task = self.tasks[index]
            rng = random.Random(f"{self.config.rollout.seed}/{step}/{update}/{slot}")
            where = f"{settings.path} demonstration of {task.label} (step {step + 1}, update {update})"
            env = None
            try:
                env = calls.call(self.env_class, timeout=settings.step_timeout_s)
                messages = calls.call(env.demonstration, task.task, rng, timeout=settings.step_timeout_s)
                messages = with_pil_images("demonstration", messages)
                images = self.renderer.images_of(messages)
                seen = {"image_token_id": self.vision_token(), "image_tokens": [i.tokens for i in images]}
                messages = rendering_stand_ins(messages)  # image parts as the records' paths: rendered alike
                rendered = render_chat(self.tokenizer, messages, self.tools_of(env), where=where, **seen)
                if step >= self.config.rollout.env.warmup_steps:  # a refresh: every assistant turn but the last
                    last = render_chat(
                        self.tokenizer, messages, self.tools_of(env), where=where, train_on="last_assistant", **seen
                    )
                    rendered.loss_mask = rendered.loss_mask - last.loss_mask
            except Exception as error:  # a broken demonstration is the environment's bug: stop, naming it
                raise DataError(f"{where}: {type(error).__name__}: {error}") from error
            finally:
                try:
                    if env is not None:
                        _run(env.close())
                except Exception as error:  # best effort, as after an episode
                    logger.warning("environment close failed: %s: %s", type(error).__name__, error)
            index = placeholder_index(rendered.input_ids, self.vision_token(), images) if images else None
            trajectories.append(
                Trajectory(
                    input_ids=rendered.input_ids,
                    loss_mask=rendered.loss_mask,
                    group_id=f"{task.label}/step{step + 1}/update{update}/slot{slot}",
                    source=where,
                    images=tuple(images),
                    image_index=index,
                )
            )
        attach_rope_positions(self.model_config, trajectories)
        return trajectories

    def vision_token(self) -> int | None:
        return self.renderer.images.image_token_id if self.renderer.images is not None else None

    def tools_of(self, env: Environment) -> list[dict] | None:
        schemas = env.tool_schemas() if hasattr(env, "tool_schemas") else []
        return schemas or None

    def step_trajectories(self, step: int, policy: torch.nn.Module) -> list[Trajectory]:
        """``step``'s episode trees (every rank's, gathered; saved by rank 0), their kept leaves as
        trajectories (collective). With ``rollout.max_staleness > 0`` they were sampled ahead."""
        trees = sorted(self.gathered_shares(step, policy), key=lambda t: t.slot)
        self.scalars.update(episode_scalars(trees))
        if dist.get_rank() == 0 and self.config.rollout.env.save_rollouts:
            save_rollouts(self.config.output_dir, step + 1, trees)
        kept = self.fresh_enough(step, [leaf.trajectory for tree in trees for leaf in tree.leaves])
        attach_rope_positions(self.model_config, kept)  # image observations: the model's own rotary rule
        groups = len({t.group_id for t in kept})
        if groups < self.config.objective.mini_batches:
            env = self.config.rollout.env
            why = lost_tasks(trees, env.max_context_tokens or path_limit(self.config)[0], env.episode_timeout_s)
            raise RolloutError(
                f"step {step + 1}: only {groups} task(s) kept a leaf, fewer than objective.mini_batches="
                f"{self.config.objective.mini_batches}; the others lost every leaf to: {why}"
            )
        return kept

    def close(self) -> None:
        """Stop the episode the background sampler is in (its environments closed), then as online RL."""
        self.stopping.set()
        super().close()
