"""On-policy distillation's teacher (``objective.teacher``; docs/RL.md, "On-policy distillation"): the checks
made before any model is built, and its LM head as a plain function for the student's chunked head.

A teacher scores the student's token ids, so both must read them as the same tokens: :func:`check_teacher`
refuses a teacher whose vocabulary differs (a full-vocabulary divergence compares the two distributions
entry by entry; the sampled reverse KL only indexes the teacher's with the student's ids, which must exist
there) and, where both have tokenizer files (``model.tokenizer``, or ``model.source``'s directory, and the
teacher's directory or hub snapshot), one whose tokenizer serialises differently (vocabulary, merges, added
tokens: :func:`~ds_tree.vocab.tokenizer.tokenizer_identity`). A teacher given as a config JSON has no
tokenizer: its vocabulary size is all there is to compare.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ds_tree.data.convert import load_tokenizer
from ds_tree.errors import ConfigError, DataError, HubError
from ds_tree.hub import TOKENIZER_FILES, is_hub_id, local_path
from ds_tree.models.loading import check_hub_weights, load_config
from ds_tree.models.logprobs import SOFTCAP, HeadOf, check_head_chunking
from ds_tree.models.token_mixing import check_layer_types
from ds_tree.models.ulysses import check_heads
from ds_tree.vocab.tokenizer import tokenizer_identity

FULL_VOCABULARY = ("kl", "jsd", "reverse_kl")
"""ds_tree.losses.distill.FULL_VOCABULARY: the losses comparing whole distributions."""


def check_teacher(config) -> None:
    """``objective.teacher`` for ``objective.kind: distill`` (module docstring), with its layer types, its hub
    weights when offline, its heads under sequence parallelism and, for a full-vocabulary loss, its logits
    being its head's (no logit scaling): a :class:`ConfigError` naming the field."""
    objective = config.objective
    if objective.kind != "distill":
        return
    try:
        teacher = load_config(objective.teacher)
        check_layer_types(teacher)
        check_hub_weights(objective.teacher)
        student = load_config(config.model.source)
    except (OSError, ValueError) as error:
        raise ConfigError(f"objective.teacher: {error}") from None
    check_heads(teacher, config.parallel.sequence_parallel_size, objective.teacher)
    teacher_vocab = teacher.get_text_config().vocab_size
    student_vocab = student.get_text_config().vocab_size
    full = objective.distill.loss in FULL_VOCABULARY
    if (full and teacher_vocab != student_vocab) or teacher_vocab < student_vocab:
        need = "the same vocabulary size as" if full else "at least the vocabulary of"
        raise ConfigError(
            f"objective.teacher: {objective.teacher} has a vocabulary of {teacher_vocab} tokens, model.source "
            f"{student_vocab}; distill.loss {objective.distill.loss} needs {need} the student (the teacher must "
            "have the student's tokenizer)"
        )
    if full:
        try:
            check_head_chunking(teacher)
        except ValueError as error:
            raise ConfigError(f"objective.teacher: {error} (the teacher's head is applied chunk by chunk)") from None
    _check_tokenizers(config)


def _tokenizer_dir(source: str) -> Path | None:
    """The directory holding ``source``'s tokenizer files (``tokenizer.json``), if any."""
    if not source:
        return None
    try:
        path = local_path(source, TOKENIZER_FILES) if is_hub_id(source) else Path(source)
    except HubError:
        return None
    return path if path.is_dir() and (path / "tokenizer.json").is_file() else None


def _check_tokenizers(config) -> None:
    """The teacher's tokenizer is the student's, where both have one (module docstring)."""
    teacher_dir = _tokenizer_dir(config.objective.teacher)
    student_dir = _tokenizer_dir(config.model.tokenizer) or _tokenizer_dir(config.model.source)
    if teacher_dir is None or student_dir is None:
        return
    try:
        teacher, student = (tokenizer_identity(load_tokenizer(path)) for path in (teacher_dir, student_dir))
    except DataError as error:
        raise ConfigError(f"objective.teacher: {error}") from None
    if teacher["serialised_sha256"] != student["serialised_sha256"]:
        raise ConfigError(
            f"objective.teacher: the tokenizer of {config.objective.teacher} ({teacher['vocab_size']} tokens, "
            f"sha256 {teacher['serialised_sha256'][:12]}) is not the student's ({student_dir}: "
            f"{student['vocab_size']} tokens, sha256 {student['serialised_sha256'][:12]}); distillation compares "
            "the two models' probabilities of the same token ids: use a teacher with the student's tokenizer"
        )


@torch.no_grad()
def head_of(teacher) -> HeadOf:
    """The teacher's LM head (a model, or a ZeRO-3 engine's, gathered: every rank calls it, a collective) as
    a :class:`~ds_tree.models.logprobs.HeadOf` holding whole copies of its weights: the student's chunks
    apply it to the teacher's hidden states."""
    module = getattr(teacher, "module", teacher)
    head = module.get_output_embeddings()
    parameters = [p for p in (head.weight, getattr(head, "bias", None)) if p is not None]
    partitioned = [p for p in parameters if hasattr(p, "ds_id")]
    if partitioned:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters(partitioned):
            copies = [p.detach().clone() for p in parameters]
    else:
        copies = [p.detach() for p in parameters]
    bias = copies[1] if len(copies) > 1 else None
    return HeadOf(copies[0], bias, getattr(module.config, SOFTCAP, None))
