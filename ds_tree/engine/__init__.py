"""How a step executes: the runners per item kind (packed rows, walked trees, sequence-parallel
shards), the dfs walks, the RL step, the reference policy, the self-check and the trainer. A run's
life around the steps (checkpoints, metrics, export, ...) is :mod:`ds_tree.run`.
"""
