"""How a step executes: the runners per item kind (packed rows, walked trees, sequence-parallel
shards), the dfs walks, the optimizer updates, the policy's engine, the reference model, the self-check;
and the trainer (:mod:`ds_tree.engine.trainer`), which runs every objective (:mod:`ds_tree.objectives`) on
them. A run's life around the steps (checkpoints, metrics, export, ...) is :mod:`ds_tree.run`.
"""
