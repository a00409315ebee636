"""Memory, predicted and measured: ``predict`` (peak bytes per rank from the model's shape and the
config: model states under ZeRO, activations, the LM head; ``ds-tree plan``) and ``meters`` (what
autograd actually saves for backward, for benchmarks and tests). Pure arithmetic and hooks: nothing
here imports the rest of the package.
"""
