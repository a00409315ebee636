"""The episode runner: one task's episode tree, sampled turn by turn against its environment.

- the environment's ``reset`` messages are rendered into the root (context, untrained);
- at turn boundary ``k`` (``k = 0`` is the prompt) with ``k < rollout.max_depth``, a live leaf owning
  ``q > 1`` of the task's ``rollout.width`` leaves forks into ``min(q, rollout.branching)`` children
  (``q`` at the last boundary; ``rollout.env.turn_branching`` sets the counts instead), the sampler's
  quota rule with turns for segments. Its environment is forked once per extra child
  (``rollout.env.fork``, else the environment's ``fork_mode``: copy / replay; ``none`` forks at the
  prompt only, where each child gets a fresh environment), so siblings continue the same episode state;
- the children's assistant turns are sampled from the same exact token prefix in one call of the
  engine's turn sampler (:class:`~ds_tree.sampling.interface.TurnSampler`; on ``hf`` the prefix is
  encoded once, its keys/values shared by the siblings), each stopping at the turn's end token;
- each child's turn is parsed (tool calls) and stepped in its environment; the observation is
  bridged onto the sampled ids (:meth:`~ds_tree.rollout.render.Renderer.bridge`, never re-rendering
  the sampled turn). A kept leaf's environment adds its ``score`` when the leaf ends.

Failures stay inside the leaf they hit (:data:`~ds_tree.rollout.episodes.tree.STOP_REASONS`): a
malformed tool call is answered with a parse-error observation; a ``step`` over ``step_timeout_s`` with
a tool error; an environment method that raises or returns the wrong type ends the leaf with
``env_error`` (logged with task and turn, counted, the leaf dropped from the loss);
``episode_timeout_s`` stops leaves with ``timeout``; a turn that would pass ``max_context_tokens``
stops with ``length``, keeping every sampled token. Every environment an episode made is closed when
it ends, on every path.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ds_tree.data.chat import check_text
from ds_tree.rollout.env import (
    EnvFailure,
    Environment,
    EnvironmentCalls,
    StepResult,
    Turn,
    awaited,
    check_messages,
    step_result,
)
from ds_tree.rollout.episodes.tree import TRAINED_STOPS, EpisodeStopped, EpisodeTree, TurnNode
from ds_tree.rollout.render import NotAppendOnly, Renderer, parse_error_message
from ds_tree.sampling.interface import SampledTurn, TurnSampler
from ds_tree.sampling.settings import EnvSettings, SamplerSettings
from ds_tree.trees.images import TrajectoryImage

logger = logging.getLogger(__name__)


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
        sampler: TurnSampler,
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
        self.fork_mode = env.fork or "copy"
        """How this episode's environments fork: ``rollout.env.fork``, else its root environment's ``fork_mode``."""
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
        if not isinstance(env, Environment):
            raise EnvFailure(
                f"{getattr(self.make_env, '__name__', 'the factory')} returned {type(env).__name__}, not an "
                "Environment (derive from ds_tree.rollout.env.Environment)"
            )
        return self.opened(env)

    def opened(self, env: Environment) -> Environment:
        self.open[id(env)] = env
        return env

    def fork(self, live: _Live, task: dict, opening: list[dict]) -> Environment:
        if self.fork_mode == "copy":
            forked = self.call(live.env.fork)
            if not isinstance(forked, Environment):
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
        if check_messages("reset", awaited(env.reset(task))) != opening:
            raise EnvFailure("replay: reset gave different opening messages for the same task")
        for index, (turn, messages) in enumerate(live.recorded):
            again = step_result(awaited(env.step(turn)))
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
            self.fork_mode = self.env.fork or env.fork_mode
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
            self.sampler.end_episode()  # keys/values carried across its turns
            self.close_open()
        tree.forward_tokens = self.sampler.forward_tokens - forward_before
        tree.sampled_tokens = sum(sum(node.trainable) for node in tree.nodes)
        return tree

    def tools(self, env: Environment) -> list[dict] | None:
        schemas = env.tool_schemas()
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
        if reason in TRAINED_STOPS:
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
