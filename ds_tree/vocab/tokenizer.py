"""The project's own small byte-level BPE tokenizer, with a ChatML-like chat template.

Tests and CPU smoke runs need a real tokenizer with a chat template, and nothing may be downloaded
from a hub, so the project trains one: byte-level BPE (every byte sequence is encodable, as in
GPT-2/Qwen) over text generated here from templates and word lists: agent chat, tool calls, JSON,
numbers, code-ish lines. Generation uses a seeded ``random.Random`` and the BPE trainer breaks ties
deterministically, so the same vocab size gives byte-identical ``tokenizer.json`` every run.

Special tokens take the first ids (``<|pad|>`` is 0), so synthetic data can sample content ids
from ``[len(SPECIAL_TOKENS), vocab)``.

The chat template is prefix-stable: every message renders as ``<|im_start|>role\\n...<|im_end|>\\n``
and depends only on itself (and on the tools list, which goes into the first system block), so
rendering the first k messages is a string prefix of rendering all of them. Because the split
between two messages falls right before the special token ``<|im_start|>``, the token sequence is a
prefix too: the tokenizer splits on special tokens before BPE runs.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ds_tree.vocab.chat_templates import chat_template

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
"""Ids 0..4 in this order."""

DEFAULT_VOCAB_SIZE = 1024
"""What the tiny model configs use."""

CORPUS_SEED = 0

_WORDS = (
    "the a an to of and in for on with your you I we it is are was be can will please "
    "account line data plan bill payment phone number customer service roaming device network "
    "signal issue problem check status update reset restart settings mobile internet speed "
    "order refund item shipping address flight booking reservation seat cancel change user "
    "agent tool call result error success found not available help thanks sure let me first "
    "now then next step answer question reason because however therefore so if else return "
    "function value list string number true false null file path test run build model train "
    "loss token tree batch step epoch rank memory time date price total left right"
).split()
_NAMES = "get_customer get_details_by_id refuel_data toggle_airplane_mode search_flights "
_NAMES += "cancel_order get_weather calculate transfer_to_human_agents send_email read_file"
_FUNCTIONS = _NAMES.split()
_KEYS = "id name status amount phone_number email date city plan_id count value query limit".split()


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", ".", "?", "!", ":"])


def _number(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        return str(rng.randint(0, 999))
    if kind < 0.7:
        return f"{rng.uniform(0, 100):.{rng.randint(1, 3)}f}"
    return f"{rng.randint(100, 999)}-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}"


def _json_object(rng: random.Random) -> str:
    keys = rng.sample(_KEYS, rng.randint(1, 5))
    values = [rng.choice([_number(rng), rng.choice(_WORDS), rng.random() < 0.5]) for _ in keys]
    return json.dumps(dict(zip(keys, values, strict=True)))


def _code(rng: random.Random) -> str:
    name, arg = rng.choice(_FUNCTIONS), rng.choice(_KEYS)
    return (
        f"def {name}({arg}):\n    if {arg} is None:\n        return {_number(rng)}\n"
        f"    result = [{arg} * {rng.randint(1, 9)} for {arg} in range({rng.randint(2, 64)})]\n"
        f"    return result\n"
    )


def _conversation(rng: random.Random) -> str:
    """One agent conversation in the template's own format, so its markup becomes tokens."""
    parts = [f"<|im_start|>system\n{_sentence(rng)} {_sentence(rng)}<|im_end|>\n"]
    parts.append(f"<|im_start|>user\n{_sentence(rng)} {_number(rng)}<|im_end|>\n")
    for _ in range(rng.randint(1, 4)):
        call = {"name": rng.choice(_FUNCTIONS), "arguments": json.loads(_json_object(rng))}
        parts.append(
            f"<|im_start|>assistant\n{_sentence(rng)}<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>\n"
        )
        parts.append(f"<|im_start|>tool\n<tool_response>\n{_json_object(rng)}\n</tool_response><|im_end|>\n")
    parts.append(f"<|im_start|>assistant\n{_sentence(rng)} {_sentence(rng)}<|im_end|>\n")
    return "".join(parts)


def training_corpus(n_documents: int = 3000, seed: int = CORPUS_SEED) -> Iterator[str]:
    """Deterministic synthetic training text (about 1.5 MB for the default 3000 documents)."""
    rng = random.Random(seed)
    makers = (_conversation, _conversation, _code, lambda r: " ".join(_sentence(r) for _ in range(5)))
    for _ in range(n_documents):
        yield rng.choice(makers)(rng)


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, chat_format: str = "hermes") -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer; its vocabulary has exactly ``vocab_size`` entries.

    ``chat_format`` names a template of :mod:`ds_tree.vocab.chat_templates`; its family's special
    tokens follow the project's five (the default ``hermes`` adds none: the same tokenizer as ever)."""
    template = chat_template(chat_format)
    special_tokens = SPECIAL_TOKENS + [token for token in template.special_tokens if token not in SPECIAL_TOKENS]
    minimum = len(special_tokens) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size <= minimum:
        raise ValueError(f"vocab_size must be > {minimum} (special tokens + 256 byte symbols), got {vocab_size}")
    backend = Tokenizer(models.BPE())
    # add_prefix_space=False keeps rendering prefix-stable: no space is invented at segment starts.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Encoding splits text at special tokens before BPE runs; the trainer does not, so split the
    # corpus the same way, or merges such as ".<|" would waste vocabulary on markup never seen.
    special = re.compile("|".join(re.escape(token) for token in special_tokens))
    segments = (segment for document in training_corpus() for segment in special.split(document) if segment)
    backend.train_from_iterator(segments, trainer=trainer)
    if backend.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"BPE training produced {backend.get_vocab_size()} tokens instead of {vocab_size}: "
            "the generated corpus has too few distinct merges for this vocab size"
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        extra_special_tokens=special_tokens[3:],
    )
    tokenizer.chat_template = template.template
    return tokenizer


def save_tokenizer(output_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE, chat_format: str = "hermes") -> Path:
    """Build the tokenizer and ``save_pretrained`` it; ``AutoTokenizer`` loads the directory offline."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():  # save_pretrained would only log an error
        raise FileExistsError(f"{output_dir}: exists and is not a directory")
    build_tokenizer(vocab_size, chat_format).save_pretrained(output_dir)
    return output_dir


def tokenizer_identity(tokenizer: PreTrainedTokenizerFast) -> dict:
    """What a converted dataset records about the tokenizer that produced its ids.

    ``serialised_sha256`` hashes the canonical serialisation of vocabulary, merges, added tokens
    and normalisation (``backend_tokenizer.to_str()``, what ``tokenizer.json`` holds, but without
    the file's pretty-printing, so it does not depend on how the file was written). Two
    tokenizers with the same hash give the same ids for the same text.
    """
    serialised = tokenizer.backend_tokenizer.to_str()
    return {
        "name_or_path": str(tokenizer.name_or_path),
        "vocab_size": len(tokenizer),
        "serialised_sha256": hashlib.sha256(serialised.encode("utf-8")).hexdigest(),
    }
