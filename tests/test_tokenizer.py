"""The project tokenizer: deterministic, exact vocab size, lossless, chat template prefix-stable."""

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ds_tree.cli.make_tokenizer import main as make_tokenizer_main
from ds_tree.vocab.tokenizer import SPECIAL_TOKENS, build_tokenizer

ROOT = Path(__file__).resolve().parents[1]

CONVERSATION = [
    {"role": "system", "content": "You are a telecom agent."},
    {"role": "user", "content": "My data stopped working, phone 555-123-2002."},
    {
        "role": "assistant",
        "content": "Let me look you up.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_customer", "arguments": '{"phone": "555-123-2002"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"customer_id": "C1001"}'},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "refuel_data", "arguments": "{}"}},
            {"id": "call_3", "type": "function", "function": {"name": "reset", "arguments": '{"hard": true}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
    {"role": "tool", "tool_call_id": "call_3", "content": " leading space and trailing newline\n"},
    {"role": "assistant", "content": "  Done: 2.5 GB added.\n"},
    {"role": "user", "content": "thanks"},
]
TOOLS = [{"type": "function", "function": {"name": "get_customer", "parameters": {"type": "object"}}}]


def test_vocab_size_and_special_token_ids(tokenizer):
    assert len(tokenizer) == 1024
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2, 3, 4]
    assert tokenizer.pad_token_id == 0
    assert tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == 3


def test_build_is_deterministic(tokenizer):
    assert build_tokenizer().backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_other_vocab_sizes_are_exact_and_too_small_is_refused():
    assert len(build_tokenizer(512)) == 512
    with pytest.raises(ValueError, match="vocab_size must be"):
        build_tokenizer(200)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world!",
        "  two leading spaces\n\ttab",
        "héllo wörld 😀 日本",
        '{"a": [1, 2.5, null]}',
        "def f(x):\n    return x",
    ],
)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert max(ids) < 1024


def test_chat_template_renders_every_role_and_tool_calls(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION[:6], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a telecom agent.\n\n# Tools\n<tools>\n"
        '{"type": "function", "function": {"name": "get_customer", "parameters": {"type": "object"}}}\n'
        "</tools><|im_end|>\n"
        "<|im_start|>user\nMy data stopped working, phone 555-123-2002.<|im_end|>\n"
        "<|im_start|>assistant\nLet me look you up.<tool_call>\n"
        '{"name": "get_customer", "arguments": {"phone": "555-123-2002"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n"
        '{"customer_id": "C1001"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "refuel_data", "arguments": {}}\n</tool_call><tool_call>\n'
        '{"name": "reset", "arguments": {"hard": true}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tools_without_system_message_get_a_system_block(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION[1:2], tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\n\n\n# Tools\n<tools>\n")
    assert text.endswith("<|im_start|>user\nMy data stopped working, phone 555-123-2002.<|im_end|>\n")


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_is_token_prefix_stable(tokenizer, tools):
    def encode(messages, generation_prompt=False):
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        return tokenizer.encode(text, add_special_tokens=False)

    full = encode(CONVERSATION)
    for count in range(1, len(CONVERSATION)):
        prefix = encode(CONVERSATION[:count])
        assert full[: len(prefix)] == prefix, count
        if CONVERSATION[count]["role"] == "assistant":
            with_prompt = encode(CONVERSATION[:count], generation_prompt=True)
            assert full[: len(with_prompt)] == with_prompt, count


def test_cli_writes_a_directory_autotokenizer_loads(tmp_path, tokenizer):
    output = tmp_path / "tok"
    subprocess.run([sys.executable, "tools/make_tokenizer.py", "--output", str(output)], cwd=ROOT, check=True)
    loaded = AutoTokenizer.from_pretrained(output, local_files_only=True)
    assert loaded.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert loaded.chat_template == tokenizer.chat_template


def test_cli_refuses_an_output_that_is_a_file(tmp_path, capsys):
    output = tmp_path / "tok"
    output.write_text("not a directory")
    assert make_tokenizer_main(["--output", str(output)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"error: {output}: exists and is not a directory\n"
    assert output.read_text() == "not a directory"
