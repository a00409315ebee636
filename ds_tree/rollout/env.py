"""The environment interface of multi-turn rollouts (docs/ENVIRONMENTS.md), and adapters to it.

An environment talks to the policy in chat messages; it never sees a token or a chat template (the
trainer's :mod:`ds_tree.rollout.render` owns those). One episode:

- ``reset(task) -> messages``: the conversation's opening messages (system, user) for one task, a
  JSON object of the tasks file (``rollout.prompts``);
- ``step(turn) -> StepResult``: the policy's assistant turn (its text and parsed tool calls) in,
  the messages to append (tool results, a user reply), a turn reward, ``done`` and ``info`` out; an
  environment that rewrites the conversation (compaction) returns ``history`` instead, and the
  rollout starts a new branch there rather than realigning tokens;
- ``fork()``: an independent copy standing at the same point, so sibling turns can be tried from it.
  ``fork_mode`` says how: ``copy`` (``copy.deepcopy``, the default), ``replay`` (a fresh instance
  reset on the same task re-applies the recorded turns and must give back the recorded messages),
  ``none`` (cannot fork: a rollout branches at the prompt only);
- ``score(messages) -> float``: a final reward added when a leaf ends (0 by default);
- ``demonstration(task, rng) -> messages``: a conversation that does the task, the SFT data of a
  warm-up (none by default: :func:`writes_demonstrations`);
- ``tool_schemas()``: the tools' schemas (of ``tools`` by default), ``close()``: release what the
  episode holds (nothing by default).

Every method but ``reset`` and ``step`` has a default on :class:`Environment`, which every environment
derives from (the rollout calls the methods, never probes for them).

Every method may be ``async``: the rollout runs each call in a worker thread
(:class:`EnvironmentCalls`), an ``async`` one under its own event loop there, with timeouts.

:class:`ToolEnvironment` is the usual shape: tools are plain Python functions (or methods) whose
JSON schema comes from their signature and docstring (:func:`tool_schema`), the policy calls them,
their return values (as text) are the observations. :class:`SkyRLTextEnvironment` and
:class:`TRLEnvironment` wrap a SkyRL-style text env and a TRL-style ``environment_factory`` class.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ds_tree.data.chat import check_text
from ds_tree.rollout.images import ImageFailure, normalize_parts, tool_content
from ds_tree.sampling.settings import FORK_MODES  # noqa: F401  (re-exported)
from ds_tree.turn_formats.base import ToolCall, Turn  # an environment's types, imported from here too


class EnvFailure(Exception):
    """An environment misbehaved (raised, returned the wrong type, or replayed differently)."""


@dataclass
class StepResult:
    """What one ``step`` returns."""

    messages: list[dict] = field(default_factory=list)
    """Messages appended after the assistant turn (``tool`` results, a ``user`` reply)."""
    reward: float = 0.0
    """This turn's reward; a trajectory's reward is the sum over its turns (plus ``score``)."""
    done: bool = False
    info: dict = field(default_factory=dict)
    history: list[dict] | None = None
    """Set instead of ``messages`` when the environment rewrites the conversation: the whole new
    conversation. Its rendering is not an extension of the sampled tokens, so the rollout continues
    it as a new branch (a new root) rather than realigning tokens."""


class Environment:
    """Base class of an environment (module docstring). Subclasses define ``reset`` and ``step``; the
    other methods have defaults, which the rollout calls like any override."""

    fork_mode: str = "copy"
    tools: list[Callable] = []
    """Functions the policy may call; their schemas go into the system block (:func:`tool_schema`)."""

    def reset(self, task: dict) -> list[dict]:
        raise NotImplementedError

    def step(self, turn: Turn) -> StepResult:
        raise NotImplementedError

    def fork(self) -> Environment:
        """An independent copy at the same point (``fork_mode: copy``)."""
        return copy.deepcopy(self)

    def score(self, messages: list[dict]) -> float:
        """A final reward added to a kept leaf when it ends, given its conversation (0 by default)."""
        return 0.0

    def demonstration(self, task: dict, rng: random.Random) -> list[dict]:
        """A conversation that does ``task`` (messages, every assistant turn trained): the SFT data of
        ``rollout.env.warmup_steps`` and ``refresh_every`` (docs/ENVIRONMENTS.md). None by default: an
        environment that does not override it is refused at config time when they are set
        (:func:`writes_demonstrations`)."""
        raise NotImplementedError(f"{type(self).__name__} writes no demonstrations")

    def close(self) -> None:
        """Release what the episode holds (nothing by default)."""

    def tool_schemas(self) -> list[dict]:
        """The tools' OpenAI schemas (of :attr:`tools` by default; none without tools)."""
        return [tool_schema(function) for function in self.tools]


def writes_demonstrations(make_env: Callable) -> bool:
    """Whether ``rollout.env.path``'s class overrides :meth:`Environment.demonstration` (a factory that is
    not an :class:`Environment` subclass cannot say, so it is taken not to)."""
    return (
        isinstance(make_env, type)
        and issubclass(make_env, Environment)
        and make_env.demonstration is not Environment.demonstration
    )


