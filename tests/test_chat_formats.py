"""Chat formats as registrations (docs/ENVIRONMENTS.md, *Chat formats*): every family's template
written here, rendered and parsed in a multi-turn episode with two tool calls and a malformed third,
the episode tree trained tree == flat in float64; ``auto`` detection; reasoning turns as trees."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from ds_tree.envs.secret_tool import LoudSecretToolEnv
from ds_tree.registries import TURN_FORMATS
from ds_tree.rollout.env import EnvironmentCalls, ToolEnvironment
from ds_tree.rollout.episodes.runner import EpisodeRunner
from ds_tree.rollout.render import NotAppendOnly, Renderer
from ds_tree.sampling.interface import SampledTurn, TurnSampler
from ds_tree.sampling.settings import EnvSettings, SamplerSettings
from ds_tree.turn_formats import detect_format, get_format, resolve_format, turn_stop_tokens
from ds_tree.turn_formats.base import TurnFormat
from ds_tree.vocab.chat_templates import TEMPLATES
from ds_tree.vocab.tokenizer import build_tokenizer

MODEL = "configs/models/tiny_llama.json"
_TOKENIZERS: dict[str, object] = {}


def tokenizer_of(name: str):
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = build_tokenizer(chat_format=name)
    return _TOKENIZERS[name]


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


class Adder(ToolEnvironment):
    """Two calls of ``add``, then the answer ``done`` ends the episode with reward 1."""

    def __init__(self):
        self.tools = [add]

    def reset(self, task):
        return [{"role": "system", "content": "Add numbers."}, {"role": "user", "content": "add 1 and 2, then 3"}]

    def reward(self, turn):
        return float(turn.text == "done")


THINK = "<think>\nI add them.\n</think>\n\n"
HARMONY_THINK = "<|channel|>analysis<|message|>I add them.<|end|><|start|>assistant"


def hermes_call(a, b):
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def coder_call(a, b):
    parameters = f"<parameter=a>\n{a}\n</parameter>\n<parameter=b>\n{b}\n</parameter>\n"
    return f"<tool_call>\n<function=add>\n{parameters}</function>\n</tool_call>"


SCRIPTS = {
    # name: (call(a, b) text, malformed call text, final answer text; each turn's stop token)
    "hermes": (hermes_call, '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "done"),
    "qwen3": (
        lambda a, b: THINK + hermes_call(a, b),
        THINK + '<tool_call>\n{"name": "add"',
        THINK + "done",
    ),
    "qwq": (  # the generation prompt opened <think>: the turn starts inside it
        lambda a, b: THINK.removeprefix("<think>\n") + hermes_call(a, b),
        "I add.\n</think>\n\n<tool_call>\n[1, 2]\n</tool_call>",
        "Done.\n</think>\n\ndone",
    ),
    "qwen3_coder": (
        coder_call,
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>",  # a parameter not closed
        "done",
    ),
    "llama3_json": (
        lambda a, b: f'{{"name": "add", "parameters": {{"a": {a}, "b": {b}}}}}',
        '<|python_tag|>{"name": "add", "parameters": {"a": 1',
        "done",
    ),
    "mistral": (
        lambda a, b: f'[TOOL_CALLS] [{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}]',
        '[TOOL_CALLS] [{"name": "add", "arguments": 5}]',
        "done",
    ),
    "harmony": (
        lambda a, b: (
            f'{HARMONY_THINK}<|channel|>commentary to=functions.add <|constrain|>json<|message|>{{"a": {a}, "b": {b}}}'
        ),
        "<|channel|>commentary to=add <|constrain|>json<|message|>{}",  # the recipient is not functions.NAME
        f"{HARMONY_THINK}<|channel|>final<|message|>done",
    ),
}
STOPS = {"harmony": ("<|call|>", "<|call|>", "<|call|>", "<|return|>")}
"""Each turn's stop token where it is not the format's first."""
RESULTS = {"llama3_json": "ipython<|end_header_id|>", "mistral": "[TOOL_RESULTS]", "harmony": " to=assistant"}
"""How each family's template marks a tool result (default ``<tool_response>``): a path's depth."""


class ScriptedFormatSampler(TurnSampler):
    """Turn k of a path writes ``turns[k]`` (a function of the sibling index), k being the number of
    tool results in the prefix (so a rewritten history counts alike). Log-prob -1 a token."""

    def __init__(self, tokenizer, turns, stops, result_marker):
        self.tokenizer, self.turns, self.stops, self.marker = tokenizer, turns, stops, result_marker
        self.forward_tokens = 0

    def sample(self, prefix_ids, n, max_new_tokens, generator):
        depth = self.tokenizer.decode(list(prefix_ids), skip_special_tokens=False).count(self.marker)
        out = []
        for sibling in range(n):
            text = self.turns[min(depth, len(self.turns) - 1)](sibling)
            stop = self.tokenizer.convert_tokens_to_ids(self.stops[min(depth, len(self.stops) - 1)])
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [stop]
            out.append(SampledTurn(ids, [-1.0] * len(ids), "eos"))
        return out


def renderer_of(name: str) -> Renderer:
    """The renderer a run builds for template ``name``'s tokenizer (``rollout.env.format: auto``)."""
    tokenizer = tokenizer_of(name)
    turn_format = resolve_format("auto", tokenizer)
    stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in turn_stop_tokens(turn_format, tokenizer)]
    return Renderer(tokenizer, stop_ids + [tokenizer.eos_token_id], 0, turn_format)


