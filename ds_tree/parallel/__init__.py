"""Parallelism beyond data parallelism: Ulysses sequence parallelism with the tree attention."""

from ds_tree.parallel.ulysses import (
    SequenceParallelGroup,
    check_heads,
    check_sequence_parallel,
    enable_sequence_parallel,
)

__all__ = ["SequenceParallelGroup", "check_heads", "check_sequence_parallel", "enable_sequence_parallel"]
