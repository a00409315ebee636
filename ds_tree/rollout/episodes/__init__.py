"""Multi-turn episodes (docs/ENVIRONMENTS.md): the episode tree and its leaves (``tree``), the runner that
samples one against its environment (``runner``), the tasks and environment a run reads, checked at config
time (``tasks``), and a step's trees as metrics and saved rollouts (``records``). The online loop's
multi-turn mode (:mod:`ds_tree.rollout.multiturn`) drives them.
"""
