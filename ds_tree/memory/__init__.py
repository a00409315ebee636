"""Memory, predicted and measured: ``predict`` (peak bytes per rank from the model's shape and the
config: model states under ZeRO, activations, the LM head; ``ds-tree plan``) and ``meters`` (what
autograd actually saves for backward, for benchmarks and tests). Pure arithmetic and hooks; ``predict``
reads a hybrid model's recurrent mixers through its family spec (:mod:`ds_tree.models.families`), so the
package sits above the models (tests/test_layering.py).
"""
