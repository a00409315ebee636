"""Tree-vs-flat checks: the same weights and data run as trees and as flat paths, loss, log-probs and
every gradient compared (``ds-tree verify``).

``tree_vs_flat`` (SFT and RL in one process), ``sequence_parallel`` and ``sequence_parallel_rl``
(Ulysses over spawned gloo ranks), ``dfs_sequence_parallel`` (walked shards). They sit above the
engine and import nothing from the benchmarks; the measure itself (:mod:`ds_tree.comparison`) sits
below the engine, since the trainer's self-check uses it too.
"""