def tool_schema(function: Callable) -> dict:
    """The OpenAI function schema of ``function`` from its signature and (Google-style) docstring."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(function)
    return schema if "function" in schema else {"type": "function", "function": schema}


def tool_result(value: object) -> str | list:
    """A tool's return value as observation content: strings as they are, images (a PIL image, a uint8
    array, a list holding some: a screenshot tool's) as content parts (:func:`~ds_tree.rollout.images.tool_content`),
    anything else as JSON."""
    if isinstance(value, str):
        return value
    parts = tool_content(value)
    if parts is not None:
        return parts
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


class ToolEnvironment(Environment):
    """An environment whose tools are plain functions: a turn with tool calls gets their results as
    ``tool`` messages (an unknown tool, bad arguments or a raising tool give an error message, for the
    policy to read); a turn without tool calls ends the episode, scored by :meth:`reward`."""

    def reset(self, task: dict) -> list[dict]:
        raise NotImplementedError

    def reward(self, turn: Turn) -> float:
        """The final reward of an episode whose last turn is ``turn`` (0 by default)."""
        return 0.0

    def call_tool(self, call: ToolCall) -> str | list:
        tools = {function.__name__: function for function in self.tools}
        if call.name not in tools:
            return f"error: unknown tool {call.name!r} (tools: {', '.join(sorted(tools))})"
        try:
            return tool_result(tools[call.name](**call.arguments))
        except TypeError as error:
            return f"error: bad arguments for {call.name}: {error}"
        except Exception as error:  # a tool's failure is the policy's observation, not the run's
            return f"error: {call.name} failed: {type(error).__name__}: {error}"

    def step(self, turn: Turn) -> StepResult:
        if not turn.tool_calls:
            return StepResult(reward=self.reward(turn), done=True)
        messages = [
            {"role": "tool", "tool_call_id": call.id, "content": self.call_tool(call)} for call in turn.tool_calls
        ]
        return StepResult(messages=messages)


class SkyRLTextEnvironment(Environment):
    """A SkyRL-style text env: ``init(prompt) -> (messages, metadata)``, ``step(action: str) ->
    {"observations", "reward", "done", "metadata"}``. The task's ``"prompt"`` (messages) is the
    prompt; ``make`` builds one env per episode from the task (default: ``cls()``)."""

    def __init__(self, make: Callable[[dict], Any]) -> None:
        self.make = make
        self.env = None

    def reset(self, task: dict) -> list[dict]:
        self.env = self.make(task)
        messages, _ = self.env.init(task["prompt"])
        return list(messages)

    def step(self, turn: Turn) -> StepResult:
        output = self.env.step(turn.raw)
        if not isinstance(output, dict):
            raise EnvFailure(f"the SkyRL env's step must return a dict, got {type(output).__name__}")
        reward = output.get("reward")
        return StepResult(  # checked as any step's result (step_result): no coercion here
            messages=output["observations"],
            reward=0.0 if reward is None else reward,
            done=output["done"],
            info=output.get("metadata") or {},
        )

    def close(self) -> None:
        if self.env is not None and hasattr(self.env, "close"):  # the wrapped SkyRL-style env's is optional
            self.env.close()


class TRLEnvironment(ToolEnvironment):
    """A TRL-style ``environment_factory`` class: ``reset(**row)`` may return text appended to the
    last user message, its public methods are the tools, and ``get_reward()`` (or ``reward(instance)``)
    scores the episode. The task's ``"prompt"`` is the opening messages, the rest of it the row."""

    def __init__(self, factory: Callable[[], Any], reward: Callable[[Any], float] | None = None) -> None:
        self.factory = factory
        self.score_with = reward
        self.instance = None
        self.tools = []

    def reset(self, task: dict) -> list[dict]:
        self.instance = self.factory()
        row = {key: value for key, value in task.items() if key != "prompt"}
        extra = self.instance.reset(**row)
        messages = copy.deepcopy(list(task["prompt"]))
        if extra:
            messages[-1]["content"] += str(extra)
        self.tools = [
            getattr(self.instance, name)
            for name, member in inspect.getmembers(type(self.instance), inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")
        ]
        return messages

    def reward(self, turn: Turn) -> float:
        if self.score_with is not None:
            return float(self.score_with(self.instance))
        return float(self.instance.get_reward())

    def fork(self) -> Environment:
        forked = copy.copy(self)
        forked.instance = copy.deepcopy(self.instance)
        forked.tools = [getattr(forked.instance, function.__name__) for function in self.tools]
        return forked


class EnvironmentCalls:
    """Runs environment methods in worker threads with a timeout; ``async`` ones on a loop there.

    A call that times out raises :class:`TimeoutError`; its thread is left to finish on its own (a
    Python thread cannot be killed), so an environment whose calls may time out must tolerate a late
    call still running on an episode the rollout abandoned. Threads are daemons, so a call that never
    returns does not keep the process from exiting; once ``workers`` calls are still running, a new
    call fails at once (an environment error) instead of piling up threads.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.running = threading.BoundedSemaphore(workers)

    def call(self, method: Callable, *args: Any, timeout: float | None = None) -> Any:
        if not self.running.acquire(blocking=False):
            raise EnvFailure(f"{self.workers} environment calls that timed out are still running (rollout.env.workers)")
        box: dict[str, Any] = {}
        finished = threading.Event()

        def run() -> None:
            try:
                box["value"] = awaited(method(*args))
            except BaseException as error:  # handed to the caller
                box["error"] = error
            finally:
                self.running.release()
                finished.set()

        threading.Thread(target=run, name="env-call", daemon=True).start()
        if not finished.wait(timeout):
            raise TimeoutError(f"no answer within {timeout} s")
        if "error" in box:
            error = box["error"]
            if not isinstance(error, Exception):  # sys.exit() or the like in user code: its failure only
                raise EnvFailure(
                    f"{getattr(method, '__name__', 'the call')} raised {type(error).__name__}{error.args!r}"
                )
            raise error
        return box["value"]


def awaited(value: Any) -> Any:
    """The value of a sync call, or of an ``async`` one run to completion on an event loop of its own
    (in a worker thread: :class:`EnvironmentCalls`, a replay)."""
    return asyncio.run(_await(value)) if inspect.isawaitable(value) else value


async def _await(awaitable: Any) -> Any:
    return await awaitable


def step_result(value: object) -> StepResult:
    """``step``'s return value checked as strictly as data: a :class:`StepResult` (or a dict of its
    fields) with valid messages (or a ``history``, not both), a finite number for ``reward``, a bool
    for ``done`` (the string ``"false"`` is not false) and a dict for ``info``."""
    if isinstance(value, dict):
        try:
            value = StepResult(**value)
        except TypeError as error:
            raise EnvFailure(f"step returned a dict that is not a StepResult: {error}") from None
    if not isinstance(value, StepResult):
        raise EnvFailure(f"step must return a StepResult, got {type(value).__name__}")
    if value.history is not None:
        if value.messages:
            raise EnvFailure("step returned both messages and history: history replaces the conversation, give one")
        value.history = check_messages("step's history", value.history)
    else:
        value.messages = check_messages("step", value.messages)
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float | np.integer | np.floating):
        raise EnvFailure(f"step's reward must be a number, got {reward!r}")
    if not math.isfinite(reward):
        raise EnvFailure(f"step's reward must be a finite number, got {reward!r}")
    if not isinstance(value.done, bool | np.bool_):
        raise EnvFailure(f"step's done must be a bool, got {value.done!r}")
    if not isinstance(value.info, dict):
        raise EnvFailure(f"step's info must be a dict, got {type(value.info).__name__}")
    value.reward, value.done = float(reward), bool(value.done)
    return value


MESSAGE_ROLES = ("system", "user", "assistant", "tool")
"""The roles an environment's messages may have (those a chat record may have: ds_tree.data.chat.ROLES)."""