def episode(name: str):
    """One episode tree of :class:`Adder` in template ``name``'s format: call add(1, 2), fork into 2,
    call add(3, sibling), a malformed call, the answer."""
    tokenizer = tokenizer_of(name)
    turn_format = resolve_format("auto", tokenizer)
    call, malformed, final = SCRIPTS[name]
    turns = [lambda s: call(1, 2), lambda s: call(3, s), lambda s: malformed, lambda s: final]
    stops = STOPS.get(name, (turn_format.stop_tokens[0],))
    renderer = renderer_of(name)
    settings = SamplerSettings(width=2, max_new_tokens=200, temperature=1.0)
    env = EnvSettings(turn_branching=[1, 2], max_turns=6, format="auto")
    runner = EpisodeRunner(
        Adder,
        renderer,
        ScriptedFormatSampler(tokenizer, turns, stops, RESULTS.get(name, "<tool_response>")),
        settings,
        env,
        2048,
        EnvironmentCalls(1),
    )
    tree = runner.run({"id": "t"}, "t", 0, 1, torch.Generator().manual_seed(0))
    tree.build_leaves("t/step1/slot0", "test")
    return tree, renderer


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_family_two_calls_a_malformed_one_and_tree_equals_flat_in_float64(name: str) -> None:
    from ds_tree.verify.tree_vs_flat import compare

    tree, renderer = episode(name)
    assert renderer.format.name == TEMPLATES[name].turn_format  # auto recognised the family's template
    assert tree.counts["env_errors"] == 0 and tree.counts["parse_errors"] == 2  # one malformed turn a leaf
    done = [leaf for leaf in tree.leaves if leaf.stop_reason == "done"]
    assert len(done) == 2 and all(leaf.trajectory.reward == 1.0 for leaf in done)
    tokenizer = renderer.tokenizer
    for sibling, leaf in enumerate(done):
        text = tokenizer.decode(leaf.trajectory.input_ids.tolist(), skip_special_tokens=False)
        # the two results read back in the family's tool-result layout, then the parse error
        assert "could not parse your tool call" in text, text
        assert str(1 + 2) in text and str(3 + sibling) in text
    # qwq shows no turn's reasoning in history: every turn but the last continues in a new branch (one
    # before the fork, two a leaf after it); harmony renders the malformed call (no call to show) as a
    # final answer, ended <|end|> where <|call|> was sampled. Each rewritten path is trained as it was.
    rewritten = {"qwq": 1 + 2 * 2, "harmony": 2}.get(name, 0)
    assert tree.counts["rewritten"] == rewritten and len(tree.leaves) == 2 + rewritten
    report = compare([leaf.trajectory for leaf in tree.leaves], MODEL, dtype="float64")
    assert report["passed"] and report["tree_tokens"] < report["flat_tokens"], report
    assert report["loss_rel_err"] <= 1e-10 and report["max_rel_grad_err"] <= 1e-10


