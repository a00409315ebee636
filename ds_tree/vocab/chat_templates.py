"""Chat templates written here, one per model family's documented chat and tool-call format.

Tests and CPU runs cannot download a family's tokenizer, so ``ds-tree make-tokenizer --chat-format
NAME`` gives the project's byte-level tokenizer a template of that family: the family's special
tokens (added to the vocabulary as special tokens) and its layout of system, user, assistant turns,
tool calls, tool results and reasoning. The templates are this project's own Jinja, written from
the families' public descriptions of their formats; they reproduce the structure a parser must
handle, not every sentence of the originals (e.g. the tools' instructions are worded here).

Each entry names its turn format (``ds_tree.turn_formats``: how a sampled turn is parsed) and
the special tokens the template needs. Messages are OpenAI-style; an assistant message's reasoning
is ``reasoning_content``. Call ids are not rendered (as in the project's template: they are random
per sample). HF renders with ``trim_blocks``, so newlines are written as ``{{ '\\n' }}`` expressions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    template: str
    special_tokens: tuple[str, ...]
    """Tokens beyond the project's five (``<|pad|>``, ``<|bos|>``, ``<|eos|>``, ``<|im_start|>``, ``<|im_end|>``)."""
    turn_format: str
    """The registered turn format (``rollout.env.format``) that parses what this template prompts."""
    description: str