def check_messages(method: str, messages: object) -> list[dict]:
    """Messages an environment returned, checked as strictly as a chat record's: a list of objects
    with a known ``role`` and a string ``content`` of valid Unicode text; ``tool_calls`` only on
    assistant messages, each with a string id and ``function.name``/``function.arguments`` strings.
    A non-assistant message's ``content`` may be a list of text and image parts
    (:mod:`ds_tree.rollout.images`); the messages are returned with image arrays as PIL images."""
    if not isinstance(messages, list):
        raise EnvFailure(f"{method} must return a list of messages, got {type(messages).__name__}")
    messages = list(messages)
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            raise EnvFailure(f"{method}: message {index} is not an object with a string 'role'")
        role = message["role"]
        if role not in MESSAGE_ROLES:
            raise EnvFailure(
                f"{method}: message {index} has unknown role {role!r} (expected one of {', '.join(MESSAGE_ROLES)})"
            )
        if isinstance(message.get("content"), list) and role != "assistant":
            try:
                parts = normalize_parts(f"{method}: message {index}", message["content"])
                message = messages[index] = {**message, "content": parts}
            except ImageFailure as error:
                raise EnvFailure(str(error)) from None
        elif not isinstance(message.get("content"), str):
            raise EnvFailure(
                f"{method}: message {index} ({role}) needs a string 'content' (or, not on an assistant message, a "
                "list of text and image parts)"
            )
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise EnvFailure(
                    f"{method}: message {index}: 'tool_calls' must be a list, on an assistant message only"
                )
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if not (
                    isinstance(call, dict)
                    and isinstance(call.get("id", ""), str)
                    and isinstance(function, dict)
                    and isinstance(function.get("name"), str)
                    and isinstance(function.get("arguments"), str)
                ):
                    raise EnvFailure(
                        f"{method}: message {index}: a tool call needs a 'function' with name and arguments strings"
                    )
        if "tool_call_id" in message and not isinstance(message["tool_call_id"], str):
            raise EnvFailure(f"{method}: message {index}: 'tool_call_id' must be a string")
        try:
            check_text(f"{method}: message {index}", message)
        except ValueError as error:
            raise EnvFailure(str(error)) from None
    return messages