@pytest.mark.parametrize("name", sorted(set(TEMPLATES) - {"qwq"}))
def test_a_parsed_call_renders_back_as_the_family_writes_it(name: str) -> None:
    """Template and parser agree: the documented call text, parsed and rendered as history, is the
    same text (the template's turn, its stop token and what follows it)."""
    renderer = renderer_of(name)
    opening = Adder().reset({})
    tools = Adder().tool_schemas()
    text = SCRIPTS[name][0](4, 5)
    stop = STOPS.get(name, (renderer.format.stop_tokens[0],))[0]
    parsed = renderer.format.parse(text, "call_1")
    assert parsed.error is None and [(c.name, c.arguments) for c in parsed.turn.tool_calls] == [
        ("add", {"a": 4, "b": 5})
    ]
    history = renderer.render([*opening, renderer.message(parsed.turn)], tools, generation_prompt=False)
    prompt = renderer.render(opening, tools, generation_prompt=True)
    assert history == prompt + text + stop + renderer.after_stop


def test_malformed_turns_of_every_family_are_parse_errors_never_exceptions() -> None:
    broken = {
        "hermes": ["<tool_call>{}</tool_call>", "<tool_call>", '<tool_call>{"name": 1}</tool_call>'],
        "qwen3": ["<think>never closed", "<think>a</think><think>b</think>"],
        "qwen3_coder": ["<tool_call>\n<function=>\n</function>\n</tool_call>", "<tool_call>{}</tool_call>"],
        "llama3_json": ["{not json", '{"name": "f", "parameters": [1]}', "<|python_tag|>", "x<|python_tag|>{}"],
        "mistral": ["[TOOL_CALLS] {}", "[TOOL_CALLS] []", "[TOOL_CALLS] [1][TOOL_CALLS]", "[TOOL_CALLS] [" * 50],
        "harmony": ["<|channel|>final", "<|message|>x", "<|channel|>poetry<|message|>x", "a<|start|>user<|message|>"],
    }
    for name, texts in broken.items():
        for text in texts:
            parsed = get_format(name).parse(text)
            assert parsed.error and parsed.turn.tool_calls == [], (name, text)
    deep = '{"name": "f", "parameters": {"a": ' + "[" * 40 + "]" * 40 + "}}"
    assert "nested deeper" in get_format("llama3_json").parse(deep).error
    plain = get_format("llama3_json").parse("The answer is 3.")
    assert plain.error is None and plain.turn.text == "The answer is 3."


def test_auto_detection_and_the_registry() -> None:
    names = sorted(TURN_FORMATS.names())
    assert names == sorted(["harmony", "hermes", "llama3_json", "mistral", "qwen3", "qwen3_coder"])
    assert {template.turn_format for template in TEMPLATES.values()} == set(names)  # each has a template
    for name, template in TEMPLATES.items():
        assert detect_format(template.template) == template.turn_format, name
    with pytest.raises(ValueError, match=r"none matches; name one of harmony, hermes"):
        detect_format("{{ messages }}")
    with pytest.raises(ValueError, match=r"several match \(hermes, qwen3, qwen3_coder\)"):
        detect_format(TEMPLATES["qwen3"].template + "<function=")
    with pytest.raises(ValueError, match=r"unknown chat format 'chatml' \(rollout.env.format\); choose one of hermes"):
        get_format("chatml")
    with pytest.raises(ValueError, match="chat format 'hermes' is already registered"):
        TURN_FORMATS.register("hermes", type("Other", (TurnFormat,), {}))

    TURN_FORMATS.register("test_not_a_format", object)
    try:
        with pytest.raises(TypeError, match="chat format 'test_not_a_format': .* is not a TurnFormat subclass"):
            get_format("test_not_a_format")
    finally:
        TURN_FORMATS.unregister("test_not_a_format")

    @TURN_FORMATS.register("test_only_format")
    class Custom(TurnFormat):
        markers = ("<|custom|>",)

    try:
        assert get_format("test_only_format").name == "test_only_format"
        assert detect_format("<|custom|>") == "test_only_format"
    finally:
        TURN_FORMATS.unregister("test_only_format")


