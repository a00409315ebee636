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

import torch

from ds_tree.errors import ConfigError
from ds_tree.model_roles.compatibility import check_same_tokenizer, role_config
from ds_tree.models.loading import load_config
from ds_tree.models.logprobs import SOFTCAP, HeadOf, check_head_chunking
from ds_tree.models.ulysses import check_heads

FULL_VOCABULARY = ("kl", "jsd", "reverse_kl")
"""ds_tree.losses.distill.FULL_VOCABULARY: the losses comparing whole distributions."""


def check_teacher(config) -> None:
    """``objective.teacher`` for ``objective.kind: distill`` (module docstring), with its layer types, its hub
    weights when offline, its heads under sequence parallelism and, for a full-vocabulary loss, its logits
    being its head's (no logit scaling): a :class:`ConfigError` naming the field."""
    objective = config.objective
    if objective.kind != "distill":
        return
    teacher = role_config(objective.teacher, "objective.teacher")
    try:
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


def _check_tokenizers(config) -> None:
    """The teacher's tokenizer is the student's, where both have one (module docstring)."""
    why = (
        "distillation compares the two models' probabilities of the same token ids: use a teacher with the "
        "student's tokenizer"
    )
    check_same_tokenizer(config, config.objective.teacher, "objective.teacher", "student", why)


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
