"""A run's life around its steps: the output directory and its lock, the DeepSpeed config's "auto"
values, checkpoints (complete or not at all), preemption, metrics (TensorBoard and metrics.jsonl), the
console, the Hugging Face export, op builds and shared memory. The engine (:mod:`ds_tree.engine`)
executes steps; the trainer uses both. Nothing here imports the engine.
"""