def test_the_format_field_is_checked_and_auto_names_it_when_it_cannot_tell(tmp_path) -> None:
    from ds_tree.config import ConfigError, load_config
    from ds_tree.envs.secret_tool import tasks
    from ds_tree.rollout.multiturn import MultiTurnRollouts

    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(task) + "\n" for task in tasks(4, 0)))
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    base = [f"model.source={MODEL}", f"rollout.prompts={tmp_path / 'tasks.jsonl'}"]
    with pytest.raises(ConfigError, match=r"rollout.env.format must be one of auto, hermes, .*; got 'chatml'"):
        load_config("configs/multiturn_cpu.yaml", [*base, "rollout.env.format=chatml"])
    config = load_config("configs/multiturn_cpu.yaml", [*base, f"model.tokenizer={tmp_path / 'tokenizer'}"])
    with pytest.raises(ConfigError, match=r"rollout.env.format \(auto\) with model.tokenizer: cannot tell"):
        MultiTurnRollouts(config, SimpleNamespace(eos_token_id=2))
    tokenizer_of("llama3_json").save_pretrained(tmp_path / "llama")  # auto: the family's format and stop tokens
    config = load_config("configs/multiturn_cpu.yaml", [*base, f"model.tokenizer={tmp_path / 'llama'}"])
    rollouts = MultiTurnRollouts(config, SimpleNamespace(eos_token_id=2))
    eot = tokenizer_of("llama3_json").convert_tokens_to_ids("<|eot_id|>")
    assert rollouts.renderer.format.name == "llama3_json" and eot in rollouts.stop_ids
    config = load_config(
        "configs/multiturn_cpu.yaml", [*base, f"model.tokenizer={tmp_path / 'llama'}", "rollout.env.format=hermes"]
    )
    with pytest.raises(ConfigError, match=r"rollout.env.format \(hermes\) with model.tokenizer: the tokenizer's chat"):
        MultiTurnRollouts(config, SimpleNamespace(eos_token_id=2))  # a format that does not fit the template


@pytest.mark.parametrize(
    "name, markers", [("mistral", "[INST], [TOOL_CALLS]"), ("harmony", "<|start|>, <|channel|>, <|message|>")]
)
def test_a_format_the_template_does_not_write_is_refused_at_the_dry_run(tmp_path, name, markers) -> None:
    """Issue 55 #5: harmony or mistral named for a ChatML template passed the dry run, and every tool call of
    every episode was then a parse error (hermes on a llama3 template was refused: one direction only)."""
    from ds_tree.config import ConfigError, load_config
    from ds_tree.envs.secret_tool import tasks
    from ds_tree.rollout.multiturn import MultiTurnRollouts

    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(task) + "\n" for task in tasks(4, 0)))
    tokenizer_of("hermes").save_pretrained(tmp_path / "chatml")
    overrides = [f"model.source={MODEL}", f"rollout.prompts={tmp_path / 'tasks.jsonl'}"]
    overrides += [f"model.tokenizer={tmp_path / 'chatml'}", f"rollout.env.format={name}"]
    config = load_config("configs/multiturn_cpu.yaml", overrides)
    message = (
        rf"rollout.env.format \({name}\) with model.tokenizer: the tokenizer's chat template does not write the {name} "
        rf"format \(it has no {re.escape(markers)}\), so every tool call would be a parse error; "
        r"set rollout.env.format: auto \(it finds hermes in this template\)"
    )
    with pytest.raises(ConfigError, match=message):
        MultiTurnRollouts(config, SimpleNamespace(eos_token_id=2))


@pytest.mark.parametrize(
    "malformed", ["[TOOL_CALLS] {}", "[TOOL_CALLS] []", '[TOOL_CALLS] [{"name": "add"}][TOOL_CALLS]']
)
def test_a_malformed_mistral_call_is_a_parse_error_the_policy_reads(monkeypatch, malformed) -> None:
    """Issue 55 #6: the parse error quoted ``[TOOL_CALLS]``, which Mistral's template (``tojson`` on tool
    results) cannot keep as text: the leaf ended as an environment error instead of showing the error."""
    monkeypatch.setitem(SCRIPTS, "mistral", (SCRIPTS["mistral"][0], malformed, SCRIPTS["mistral"][2]))
    tree, renderer = episode("mistral")
    assert tree.counts["env_errors"] == 0 and tree.counts["parse_errors"] == 2, tree.counts
    done = [leaf for leaf in tree.leaves if leaf.stop_reason == "done"]
    assert len(done) == 2
    text = renderer.tokenizer.decode(done[0].trajectory.input_ids.tolist(), skip_special_tokens=False)
    assert "could not parse your tool call: " in text and "TOOL_CALLS" in text