# Tool calls render Hermes/Qwen-style inside the assistant turn; tool results as a "tool" turn.
# Call ids are not rendered (as in Qwen's and Hermes' templates): they are random per sample, and
# rendering them would make temperature-0 trials diverge at their first tool call. Results match
# calls by order. Tools (OpenAI function schemas) go into the system block.
CHAT_TEMPLATE = (
    "{% set system_first = messages and messages[0].role == 'system' %}"
    "{% if system_first or tools %}"
    "<|im_start|>system\n"
    "{% if system_first and messages[0].content %}{{ messages[0].content }}{% endif %}"
    # HF renders with trim_blocks: a newline right after a block tag is dropped, hence {{ '\n' }}.
    "{% if tools %}{{ '\\n\\n# Tools\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and system_first %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "<tool_call>\n"
    '{"name": {{ call.function.name | tojson }}, '
    '"arguments": {{ call.function.arguments }}}\n'
    "</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>tool\n"
    "<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# ------------------------------------------------------------------ ChatML + <tool_call> JSON + <think>
_CHATML_TOOLS = (
    "{% if tools %}"
    "{{ '# Tools\\n\\nYou may call functions. Their signatures are in <tools></tools>:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    '{{ \'\\n</tools>\\n\\nCall one as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>\' }}'
    "{% endif %}"
)


# The end of a Qwen-family assistant turn and the other turns: consecutive tool results share one
# user turn, each in <tool_response> tags (Qwen3 and Qwen3-Coder alike).
_QWEN_TURN_END_AND_OTHER_TURNS = (
    "<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ message.content }}{{ '\\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
)


def _chatml_reasoning(keep: str, generation_prompt: str) -> str:
    """Qwen3-style ChatML with ``<think>`` reasoning; ``keep`` is a Jinja test of whether message
    ``loop.index0`` shows its reasoning."""
    return (
        "{% set ns = namespace(last_query=-1) %}"
        "{% for message in messages %}"
        "{% if message.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}"
        "{% endfor %}"
        "{% set system_first = messages and messages[0].role == 'system' %}"
        "{% if system_first or tools %}"
        "<|im_start|>system\n"
        "{% if system_first and messages[0].content %}{{ messages[0].content }}"
        "{% if tools %}{{ '\\n\\n' }}{% endif %}{% endif %}" + _CHATML_TOOLS + "<|im_end|>\n"
        "{% endif %}"
        "{% for message in messages %}"
        "{% if loop.first and system_first %}"
        "{% elif message.role == 'assistant' %}"
        "<|im_start|>assistant\n"
        "{% if message.reasoning_content and (" + keep + ") %}"
        "<think>\n{{ message.reasoning_content }}\n</think>\n\n"
        "{% endif %}"
        "{% if message.content %}{{ message.content }}{% endif %}"
        "{% for call in message.tool_calls or [] %}"
        "{% if message.content or not loop.first %}{{ '\\n' }}{% endif %}"
        '<tool_call>\n{"name": {{ call.function.name | tojson }}, "arguments": '
        "{% if call.function.arguments is string %}{{ call.function.arguments }}"
        "{% else %}{{ call.function.arguments | tojson }}{% endif %}}\n</tool_call>"
        "{% endfor %}"
        + _QWEN_TURN_END_AND_OTHER_TURNS
        + "{% if add_generation_prompt %}"
        + generation_prompt
        + "{% endif %}"
    )


QWEN3_TEMPLATE = _chatml_reasoning("loop.index0 > ns.last_query", "<|im_start|>assistant\n")
"""Qwen3: an assistant turn shows its reasoning only after the last user message (in a tool loop
every turn keeps it; a new user message strips the earlier turns' reasoning)."""

QWQ_TEMPLATE = _chatml_reasoning("false", "<|im_start|>assistant\n<think>\n")
"""QwQ / DeepSeek-R1 style: no earlier turn shows its reasoning (history holds final outputs only),
and the generation prompt opens ``<think>``."""

# ------------------------------------------------------------------ Qwen3-Coder: XML-style calls
QWEN3_CODER_TEMPLATE = (
    "{% set system_first = messages and messages[0].role == 'system' %}"
    "{% if system_first or tools %}"
    "<|im_start|>system\n"
    "{% if system_first and messages[0].content %}{{ messages[0].content }}"
    "{% if tools %}{{ '\\n\\n' }}{% endif %}{% endif %}"
    "{% if tools %}"
    "{{ '# Tools\\n\\nYou may call functions:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nCall one as <tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n"
    "</function>\\n</tool_call>' }}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and system_first %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{% if message.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "{% if call.function.arguments is string %}"
    "{{ raise_exception('qwen3_coder renders tool-call arguments as an object, not a JSON string') }}"
    "{% endif %}"
    "<tool_call>\n<function={{ call.function.name }}>\n"
    "{% for key, value in call.function.arguments.items() %}"
    "<parameter={{ key }}>\n"
    "{% if value is string %}{{ value }}{% else %}{{ value | tojson }}{% endif %}"
    "{{ '\\n</parameter>\\n' }}"
    "{% endfor %}"
    "</function>\n</tool_call>"
    "{% endfor %}" + _QWEN_TURN_END_AND_OTHER_TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# ------------------------------------------------------------------ Llama 3.1: JSON calls, ipython results
LLAMA3_JSON_TEMPLATE = (
    "<|begin_of_text|>"
    "{% set system_first = messages and messages[0].role == 'system' %}"
    "{% if system_first or tools %}"
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools %}"
    "{{ 'Environment: ipython\\n\\nTo call a function, answer with a JSON object '"
    '\'{"name": function name, "parameters": {argument name: value}} and nothing else.\\n\\n\' }}'
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n\\n' }}{% endfor %}"
    "{% endif %}"
    "{% if system_first %}{{ messages[0].content }}{% endif %}"
    "<|eot_id|>"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and system_first %}"
    "{% elif message.role == 'assistant' %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% if message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    "{% if not loop.first %}; {% endif %}"
    '{"name": {{ call.function.name | tojson }}, "parameters": '
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}}"
    "{% endfor %}"
    "{% else %}{{ message.content }}{% endif %}"
    "<|eot_id|>"
    "{% elif message.role == 'tool' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{% else %}"
    "<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# ------------------------------------------------------------------ Mistral (v3): [TOOL_CALLS] JSON list
MISTRAL_TEMPLATE = (
    "<s>"
    "{% set ns = namespace(last_user=-1, system='') %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% if messages and messages[0].role == 'system' %}{% set ns.system = messages[0].content %}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'user' %}"
    "{% if tools and loop.index0 == ns.last_user %}"
    "[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}"
    "[INST] "
    "{% if ns.system and loop.index0 == ns.last_user %}{{ ns.system }}{{ '\\n\\n' }}{% endif %}"
    "{{ message.content }}[/INST]"
    "{% elif message.role == 'assistant' %}"
    "{% if message.tool_calls %}"
    "[TOOL_CALLS] ["
    "{% for call in message.tool_calls %}"
    "{% if not loop.first %}, {% endif %}"
    '{"name": {{ call.function.name | tojson }}, "arguments": '
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}}"
    "{% endfor %}"
    "]"
    "{% else %}{{ message.content }}{% endif %}"
    "</s>"
    "{% elif message.role == 'tool' %}"
    '[TOOL_RESULTS] {"content": {{ message.content | tojson }}}[/TOOL_RESULTS]'
    "{% endif %}"
    "{% endfor %}"
)

