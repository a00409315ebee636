"""Objectives as components: each ``objective.kind`` one class registered in :data:`ds_tree.registries.OBJECTIVES`
(:mod:`ds_tree.objectives.base` says what every objective implements): the SFT loss (:mod:`.sft`), and the
clipped policy-gradient objective of GRPO and PPO (:mod:`.policy_gradient`) with its row passes
(:mod:`.rl_rows`) and KL reference (:mod:`.reference`).
"""