def test_make_tokenizer_writes_each_family_template(tmp_path, capsys) -> None:
    from transformers import AutoTokenizer

    from ds_tree.cli import make_tokenizer

    assert make_tokenizer.main(["--output", str(tmp_path / "llama"), "--chat-format", "llama3_json"]) == 0
    assert "llama3_json chat format" in capsys.readouterr().out
    loaded = AutoTokenizer.from_pretrained(tmp_path / "llama", local_files_only=True)
    assert len(loaded) == 1024 and loaded.chat_template == TEMPLATES["llama3_json"].template
    assert loaded.encode("<|eot_id|>", add_special_tokens=False) == [loaded.convert_tokens_to_ids("<|eot_id|>")]
    with pytest.raises(SystemExit):
        make_tokenizer.main(["--output", str(tmp_path / "x"), "--chat-format", "chatml"])


# ------------------------------------------------------------------ reasoning turns as trees
def test_reasoning_stripped_from_history_makes_each_turn_its_exact_context_and_tree_equals_flat() -> None:
    """QwQ-style template (no earlier turn's reasoning in history): the call turn is trained after the
    prompt it was sampled from, each answer after the template's rendering of the history (the call
    without its reasoning, the observation); the episode tree trains them exactly (float64)."""
    from ds_tree.bench.reasoning_trees import independent_tokens, reasoning_episode
    from ds_tree.envs.secret_tool import tasks
    from ds_tree.trees.stats import token_counts
    from ds_tree.verify.tree_vs_flat import compare

    task = tasks(1, 0)[0]
    tree, renderer, finished = reasoning_episode(
        "qwq", task, reasoning_tokens=16, width=3, tokenizer=tokenizer_of("qwq")
    )
    assert tree.counts["rewritten"] == 1 and tree.counts["parse_errors"] == 0
    call = next(leaf for leaf in tree.leaves if leaf.stop_reason == "rewritten").trajectory
    answers = [leaf.trajectory for leaf in tree.leaves if leaf.stop_reason == "done"]
    assert len(answers) == 3 and all(t.reward == 1.0 for t in answers)  # the policy reads the secret
    opening = LoudSecretToolEnv().reset(task)
    prompt = renderer.prompt(opening, None)
    assert call.input_ids[: len(prompt)].tolist() == prompt and "<think>" in renderer.render(opening, None, True)
    history = finished[0][:-1]  # the conversation before the answer: the call's reasoning is not in it
    context = renderer.prompt(history, None)
    assert history[2]["reasoning_content"] and history[2]["reasoning_content"] not in renderer.render(
        history, None, True
    )
    for answer in answers:  # each answer: exactly its context (the template's rendering), then its sampled turn
        assert answer.input_ids[: len(context)].tolist() == context
        assert answer.loss_mask[: len(context)].sum() == 0 and answer.loss_mask[len(context) :].all()
    counts = token_counts([leaf.trajectory for leaf in tree.leaves])
    assert counts.tree_tokens < counts.flat_tokens < independent_tokens(tree)
    report = compare([leaf.trajectory for leaf in tree.leaves], MODEL, dtype="float64")
    assert report["passed"] and report["loss_rel_err"] <= 1e-10 and report["max_rel_grad_err"] <= 1e-10, report


def test_qwen3_keeps_reasoning_in_a_tool_loop_and_a_user_message_strips_it() -> None:
    renderer = renderer_of("qwen3")
    turn = renderer.format.parse(SCRIPTS["qwen3"][0](1, 2), "call_1").turn
    conversation = [*Adder().reset({}), renderer.message(turn)]
    ids = renderer.prompt(conversation[:2], None)  # stands for the sampled ids: only their stop token is read
    ids += renderer.encode(SCRIPTS["qwen3"][0](1, 2)) + [renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    result = {"role": "tool", "tool_call_id": "call_1_0", "content": "3"}
    assert renderer.bridge(ids, conversation, [result], None)  # a tool result: the reasoning stays
    with pytest.raises(NotAppendOnly):  # the earlier turn renders without its reasoning now
        renderer.bridge(ids, conversation, [{"role": "user", "content": "and now?"}], None)


def test_reasoning_reuse_command_prints_the_table(capsys) -> None:
    from ds_tree.cli import main

    argv = ["--template", "qwq", "--episodes", "1", "--reasoning-tokens", "8", "--width", "2"]
    assert main(["reasoning-reuse", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| template | answers | rewritten | tree |") and lines[2].startswith("| qwq | 2 | 1 |")