# ------------------------------------------------------------------ gpt-oss: the harmony format
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are a helpful assistant.\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{% set system_first = messages and messages[0].role == 'system' %}"
    "{% if system_first or tools %}"
    "<|start|>developer<|message|>"
    "{% if system_first %}{{ '# Instructions\\n\\n' }}{{ messages[0].content }}"
    "{% if tools %}{{ '\\n\\n' }}{% endif %}{% endif %}"
    "{% if tools %}"
    "{{ '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n' }}"
    "{% for tool in tools %}"
    "{{ '\\n// ' }}{{ tool.function.description }}{{ '\\ntype ' }}{{ tool.function.name }}"
    "{{ ' = (_: ' }}{{ tool.function.parameters | tojson }}{{ ') => any;\\n' }}"
    "{% endfor %}"
    "{{ '\\n} // namespace functions' }}"
    "{% endif %}"
    "<|end|>"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and system_first %}"
    "{% elif message.role == 'assistant' %}"
    "{% if message.tool_calls %}"
    "{% if message.reasoning_content %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ message.reasoning_content }}<|end|>"
    "{% endif %}"
    "{% if message.content %}"
    "<|start|>assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>"
    "{% endif %}"
    "{% for call in message.tool_calls %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ call.function.name }} <|constrain|>json<|message|>"
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}"
    "<|call|>"
    "{% endfor %}"
    "{% else %}"
    "<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{% endif %}"
    "{% elif message.role == 'tool' %}"
    "{% set found = namespace(name='unknown') %}"
    "{% for earlier in messages %}{% for call in earlier.tool_calls or [] %}"
    "{% if call.id == message.tool_call_id %}{% set found.name = call.function.name %}{% endif %}"
    "{% endfor %}{% endfor %}"
    "<|start|>functions.{{ found.name }} to=assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>"
    "{% else %}"
    "<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
"""Tool-call turns keep their analysis (reasoning) in history, final answers show none and end with
``<|end|>`` where the model sampled ``<|return|>``."""

LLAMA3_TOKENS = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)

TEMPLATES = {
    template.name: template
    for template in (
        ChatTemplate(
            "hermes",
            CHAT_TEMPLATE,
            (),
            "hermes",
            "the project's ChatML template, Hermes/Qwen2.5 <tool_call> JSON calls (the default)",
        ),
        ChatTemplate(
            "qwen3",
            QWEN3_TEMPLATE,
            ("<think>", "</think>"),
            "qwen3",
            "Qwen3: ChatML, <tool_call> JSON calls, <think> reasoning kept only after the last user message",
        ),
        ChatTemplate(
            "qwq",
            QWQ_TEMPLATE,
            ("<think>", "</think>"),
            "qwen3",
            "QwQ / DeepSeek-R1 style: as qwen3, but no earlier turn shows its reasoning; the prompt opens <think>",
        ),
        ChatTemplate(
            "qwen3_coder",
            QWEN3_CODER_TEMPLATE,
            (),
            "qwen3_coder",
            "Qwen3-Coder: ChatML, <tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>",
        ),
        ChatTemplate(
            "llama3_json",
            LLAMA3_JSON_TEMPLATE,
            (
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|python_tag|>",
            ),
            "llama3_json",
            'Llama 3.1: header tokens, {"name": ..., "parameters": ...} calls, ipython tool results',
        ),
        ChatTemplate(
            "mistral",
            MISTRAL_TEMPLATE,
            (
                "<s>",
                "</s>",
                "[INST]",
                "[/INST]",
                "[TOOL_CALLS]",
                "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ),
            "mistral",
            "Mistral (v3 tokenizer): [INST], [TOOL_CALLS] [JSON list], [TOOL_RESULTS]",
        ),
        ChatTemplate(
            "harmony",
            HARMONY_TEMPLATE,
            ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"),
            "harmony",
            "gpt-oss harmony: channels analysis / commentary / final, to=functions.NAME calls",
        ),
    )
}
"""The templates ``make-tokenizer --chat-format`` can give a tokenizer, by name."""


def chat_template(name: str) -> ChatTemplate:
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat format {name!r}; choose one of {', '.join(TEMPLATES)}")
    return TEMPLATES[name]
